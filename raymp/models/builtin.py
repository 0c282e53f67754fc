"""The built-in Llama-style model as a ModelSpec: its init, its TP plan (llama_tp.py)."""

from __future__ import annotations

import math

import torch
from torch import nn

from raymp.models.llama import ModelArgs, Transformer
from raymp.models.moe import MoEFeedForward
from raymp.models.spec import ModelSpec, seeded_normal


class BuiltinSpec(ModelSpec):
    def __init__(self, args: ModelArgs, seed: int = 0):
        self.args, self.seed = args, seed
        self.tie_embeddings = args.tie_embeddings
        self.num_layers = args.n_layers

    def build_meta(self) -> nn.Module:
        return Transformer(self.args)

    def initial_value(self, name: str, shape) -> torch.Tensor:
        if name.endswith("norm.weight"):
            return torch.ones(shape)
        std = self.args.init_std
        # Residual projections shrink with depth (GPT-2 / Llama practice) so activations stay O(1).
        if name.endswith(("wo.weight", "w2.weight", "experts.w2")):
            std = std / math.sqrt(2 * self.args.n_layers)
        return seeded_normal(self.seed, name, shape, std)

    def reset_buffers(self, module: nn.Module) -> None:
        module.reset_buffers()

    def tensor_parallel(self, module: nn.Module, tp_mesh, sequence_parallel: bool) -> None:
        from torch.distributed.tensor.parallel import parallelize_module

        from raymp.models.llama_tp import block_plan, model_plan

        for block in module.layers.values():
            moe = isinstance(block.feed_forward, MoEFeedForward)
            parallelize_module(block, tp_mesh, block_plan(sequence_parallel, moe))
        parallelize_module(module, tp_mesh, model_plan(module, sequence_parallel))

    def num_params(self) -> int:
        return self.args.num_params
