"""Activation checkpointing: recompute each transformer block in backward instead of storing it."""

from torch import nn

from raymp.torch_compat import checkpoint_wrapper


def apply_activation_checkpointing(model: nn.Module, block_names: list[str]) -> None:
    for name in block_names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        parent.register_module(child, checkpoint_wrapper(parent.get_submodule(child)))
