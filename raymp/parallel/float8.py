"""precision fp8: torchao's float8 training applied to the built-in model's transformer blocks
(each nn.Linear becomes a Float8Linear: matmuls in float8 with dynamic scales, weights and
gradients kept in their own dtype). Applied before activation checkpointing, compilation and
FSDP2, as torchtitan applies it. The embedding and the output head stay in bf16: the head's
vocabulary is rarely a multiple of 16 (float8 matmuls need one) and is the layer most sensitive
to float8's range. torchao does this well; raymp only decides where and checks the device."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (8.9) and Hopper (9.0) onwards


class Float8Unavailable(RuntimeError):
    """This device or environment cannot train in float8; the message says why and what to set."""


def check_device(device: torch.device) -> None:
    if device.type != "cuda":
        raise Float8Unavailable("precision fp8 needs a CUDA device; set precision=bf16")
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise Float8Unavailable(
            f"precision fp8 needs float8 tensor cores (compute capability 8.9+), but "
            f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}; set precision=bf16")


def converts(fqn: str, module: nn.Module) -> bool:
    """Which linears compute in float8: those inside the transformer blocks whose both dimensions
    are multiples of 16."""
    return (fqn.startswith("layers.") and isinstance(module, nn.Linear)
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def apply_float8(model: nn.Module, recipe: str, fsdp_all_gather: bool) -> None:
    """Swap the model's block linears (those `converts` picks) for float8 ones, in place."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as exc:
        raise Float8Unavailable(f"precision fp8 needs torchao ({exc}): pip install torchao (ran with 0.18), "
                                "or set precision=bf16") from None
    config = Float8LinearConfig.from_recipe_name(recipe)
    if fsdp_all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: converts(fqn, m))
