"""Built-in models. `build_model(cfg)` turns a resolved ModelConfig into a plain nn.Module."""

from __future__ import annotations

import torch

from raymp.models.llama import ModelArgs, Transformer
from raymp.models.presets import PRESETS

__all__ = ["ModelArgs", "Transformer", "PRESETS", "build_model", "model_args"]


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


def build_model(args: ModelArgs, seed: int, device: str | torch.device = "cpu") -> Transformer:
    """Same seed -> same weights on every rank and in the single-process reference."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Transformer(args)
    return model.to(device)
