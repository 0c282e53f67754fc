"""Models. `model_spec(cfg.model, vocab)` describes the configured model (the built-in
Llama-style decoder, a Hugging Face causal LM, or a module from your own factory);
`build_model(spec, seed)` builds it whole on one device (the single-process reference).

The package itself imports no torch: the shapes (raymp.models.args) and presets are what loading
and checking a config needs, so `raymp config` and a refused `raymp train` answer without it.
The names that build models load their modules on first use."""

from __future__ import annotations

from raymp.models.args import ModelArgs, MoEArgs, model_args
from raymp.models.presets import PRESETS

__all__ = ["ModelArgs", "MoEArgs", "ModelSpec", "Transformer", "PRESETS", "build_model",
           "model_args", "model_spec"]


def __getattr__(name: str):
    """The torch-backed names (PEP 562): imported where first used, not with the package."""
    if name in ("build_model", "model_spec"):
        from raymp.models import build

        return getattr(build, name)
    if name == "ModelSpec":
        from raymp.models.spec import ModelSpec

        return ModelSpec
    if name == "Transformer":
        from raymp.models.llama import Transformer

        return Transformer
    raise AttributeError(f"module 'raymp.models' has no attribute {name!r}")
