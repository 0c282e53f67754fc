"""The one home of the private torch APIs raymp relies on, each with why no public one serves:
when torch moves one, this module is the only place to change. torch.distributed pieces are
imported where used, as the model code that imports this module sits on the config's path."""

from __future__ import annotations

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

# The torch releases these APIs are checked against (pyproject.toml's range; tests/unit/test_torch_compat.py).
SUPPORTED_TORCH = ((2, 8), (3, 0))


def torch_supported(version: str = torch.__version__) -> bool:
    """Whether a torch version lies in SUPPORTED_TORCH (lower bound in, upper bound out)."""
    major, minor = (int(part) for part in version.split("+")[0].split(".")[:2])
    return SUPPORTED_TORCH[0] <= (major, minor) < SUPPORTED_TORCH[1]


# DDP-style gradient buckets: one flat buffer per dtype, and views back into it (no public API).
flatten_dense_tensors = _flatten_dense_tensors
unflatten_dense_tensors = _unflatten_dense_tensors

# The attribute (and name component) torch's checkpoint wrapper puts between a block and its
# parent: parameter names and compiled sub-modules look through it.
CHECKPOINT_WRAPPED = "_checkpoint_wrapped_module"


def recomputing() -> bool:
    """Whether this forward runs inside a backward pass: activation checkpointing recomputing a
    block. Statistics gathered in forward (MoE routing counts) must not count it twice; torch has
    no public query for it, and its graph-task id is -1 outside a backward."""
    return torch._C._current_graph_task_id() != -1


def checkpoint_wrapper(module: nn.Module) -> nn.Module:
    """torch's activation-checkpoint wrapper (non-reentrant; the RNG state is not kept, as no
    block draws random numbers): the one FSDP2 and torchtitan compose with; no public path."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as wrap

    return wrap(module, preserve_rng_state=False)


def unwrapped(block: nn.Module) -> nn.Module:
    """The block inside a checkpoint wrapper (the block itself when not wrapped)."""
    return getattr(block, CHECKPOINT_WRAPPED, block)


def set_compile_threads(n: int) -> None:
    """Inductor's compile worker pool size (a config module torch does not export)."""
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = n


def flatten_mesh(mesh, name: str):
    """Join a DeviceMesh's dimensions into one, cut from the same root: how torch (and
    torchtitan) make the dp x cp mesh FSDP2 over TP needs; a second init_device_mesh is not."""
    return mesh._flatten(name)


def unflatten_mesh(mesh, dim: int, sizes: tuple[int, ...], names: tuple[str, ...]):
    """Split one DeviceMesh dimension into several (HSDP's shard dimension into dp_shard x cp)."""
    return mesh._unflatten(dim, sizes, names)


def clear_mesh_group_registry(mesh) -> None:
    """Empty a DeviceMesh's (and its root's) registry of process groups, which keeps them (and
    their sockets) alive beyond the model (raymp.runtime.peer_loss). Where a torch version has
    no registry there is nothing to empty."""
    for m in (mesh, getattr(mesh, "_root_mesh", None)):
        registry = getattr(m, "_pg_registry", None)
        if isinstance(registry, dict):
            registry.clear()


def fsspec_storage_writer(path: str):
    """DCP's fsspec writer (a URI): torch has it in a private module only."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(path)


def fsspec_storage_reader(path: str):
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(path)


def dcp_writer_process():
    """DCP's checkpoint writer process (async_save: process), kept by torch in a module global
    with no public way to start it early or close it; None when none runs."""
    from torch.distributed.checkpoint import _async_process_executor

    return _async_process_executor._CHECKPOINT_PROCESS


def start_dcp_writer_process(group) -> None:
    """Start DCP's writer process for `group` now, as torch would at the first process save."""
    from torch.distributed.checkpoint import _async_process_executor as executor

    executor._CHECKPOINT_PROCESS = executor._AsyncCheckpointProcess(executor._ProcessGroupInitInfo(group))


def forget_dcp_writer_process() -> None:
    """Make torch start a new writer process at the next process save."""
    from torch.distributed.checkpoint import _async_process_executor

    _async_process_executor._CHECKPOINT_PROCESS = None


def view_base(t: torch.Tensor) -> torch.Tensor:
    """The tensor a view was taken of (itself when not a view): a linear saves weight.t()."""
    return t._base if t._base is not None else t


def dtensor_local(t) -> torch.Tensor:
    """A DTensor's local piece without an autograd op (to_local() is one), for saved-tensor hooks."""
    return t._local_tensor


def drop_buffer(module: nn.Module, name: str) -> torch.Tensor:
    """Unregister a buffer and return it (nn.Module has no public way to)."""
    return module._buffers.pop(name)


def set_scheduler_position(scheduler, step_count: int, last_lr: list[float]) -> None:
    """An LR scheduler's step count and last learning rates, which its load_state_dict would
    set together with everything else the config owns (raymp.checkpoint.rank_state)."""
    scheduler._step_count = step_count
    scheduler._last_lr = last_lr
