"""Building the configured model: its ModelSpec (the built-in decoder, a Hugging Face causal LM
or a factory's module) and the whole model on one device (the single-process reference)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from raymp.models.args import ModelArgs, model_args
from raymp.models.builtin import BuiltinSpec
from raymp.models.spec import ModelSpec, build_part


def model_spec(model_cfg, vocab_size: int, seed: int = 0) -> ModelSpec:
    """The ModelSpec of a resolved ModelConfig; `seed` drives the initial weights."""
    if model_cfg.hf is not None or model_cfg.hf_config is not None:
        from raymp.models.hf import HFSpec

        return HFSpec.from_model_config(model_cfg, seed)
    if model_cfg.factory is not None:
        from raymp.models.custom import FactorySpec

        return FactorySpec.from_model_config(model_cfg, vocab_size, seed)
    return BuiltinSpec(model_args(model_cfg, vocab_size), seed)


def build_model(spec: ModelSpec | ModelArgs, seed: int, device: str | torch.device = "cpu",
                prune: Callable[[nn.Module], None] | None = None) -> nn.Module:
    """Same seed -> same weights on every rank and in the single-process reference. Built on
    the meta device first; `prune` may drop what this rank does not own (a pipeline stage keeps
    its layers only), so memory is only ever spent on the kept part."""
    if isinstance(spec, ModelArgs):
        spec = BuiltinSpec(spec, seed)
    return build_part(spec, device, prune=prune)
