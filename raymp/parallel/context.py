"""Context parallelism (`parallel.cp`): each sequence split over cp ranks, DeepSpeed-Ulysses style.

Outside attention every operation is per token, so a rank runs only its slice of the sequence
and holds 1/cp of the activations. Attention needs the tokens before it: an all-to-all turns
q, k, v from [b, h, s/cp, d] (every head, this rank's slice) into [b, h/cp, s, d] (a share of the
heads, the whole sequence); attention runs unchanged, causal or under a document mask over the
whole sequence; a second all-to-all turns the output back.

Why Ulysses and not ring attention: every rank computes whole-sequence attention for its heads,
so a causal mask costs every rank the same (ring attention needs a load-balancing permutation of
the sequence for that), and any mask works unchanged. torch's own context parallelism (ring
attention on DTensor, torch 2.13) dispatches only the flash, memory-efficient and cuDNN SDPA
kernels: no attention mask, and not CPU's kernel. The price: cp x tp must divide the heads, and
four all-to-alls of a block's q/k/v/output per layer forward (as many backward).

Applied from outside: the model's attention calls its `core` module (ScaledDotProductAttention),
which is swapped for UlyssesAttention; the RoPE tables are shifted to the slice's first position.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from raymp.models.llama import ScaledDotProductAttention
from raymp.torch_compat import drop_buffer


class _AllToAll(torch.autograd.Function):
    """All-to-all over dim 0 (equal chunks, one per rank). Its own inverse, so the backward is the
    same exchange. (torch.distributed.nn.functional.all_to_all_single does this but is
    deprecated in favour of a private module.)"""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.group), None


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()  # first: empty_like keeps a permuted input's strides, the collective writes rows
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def sequence_to_heads(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """[b, h, s/cp, d] (all heads, this rank's slice) -> [b, h/cp, s, d] (this rank's heads)."""
    b, h, s, d = x.shape
    chunks = x.reshape(b, cp, h // cp, s, d).transpose(0, 1)  # [cp: head group, b, h/cp, s/cp, d]
    got = _AllToAll.apply(chunks, group)  # [cp: sequence slice, b, h/cp, s/cp, d]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def heads_to_sequence(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """The inverse: [b, h/cp, s, d] -> [b, h, s/cp, d]."""
    b, h, s, d = x.shape
    chunks = x.reshape(b, h, cp, s // cp, d).permute(2, 0, 1, 3, 4)  # [cp: sequence slice, ...]
    got = _AllToAll.apply(chunks, group)  # [cp: head group, b, h, s/cp, d]
    return got.transpose(0, 1).reshape(b, cp * h, s // cp, d)


class UlyssesAttention(nn.Module):
    """ScaledDotProductAttention over the whole sequence for a share of the heads. The mask, if
    any, is the whole sequence's ([b, 1, s, s]): the executor builds it from every rank's tokens."""

    def __init__(self, group, cp: int):
        super().__init__()
        self.group, self.cp = group, cp
        self.attend = ScaledDotProductAttention()

    def forward(self, q, k, v, mask=None):
        q, k, v = (sequence_to_heads(t, self.group, self.cp) for t in (q, k, v))
        return heads_to_sequence(self.attend(q, k, v, mask), self.group, self.cp)


def apply_context_parallel(model: nn.Module, cp_mesh, seq_len: int) -> None:
    """Make the built-in model (or a pipeline stage of it) run this rank's slice of each
    sequence: attention through UlyssesAttention, RoPE at the slice's global positions."""
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    group, swapped = cp_mesh.get_group(), 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is ScaledDotProductAttention:
                setattr(module, name, UlyssesAttention(group, cp))
                swapped += 1
    if not swapped and len(getattr(model, "layers", ())):  # never train with attention over a slice only
        raise ValueError(f"context parallelism found no ScaledDotProductAttention in {type(model).__name__}")
    start = rank * (seq_len // cp)
    # The tables are indexed from 0 by position in the slice: start them at the slice's first
    # token. They now differ between the ranks of a data-parallel group, so they stop being
    # buffers (DDP broadcasts buffers from its group's rank 0, which would undo the shift).
    for name in ("rope_cos", "rope_sin"):
        table = drop_buffer(model, name)
        setattr(model, name, table[start:].clone())


def sequence_slice(x: torch.Tensor, cp_mesh) -> torch.Tensor:
    """This cp rank's contiguous share of dim 1 (the sequence) of [b, s, ...]."""
    if cp_mesh is None or cp_mesh.size() == 1:
        return x
    return x.chunk(cp_mesh.size(), dim=1)[cp_mesh.get_local_rank()].contiguous()
