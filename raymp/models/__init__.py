"""Models. `model_spec(cfg.model, vocab)` describes the configured model (the built-in
Llama-style decoder, a Hugging Face causal LM, or a module from your own factory);
`build_model(spec, seed)` builds it whole on one device (the single-process reference)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from raymp.models.builtin import BuiltinSpec
from raymp.models.llama import ModelArgs, Transformer
from raymp.models.moe import MoEArgs
from raymp.models.presets import PRESETS
from raymp.models.spec import ModelSpec, build_part

__all__ = ["ModelArgs", "ModelSpec", "Transformer", "PRESETS", "build_model",
           "model_args", "model_spec"]


def model_args(model_cfg, vocab_size: int) -> ModelArgs:
    """The shape the planner reasons about (for a Hugging Face model, its config's shape as
    the config section was filled from it); vocab_size from the tokenizer unless set."""
    return ModelArgs(
        vocab_size=model_cfg.vocab_size or vocab_size,
        dim=model_cfg.dim,
        n_layers=model_cfg.n_layers,
        n_heads=model_cfg.n_heads,
        n_kv_heads=model_cfg.n_kv_heads,
        ffn_dim=model_cfg.ffn_dim,
        max_seq_len=model_cfg.max_seq_len,
        rope_theta=model_cfg.rope_theta,
        norm_eps=model_cfg.norm_eps,
        tie_embeddings=model_cfg.tie_embeddings,
        init_std=model_cfg.init_std,
        moe=None if model_cfg.moe is None else MoEArgs(**model_cfg.moe.model_dump()),
    )


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
