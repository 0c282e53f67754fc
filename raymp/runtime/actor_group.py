"""A placement group with one Worker actor per device, joined into one torch process group.

Kept separate from any one training run so tests (and notebooks) can reuse the same processes
for several configs of the same world size: actor start-up costs seconds, a re-setup does not.
"""

from __future__ import annotations

import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raymp.runtime.worker import Worker


class PlacementError(RuntimeError):
    """The cluster cannot host the layout; the message says what was asked and what is free."""


class ActorGroup:
    def __init__(self, world_size: int, device: str = "cpu", cpus_per_actor: float = 1,
                 placement_timeout_s: float = 120, collective_timeout_s: float = 300,
                 worker_cls: type = Worker):
        self.world_size, self.device = world_size, device
        bundle = {"CPU": cpus_per_actor}
        if device == "cuda":
            bundle["GPU"] = 1
        self.pg = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK")
        ready, _ = ray.wait([self.pg.ready()], timeout=placement_timeout_s)
        if not ready:
            remove_placement_group(self.pg)
            raise PlacementError(
                f"the cluster could not place {world_size} actors of {bundle} within "
                f"{placement_timeout_s:.0f}s (resources.placement_timeout_s). Free now: "
                f"{_fmt(ray.available_resources())}; total: {_fmt(ray.cluster_resources())}. "
                "Lower parallel.dp/pp/tp or resources.cpus_per_actor, or add nodes."
            )
        threads = max(1, int(cpus_per_actor))
        remote_cls = ray.remote(worker_cls)
        self.workers = [
            remote_cls.options(
                num_cpus=cpus_per_actor,
                num_gpus=1 if device == "cuda" else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
            ).remote(threads)
            for i in range(world_size)
        ]
        t0 = time.perf_counter()
        addr, port = ray.get(self.workers[0].rendezvous_address.remote())
        backend = "nccl" if device == "cuda" else "gloo"
        ray.get([
            w.init_distributed.remote(rank, world_size, addr, port, backend, collective_timeout_s)
            for rank, w in enumerate(self.workers)
        ])
        self.backend = backend
        self.startup_s = time.perf_counter() - t0
        self.nodes = ray.get([w.node_info.remote() for w in self.workers])

    def call(self, method: str, *args, **kwargs) -> list:
        """The same call on every rank, in parallel; returns results in rank order."""
        return _gather([getattr(w, method).remote(*args, **kwargs) for w in self.workers])

    def call_per_rank(self, method: str, args_per_rank: list[tuple]) -> list:
        return _gather([getattr(w, method).remote(*a) for w, a in zip(self.workers, args_per_rank)])

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
        remove_placement_group(self.pg)
        self.workers = []


def _gather(refs: list) -> list:
    """Like ray.get(refs), but raises as soon as any call fails: survivors of a dead peer sit in
    a collective until its timeout, and we must not wait for them to learn of the death."""
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        ray.get(done[0])
    return ray.get(refs)


def _fmt(res: dict) -> str:
    keys = [k for k in ("CPU", "GPU", "memory") if k in res]
    return ", ".join(f"{k}={res[k]:g}" for k in keys) or "nothing"
