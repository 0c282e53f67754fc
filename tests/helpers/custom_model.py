"""A user's own model for the model.factory tests: not raymp's code, just the stageable shape
(tok_embeddings, layers, norm, output) and a plan for tensor parallelism."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        # A causal "token mixer": each position adds the running mean of the ones before it.
        steps = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype).view(1, -1, 1)
        x = x + x.cumsum(1) / steps
        return x + self.down(torch.relu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab_size: int, dim: int = 32, n_layers: int = 4):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim) for i in range(n_layers)})
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, x):
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


def build(vocab_size: int) -> nn.Module:
    return TinyLM(vocab_size)


def tp_plan(module, sequence_parallel: bool) -> dict:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"layers.*.up": ColwiseParallel(), "layers.*.down": RowwiseParallel()}
    if module.output is not None:
        plan["output"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    return plan


class NotStageable(nn.Module):
    def __init__(self, vocab_size: int):
        super().__init__()
        self.body = nn.Sequential(nn.Embedding(vocab_size, 16), nn.Linear(16, vocab_size))

    def forward(self, x):
        return self.body(x)


def build_flat(vocab_size: int) -> nn.Module:
    return NotStageable(vocab_size)
