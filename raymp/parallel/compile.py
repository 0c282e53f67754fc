"""Regional compilation: torch.compile of each transformer block, in place (`nn.Module.compile`
keeps parameter names, so checkpoints and exports are unchanged). Applied after tensor
parallelism and activation checkpointing and before data parallelism/FSDP, torchtitan's order:
the blocks are alike, so one block's compiled graph serves the others and compilation costs
about one block's worth, not the whole model's."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from raymp.models.moe import MoEFeedForward
from raymp.parallel.experts import stacked_experts
from raymp.torch_compat import set_compile_threads, unwrapped


def apply_compile(model: nn.Module, block_names: list[str], tensor_parallel: bool) -> None:
    """Each block compiled in place. Under tensor parallelism only each block's sharded
    sub-modules (attention, MLP) are, the norms and residual adds stay eager: torch 2.13 on CPU
    fails in the backward of a whole tensor-parallel block (an eager DTensor redistribution is
    handed a plain tensor), and a compiled norm fed by the embedding's to_local gives a wrong
    embedding gradient (0.03 off, measured in two gloo processes); attention and MLP compiled
    alone give eager's gradients. In a mixture-of-experts block (the built-in model's, or a
    Hugging Face family's) every part but the routed feed-forward is compiled: its token counts
    per expert change every step (data-dependent shapes, and under expert parallelism
    all-to-alls of those counts), so it stays eager. A module
    without the stageable shape's blocks (a model.factory module, refused with tp > 1 by the
    config rules) is compiled whole."""
    # As many compile workers as the actor has threads: inductor's default pool starts a
    # subprocess per core of the machine, which on an actor that owns a core or two only
    # competes with training (its start-up costs more than it saves for raymp's few, alike blocks).
    set_compile_threads(max(1, torch.get_num_threads()))
    for name in block_names:
        block = model.get_submodule(name)
        inner = unwrapped(block)  # under activation checkpointing
        routed = any(_routes_tokens(child) for child in inner.children())
        if not tensor_parallel and not routed:
            block.compile()
            continue
        for child in inner.children():
            if _routes_tokens(child) or (tensor_parallel and not _has_sharded_parameters(child)):
                continue
            child.compile()
    if not block_names:
        model.compile()


def _routes_tokens(module: nn.Module) -> bool:
    """Whether `module` holds a routed feed-forward: the built-in model's MoE block, or one of
    transformers' experts modules (Mixtral's and Qwen-MoE's sparse blocks)."""
    built_in = any(isinstance(m, MoEFeedForward) for m in module.modules())
    return built_in or bool(stacked_experts(module))


def _has_sharded_parameters(module: nn.Module) -> bool:
    """Whether a tensor-parallel plan split some of the module's weights (a DTensor with a Shard
    placement), as Colwise/RowwiseParallel do; a SequenceParallel norm's weights are replicated."""
    return any(isinstance(p, DTensor) and any(isinstance(pl, Shard) for pl in p.placements)
               for p in module.parameters())
