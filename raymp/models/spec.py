"""What raymp needs from a model, and how a rank materialises only its own part of one.

A model is described by a ModelSpec. The spec builds the model on the meta device (no memory),
says which parts pipeline stages keep, gives its tensor-parallel plan, and supplies each
parameter's initial value by name (seeded, or read from a weights file). A rank then:

    build on meta -> drop what its pipeline stage does not hold -> apply tensor parallelism
    (still meta) -> allocate its local shards -> fill them, one tensor at a time

so no rank ever holds more than its own shard plus one full tensor in flight. The model code
itself stays free of parallelism.

The stageable shape (the built-in model, the Hugging Face adapters and any user module that
wants pipeline parallelism share it):
    tok_embeddings  first stage only  (None elsewhere)
    layers          nn.ModuleDict of blocks keyed "0", "1", ... (pipeline split points,
                    activation checkpointing and FSDP units)
    norm, output    last stage only   (None elsewhere)
    forward(x)      tokens [b, s] on the first stage, hidden states elsewhere; skips what is None
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
from torch import nn

from raymp.torch_compat import CHECKPOINT_WRAPPED

EMBEDDING, HEAD = "tok_embeddings.weight", "output.weight"


class ModelSpec:
    """A model family's hooks. Subclasses set `tie_embeddings` and `num_layers` and implement
    `build_meta` and `initial_value`; the rest has defaults."""

    tie_embeddings: bool = False
    num_layers: int = 0
    # Top-level modules only the first / last pipeline stage keeps.
    first_stage_modules: tuple[str, ...] = ("tok_embeddings",)
    last_stage_modules: tuple[str, ...] = ("norm", "output")

    def build_meta(self) -> nn.Module:
        raise NotImplementedError

    def initial_value(self, name: str, shape: torch.Size) -> torch.Tensor:
        """The full fp32 value of parameter `name` before training (a tied head is asked for
        under the embedding's name)."""
        raise NotImplementedError

    def reset_buffers(self, module: nn.Module) -> None:
        """Recompute non-persistent buffers (RoPE tables) after allocation."""

    def tensor_parallel(self, module: nn.Module, tp_mesh, sequence_parallel: bool) -> None:
        """Apply this family's TP plan to a (meta) module; None of a plan: refuse."""
        raise NotImplementedError(f"{type(self).__name__} has no tensor-parallel plan")

    @property
    def stageable(self) -> bool:
        return True

    def block_names(self, module: nn.Module) -> list[str]:
        layers = getattr(module, "layers", None)
        return [f"layers.{k}" for k in layers] if isinstance(layers, nn.ModuleDict) else []

    def num_params(self) -> int:
        """Parameters of the whole model (tied weights once), counted on the meta device."""
        return sum(p.numel() for p in self.build_meta().parameters())


def clean_name(name: str) -> str:
    """A parameter's or module's name as in the plain model (activation checkpointing adds a
    wrapper level)."""
    return name.replace(f"{CHECKPOINT_WRAPPED}.", "")


def seeded_normal(seed: int, name: str, shape, std: float) -> torch.Tensor:
    """N(0, std) from a generator seeded by (seed, name): the same value whatever the layout
    that asks, so every rank and the single-process reference agree."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=gen)


def generic_initial_value(seed: int, name: str, shape, std: float) -> torch.Tensor:
    """Init by name for modules that bring none of their own: vectors named *bias are zero,
    other vectors (norm scales) one, matrices N(0, std)."""
    if len(shape) <= 1:
        return torch.zeros(shape) if name.endswith("bias") else torch.ones(shape)
    return seeded_normal(seed, name, shape, std)


def keep_only(layers: list[int], first: bool, last: bool, spec: ModelSpec) -> Callable[[nn.Module], None]:
    """A prune function: drop every block, and the first-/last-stage modules, this stage does
    not hold. Parameter names of what stays are unchanged (checkpoints and exports rely on it)."""

    def prune(model: nn.Module) -> None:
        for key in [k for k in model.layers if int(k) not in layers]:
            del model.layers[key]
        drop = (() if first else spec.first_stage_modules) + (() if last else spec.last_stage_modules)
        for name in drop:
            setattr(model, name, None)

    return prune


def tie_weights(model: nn.Module, spec: ModelSpec) -> None:
    """Share the embedding with the head when this part holds both (again after `to_empty`
    and tensor parallelism, which each give every module its own tensor)."""
    if spec.tie_embeddings and getattr(model, "tok_embeddings", None) is not None \
            and getattr(model, "output", None) is not None:
        model.output.weight = model.tok_embeddings.weight


def build_part(spec: ModelSpec, device, prune=None, tp_mesh=None, sequence_parallel: bool = False,
               values: Callable | None = None, fill: bool = True,
               shard: Callable[[nn.Module], None] | None = None) -> nn.Module:
    """This rank's part of the model, materialised shard by shard (see the module docstring).
    `values(name, shape)` overrides the spec's initial values (weights read from disk).
    `shard(model)`: more parallelism that turns parameters into DTensors, applied on meta after
    tensor parallelism (expert parallelism).
    `fill=False`: every value is loaded right after (a survivor's state kept in memory), so
    none is computed or read; the parameters are zeros until then."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.device("meta"):
        model = spec.build_meta()
    if prune is not None:
        prune(model)
    if tp_mesh is not None:
        spec.tensor_parallel(model, tp_mesh, sequence_parallel)
    if shard is not None:
        shard(model)
    model.to_empty(device=device)
    tie_weights(model, spec)
    value_of = values or spec.initial_value
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied pair appears once
            if not fill:
                param.zero_()  # a DTensor zeroes its local piece
                continue
            source = EMBEDDING if spec.tie_embeddings and name == HEAD else name
            full = value_of(source, param.shape)
            if tuple(full.shape) != tuple(param.shape):
                raise ValueError(f"weights for {name!r} have shape {tuple(full.shape)}, the model "
                                 f"expects {tuple(param.shape)}: the weights are for another config")
            if isinstance(param, DTensor):
                # Each rank slices its own piece locally (no scatter from rank 0).
                full = distribute_tensor(
                    full, param.device_mesh, param.placements, src_data_rank=None
                ).to_local()
                param.to_local().copy_(full)
            else:
                param.copy_(full)
            del full
    spec.reset_buffers(model)
    return model
