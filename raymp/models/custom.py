"""Any nn.Module, from a factory named in the config (`model.factory: pkg.module:function`).

What raymp needs, and what each part buys (docs/models.md has an example):
- `function(vocab_size=V)` returns the module; forward(tokens [b, s]) returns logits [b, s, V].
  That is enough for data parallelism and ZeRO 0-3.
- Pipeline parallelism: the stageable shape of raymp.models.spec (tok_embeddings, a
  `layers` ModuleDict keyed "0".."n-1", norm, output; forward skips what is None). The split
  points are the layers. A head that *is* the embedding's weight is detected and kept tied.
- Tensor parallelism: `model.factory_tp_plan: pkg.module:plan` with plan(module,
  sequence_parallel) returning a torch `parallelize_module` plan for the module (or the part
  a stage holds) -- the built-in model's plan in raymp/models/llama_tp.py is an example.
Weights start from a seeded init by parameter name (matrices N(0, 0.02), vectors named *bias
zero, other vectors one), the same in every layout; buffers are recomputed by the module's
`reset_buffers()` when it has any.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from raymp.models.spec import ModelSpec, generic_initial_value


def import_object(path: str, field: str):
    module_name, _, attr = path.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(
            f"{field} {path!r} cannot be imported ({exc}); give 'package.module:function' "
            "importable on every node (e.g. shipped with ray job submit --working-dir)"
        ) from None


def is_stageable(module: nn.Module) -> bool:
    """In the shape a pipeline can cut (raymp.models.spec)?"""
    return isinstance(getattr(module, "layers", None), nn.ModuleDict) and all(
        hasattr(module, a) for a in ("tok_embeddings", "norm", "output"))


STAGEABLE_NEEDED = ("parallel.pp > 1 needs a model.factory module in the stageable shape (tok_embeddings, "
                    "a `layers` ModuleDict, norm, output: docs/models.md); without it use pp=1 (dp/ZeRO)")


class FactorySpec(ModelSpec):
    def __init__(self, factory_path: str, plan_path: str | None, vocab_size: int, seed: int, init_std: float):
        self.factory = import_object(factory_path, "model.factory")
        self.plan = import_object(plan_path, "model.factory_tp_plan") if plan_path else None
        self.vocab_size, self.seed, self.init_std = vocab_size, seed, init_std
        with torch.device("meta"):
            probe = self.build_meta()
        self._stageable = is_stageable(probe)
        self.num_layers = len(probe.layers) if self._stageable else 0
        head, embed = getattr(probe, "output", None), getattr(probe, "tok_embeddings", None)
        self.tie_embeddings = bool(head is not None and embed is not None
                                   and getattr(head, "weight", None) is getattr(embed, "weight", 0))
        self._param_count = sum(p.numel() for p in probe.parameters())
        if any(True for _ in probe.buffers()) and not hasattr(probe, "reset_buffers"):
            raise ValueError("model.factory's module has buffers but no reset_buffers() method: raymp "
                             "builds it on the meta device and must recompute them after allocation")

    @classmethod
    def from_model_config(cls, model_cfg, vocab_size: int, seed: int) -> "FactorySpec":
        return cls(model_cfg.factory, model_cfg.factory_tp_plan, model_cfg.vocab_size or vocab_size,
                   seed, model_cfg.init_std or 0.02)

    @property
    def stageable(self) -> bool:
        return self._stageable

    def build_meta(self) -> nn.Module:
        module = self.factory(vocab_size=self.vocab_size)
        if not isinstance(module, nn.Module):
            raise ValueError(f"model.factory returned {type(module).__name__}, not an nn.Module")
        return module

    def initial_value(self, name: str, shape) -> torch.Tensor:
        return generic_initial_value(self.seed, name, shape, self.init_std)

    def reset_buffers(self, module: nn.Module) -> None:
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()

    def tensor_parallel(self, module: nn.Module, tp_mesh, sequence_parallel: bool) -> None:
        from torch.distributed.tensor.parallel import parallelize_module

        if self.plan is None:
            raise ValueError("parallel.tp > 1 needs model.factory_tp_plan")
        parallelize_module(module, tp_mesh, self.plan(module, sequence_parallel))

    def num_params(self) -> int:
        return self._param_count


def factory_shape(factory: str, vocab_size: int) -> dict:
    """Layers, width, and an MLP width that gives each layer its real parameter count. Heads are
    not visible from outside; they count as one."""
    with torch.device("meta"):
        probe = import_object(factory, "model.factory")(vocab_size=vocab_size)
    layers = getattr(probe, "layers", None)
    layers = list(layers.values()) if isinstance(layers, torch.nn.ModuleDict) else [probe]
    embed = getattr(probe, "tok_embeddings", None)
    dim = embed.weight.shape[1] if embed is not None else 1
    per_layer = sum(p.numel() for p in layers[0].parameters())
    return dict(dim=dim, n_layers=len(layers), n_heads=1, n_kv_heads=1,
                ffn_dim=max(1, (per_layer - 4 * dim * dim) // (3 * dim)), max_seq_len=2**20,
                rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False, init_std=0.02)
