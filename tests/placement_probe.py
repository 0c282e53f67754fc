"""Run by test_placement.py in its own process (it needs its own Ray cluster): a simulated
cluster of two nodes with 2 fake GPUs each, actors placed for tensor-parallel layouts, and where
each one landed printed as JSON. Workers skip the process group: only placement is probed."""

from __future__ import annotations

import json
import time

import ray
from raymp.runtime.actor_group import ActorGroup, PlacementError
from raymp.runtime.simulated_cluster import SimulatedCluster
from raymp.runtime.worker import Worker


class PlacementOnlyWorker(Worker):
    def init_distributed(self, rank, *args, **kwargs):  # no NCCL here: placement only
        self.rank = rank


def main() -> None:
    cluster = SimulatedCluster(head_cpus=0)
    nodes = [cluster.add(cpus=4, gpus=2) for _ in range(2)]
    out = {"node_ids": sorted(n.node_id for n in nodes)}
    group = ActorGroup(4, "cuda", tp_size=2, worker_cls=PlacementOnlyWorker, placement_timeout_s=60)
    out["tp2"] = [{"node": n["node_id"], "gpus": n["gpu_ids"]} for n in group.nodes]
    group.shutdown()
    t0 = time.perf_counter()
    try:
        ActorGroup(4, "cuda", tp_size=4, worker_cls=PlacementOnlyWorker, placement_timeout_s=60)
    except PlacementError as exc:
        out["tp4_error"], out["tp4_seconds"] = str(exc), time.perf_counter() - t0
    t0 = time.perf_counter()
    try:  # 8 GPUs asked of 4: waits the bounded time, then says what is free
        ActorGroup(8, "cuda", tp_size=2, worker_cls=PlacementOnlyWorker, placement_timeout_s=3)
    except PlacementError as exc:
        out["too_many_error"], out["too_many_seconds"] = str(exc), time.perf_counter() - t0
    deadline = time.time() + 20  # removal of placement groups and actors is asynchronous
    while ray.available_resources().get("GPU", 0) < 4 and time.time() < deadline:
        time.sleep(0.2)
    out["gpus_free_after"] = ray.available_resources().get("GPU", 0)
    print(json.dumps(out))
    cluster.shutdown()


if __name__ == "__main__":
    main()
