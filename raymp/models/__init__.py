"""Built-in models. `build_model(cfg)` turns a resolved ModelConfig into a plain nn.Module."""

from __future__ import annotations

from typing import Callable

import torch

from raymp.models.llama import ModelArgs, Transformer
from raymp.models.presets import PRESETS

__all__ = ["ModelArgs", "Transformer", "PRESETS", "build_model", "count_parameters", "model_args"]


def model_args(model_cfg, vocab_size: int) -> ModelArgs:
    """ModelArgs from a ModelConfig; vocab_size comes from the tokenizer unless the config sets it."""
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
    )


def build_model(args: ModelArgs, seed: int, device: str | torch.device = "cpu",
                prune: Callable[[Transformer], None] | None = None) -> Transformer:
    """Same seed -> same weights on every rank and in the single-process reference.

    The model is laid out on the meta device first; `prune` may then drop what this rank does not
    own (a pipeline stage keeps its layers only), so memory is only ever spent on the kept part."""
    with torch.device("meta"):
        model = Transformer(args)
    if prune is not None:
        prune(model)
    model.to_empty(device=device)
    model.tie_weights()
    model.init_weights(seed)
    return model


def count_parameters(args: ModelArgs) -> int:
    """Parameters of the whole model (tied weights once), counted without allocating them."""
    return args.num_params
