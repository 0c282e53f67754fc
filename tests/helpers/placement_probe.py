"""Run by system/test_placement.py in its own process (it needs its own Ray cluster): a simulated
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


def train_with_local_data_on_a_zero_cpu_head() -> dict:
    """The data under a local path of the driver's node, a head with no CPU (as the shipped
    cluster configs make it): preparing and streaming it must still run, and train the same
    thing as one process."""
    import tempfile

    from raymp.config import config_from_dict
    from raymp.reference import train_single_process
    from raymp.trainer import Trainer

    root = tempfile.mkdtemp(prefix="raymp-head0-")
    cfg = {
        "name": "head0", "seed": 11, "output_dir": f"{root}/runs",
        "model": {"preset": "tiny", "max_seq_len": 64},
        "parallel": {"dp": 2, "zero": 2, "micro_batch_size": 2},
        "train": {"steps": 3, "global_batch_size": 8, "seq_len": 32, "log_every": 1, "eval_batches": 0},
        "optimizer": {"lr": 1e-2, "warmup_steps": 1},
        "data": {"source": "kjv", "tokenizer": "byte", "cache_dir": f"{root}/cache"},
        "resources": {"device": "cpu"},
        "tracking": {"enabled": False},
    }
    with Trainer(cfg, progress=False) as trainer:
        losses = [m["loss"] for m in trainer.fit()]
        nodes = sorted({r["node_id"] for r in trainer.layout()})
    reference, _ = train_single_process(config_from_dict(cfg), 3)
    return {"losses": losses, "reference": reference, "actor_nodes": nodes,
            "head": ray.get_runtime_context().get_node_id()}


def main() -> None:
    cluster = SimulatedCluster(head_cpus=0)
    nodes = [cluster.add(cpus=4, gpus=2) for _ in range(2)]
    out = {
        "node_ids": sorted(n.node_id for n in nodes),
        "object_store_bytes": [n["Resources"].get("object_store_memory") for n in ray.nodes() if n["Alive"]],
    }
    group = ActorGroup(4, "cuda", tp_size=2, worker_cls=PlacementOnlyWorker, placement_timeout_s=60)
    out["tp2"] = [{"node": n["node_id"], "gpus": n["gpu_ids"]} for n in group.nodes]
    group.shutdown()
    t0 = time.perf_counter()
    try:
        # A timeout past the test's own: "no node could ever hold it" must be said before any wait.
        ActorGroup(4, "cuda", tp_size=4, worker_cls=PlacementOnlyWorker, placement_timeout_s=600)
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
    out["zero_cpu_head"] = train_with_local_data_on_a_zero_cpu_head()
    print(json.dumps(out))
    cluster.shutdown()


if __name__ == "__main__":
    main()
