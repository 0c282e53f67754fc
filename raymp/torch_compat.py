"""The one home of the private torch APIs raymp relies on, each with why no public one serves:
when torch moves one, this module is the only place to change. torch.distributed pieces are
imported where used, as the model code that imports this module sits on the config's path."""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta

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


def new_gloo_devices() -> list:
    """The gloo devices (transport endpoints) torch makes for a group, made once: one per
    interface GLOO_SOCKET_IFNAME names, else the host's default, as ProcessGroupGloo's own
    constructor picks them."""
    from torch.distributed import ProcessGroupGloo

    interfaces = [name for name in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if name]
    if interfaces:
        return [ProcessGroupGloo.create_device(interface=name) for name in interfaces]
    return [ProcessGroupGloo.create_default_device()]


@contextlib.contextmanager
def gloo_groups_share(devices: list):
    """Within the block, every gloo process group torch makes (init_process_group, new_group, a
    DeviceMesh's groups) runs on `devices` instead of devices of its own. torch gives each group
    a device, and each device a thread that wakes every 10 ms to poll its sockets: a rank in 27
    groups spent ~5% of a core idle, 0.3% with one device for all (BENCHMARKS.md section 14).
    Groups on one device stay apart (each has its own connections and tags). c10d builds a
    group's gloo backend by calling its module's ProcessGroupGloo with a timeout and has no public
    way to pass devices, so the name is bound to a subclass that passes them for the block's
    length."""
    import torch.distributed.distributed_c10d as c10d

    made = c10d.ProcessGroupGloo

    class SharedDeviceGloo(made):
        def __init__(self, store, rank, size, timeout=timedelta(minutes=30)):
            options = made._Options()
            options._devices = devices
            options._timeout = timeout
            options._threads = 2 * len(devices)  # the constructor's own default
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = SharedDeviceGloo
    try:
        yield
    finally:
        c10d.ProcessGroupGloo = made


@contextlib.contextmanager
def mesh_groups_from(groups: dict):
    """Within the block, a DeviceMesh (init_device_mesh, _flatten, _unflatten) takes each of its
    process groups from `groups` when one of the same ranks, dimension name, backend and timeout
    was made before, and adds the ones it makes. torch makes new groups for every mesh and has no
    public way to give it existing ones for a mesh it cuts (flatten, unflatten): a rank that sets
    up one layout after another (a reused actor group, an elastic re-plan) kept every layout's
    groups, each with a gloo thread polling its connections. Every rank calls new_group for every
    group of a dimension in one order, so every rank's `groups` holds the same keys. A one-rank
    group is shared across dimensions (it has no peer to order its collectives with); a larger
    one only within its dimension's name, so two roles over the same ranks (dp and ep) keep
    separate groups, as torch makes them."""
    import torch.distributed.device_mesh as device_mesh_module

    make = device_mesh_module.new_group

    def shared(ranks=None, timeout=None, backend=None, pg_options=None, group_desc=None, **kwargs):
        if ranks is None or pg_options is not None:
            return make(ranks=ranks, timeout=timeout, backend=backend, pg_options=pg_options,
                        group_desc=group_desc, **kwargs)
        ranks = tuple(ranks)
        role = None if len(ranks) == 1 else group_desc  # group_desc: "mesh_<dimension name>"
        key = (role, ranks, backend, timeout, tuple(sorted(kwargs.items())))
        if key not in groups:
            groups[key] = make(ranks=list(ranks), timeout=timeout, backend=backend, group_desc=group_desc,
                               **kwargs)
        return groups[key]

    device_mesh_module.new_group = shared
    try:
        yield
    finally:
        device_mesh_module.new_group = make


def clear_mesh_group_registry(mesh) -> None:
    """Empty a DeviceMesh's (and its root's) registry of process groups, which keeps them (and
    their sockets) alive beyond the model (raymp.runtime.peer_loss). Where a torch version has
    no registry there is nothing to empty."""
    for m in (mesh, getattr(mesh, "_root_mesh", None)):
        registry = getattr(m, "_pg_registry", None)
        if isinstance(registry, dict):
            registry.clear()


def fsspec_storage_classes() -> tuple[type, type]:
    """DCP's fsspec writer and reader classes (a URI): torch has them in a private module only."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    return FsspecWriter, FsspecReader


def dcp_storage_info(relative_path: str, offset: int, length: int, descriptors: list[str] | None):
    """DCP's index entry for an item's bytes in a file (a private class of its file storage)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(relative_path, offset, length, transform_descriptors=descriptors)


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
