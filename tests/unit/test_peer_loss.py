"""A rank that leaves its process groups after a peer loss lets them go at once, so a peer still
inside a collective with it fails at once instead of waiting out the group's timeout. Under TP,
DTensor's caches keep every DeviceMesh alive and a mesh keeps its groups (torch's
`_pg_registry`): raymp.runtime.peer_loss.release_mesh_groups. A step stopped mid-way leaves
references in C++ no collection frees (FSDP2's hooks in the abandoned graph, DTensor's unwaited
collectives): raymp.runtime.peer_loss.GroupSockets. Two gloo processes, no Ray."""

from __future__ import annotations

import datetime
import gc
import os
import time

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from helpers.ports import free_port  # noqa: E402

# Far above what the test takes when the groups are let go (the point of the test): a rank 1 that
# waited this long means rank 0 kept them, and its error says "Timed out".
GROUP_TIMEOUT_S = 300


def _one_tp_step_then_one_rank_leaves(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from raymp.runtime.peer_loss import leave_process_groups

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    meshes = {"tp": init_device_mesh("cpu", (2,))}
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    parallelize_module(model, meshes["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    model(torch.randn(4, 8)).sum().backward()  # DTensor's caches now hold the mesh
    dist.barrier()
    if rank == 0:
        del model  # as Worker._drop_model: what else holds the groups is the mesh, through the caches
        gc.collect()
        leave_process_groups(list(meshes.values()))
        _stay_until_answered(out)
        return
    _answer(out, lambda: dist.all_reduce(torch.ones(4), group=meshes["tp"].get_group()))  # waits on rank 0


def _stay_until_answered(out: str) -> None:
    """Rank 0 stays alive until rank 1 has its answer, as a surviving actor does: an exiting
    process would close its sockets whatever held them."""
    deadline = time.monotonic() + 2 * GROUP_TIMEOUT_S
    while not os.path.exists(out) and time.monotonic() < deadline:
        time.sleep(0.05)


def _answer(out: str, collective) -> None:
    """Rank 1 runs `collective` (which waits on rank 0, leaving) and writes how it ended."""
    try:
        collective()
        result = "returned"
    except Exception as exc:  # the outcome under test
        result = str(exc)
    with open(out + ".tmp", "w") as f:
        f.write(result)
    os.replace(out + ".tmp", out)


def _peer_freed_at_once(tmp_path, fn, *args) -> None:
    out = tmp_path / "rank1.txt"
    mp.spawn(fn, args=(free_port(), str(out), *args), nprocs=2, join=True)
    result = out.read_text()
    assert "Connection" in result and "Timed out" not in result, result[:300]  # closed or reset by peer


def test_a_rank_leaving_its_groups_after_a_tp_step_frees_its_peer_at_once(tmp_path):
    _peer_freed_at_once(tmp_path, _one_tp_step_then_one_rank_leaves)


def _a_rank_stops_its_second_forward_then_leaves(rank: int, port: int, out: str, kind: str) -> None:
    import torch.distributed as dist

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from raymp import torch_compat
    from raymp.runtime.peer_loss import GroupSockets, leave_process_groups

    sockets = GroupSockets()
    devices = torch_compat.new_gloo_devices()
    # as WorldMembership.forming (in join and Worker.setup): every group on the world's devices
    with sockets.tracked(), torch_compat.gloo_groups_share(devices):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
        mesh = init_device_mesh("cpu", (2,))
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)) for _ in range(4)])
    for block in model:
        if kind == "fsdp2":
            fully_shard(block, mesh=mesh)
        else:
            parallelize_module(block, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(4, 8)
    model(x).sum().backward()
    dist.barrier()
    if rank == 0:
        def stop(module, args):  # as StepAbandon.check, or a collective's error, mid-forward
            raise RuntimeError("step stopped")

        model[2].register_forward_pre_hook(stop)
        try:
            model(x).sum().backward()
        except RuntimeError:
            pass
        del model  # what Python holds goes; what C++ holds (the graph, the work registry) stays
        gc.collect()
        leave_process_groups([mesh], sockets)
        _stay_until_answered(out)
        return
    _answer(out, lambda: model(x).sum().backward())  # its third block's collective waits on rank 0


@pytest.mark.parametrize("kind", ["fsdp2", "tp"])
def test_a_rank_that_stopped_its_step_mid_way_frees_its_peer_at_once(tmp_path, kind):
    """Without GroupSockets the peer waited out the group's timeout (4 of 4 FSDP2 parameter groups
    alive after a full collection; under TP one collective left in torch's work registry)."""
    _peer_freed_at_once(tmp_path, _a_rank_stops_its_second_forward_then_leaves, kind)
