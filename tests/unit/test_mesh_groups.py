"""A rank that sets up one layout after another (a reused actor group, an elastic re-plan) keeps a
bounded set of process groups: each layout's meshes take the groups of the same ranks and role
that an earlier layout made (raymp.parallel.mesh.device_mesh). torch makes new groups for every
mesh, and each gloo group keeps a thread polling its connections until it is destroyed: on the
test suite's shared 4-rank group, one rank held 79 such threads after ~20 layouts. Formed as a
rank forms them (raymp.torch_compat.gloo_groups_share), all of a world's groups poll on one
thread. Four gloo processes, no Ray."""

from __future__ import annotations

import datetime
import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from helpers.ports import free_port
from raymp.layout import Layout

LAYOUTS = [
    Layout(dp=4), Layout(dp=2, tp=2), Layout(pp=2, tp=2), Layout(dp=2, pp=2), Layout(dp=2, cp=2),
    Layout(dp=4, dp_replicate=2), Layout(dp=4, ep=2), Layout(tp=4), Layout(dp=2, cp=2, dp_replicate=2),
]


def _gloo_threads(prefix: str = "gloo") -> int:
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                count += f.read().strip().startswith(prefix)
        except OSError:
            pass
    return count


def _layouts_twice(rank: int, port: int, out: str, shared: bool) -> None:
    import contextlib

    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor

    from raymp import torch_compat
    from raymp.parallel.mesh import device_mesh

    def forming():  # as WorldMembership.forming, or as torch forms groups by itself
        return torch_compat.gloo_groups_share(devices) if shared else contextlib.nullcontext()

    devices = torch_compat.new_gloo_devices()
    with forming():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4,
                                timeout=datetime.timedelta(seconds=120))
    threads, sums = [], []
    for _ in range(2):
        for layout in LAYOUTS:
            with forming():
                roles = device_mesh(layout, "cpu")
            for mesh in roles.values():  # every group answers with its own ranks
                for dim in range(mesh.ndim):
                    total = torch.ones(1)
                    dist.all_reduce(total, group=mesh.get_group(dim))
                    assert total.item() == mesh.size(dim), (layout, mesh, dim)
            if layout.tp > 1:  # a DTensor collective on the tp mesh, as TP's layers run it
                full = torch.arange(8.0).reshape(2, 4)
                sums.append(distribute_tensor(full, roles["tp"], [Shard(1)]).full_tensor().sum().item())
        threads.append(_gloo_threads())
    dist.barrier()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"threads": threads, "sums": sums, "polling": _gloo_threads("gloo_tcp_loop")}, f)
    dist.destroy_process_group()


@pytest.mark.parametrize("shared", [False, True], ids=["torch's devices", "one shared device"])
def test_layouts_set_up_again_and_again_keep_a_bounded_number_of_groups(tmp_path, shared):
    out = tmp_path / "out.json"
    mp.spawn(_layouts_twice, args=(free_port(), str(out), shared), nprocs=4, join=True)
    result = json.loads(out.read_text())
    first, second = result["threads"]
    assert second == first, f"gloo threads after each round of {len(LAYOUTS)} layouts: {result['threads']}"
    assert set(result["sums"]) == {28.0}, result["sums"]
    if shared:  # the world's one device: one thread polls every group's connections
        assert result["polling"] == 1, result
    else:
        assert result["polling"] > 10, result
