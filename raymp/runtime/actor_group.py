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


class WorkerLostError(RuntimeError):
    """A rank is gone or stuck: its actor (or node) died, a collective failed because a peer
    did, or a call ran past its time limit. `kind` is 'died', 'collective' or 'timeout'."""

    def __init__(self, message: str, rank: int | None = None, kind: str = "died", step: int | None = None):
        super().__init__(message)
        self.rank, self.kind, self.step = rank, kind, step


class ActorGroup:
    """`tp_size` actors in a row form a tensor-parallel group (ranks are tp-fastest); each such
    group gets its own STRICT_PACK placement group, so its traffic (an all-reduce per layer)
    never leaves a node. Pipeline stages and dp replicas may span nodes."""

    def __init__(self, world_size: int, device: str = "cpu", cpus_per_actor: float = 1,
                 placement_timeout_s: float = 120, collective_timeout_s: float = 300,
                 worker_cls: type = Worker, tp_size: int = 1):
        if world_size % tp_size:
            raise ValueError(f"world size {world_size} is not a multiple of the TP size {tp_size}")
        self.world_size, self.device, self.tp_size = world_size, device, tp_size
        bundle = {"CPU": cpus_per_actor}
        if device == "cuda":
            bundle["GPU"] = 1
        if tp_size > 1:
            _check_a_node_fits(bundle, tp_size)
            self.pgs = [
                placement_group([dict(bundle) for _ in range(tp_size)], strategy="STRICT_PACK")
                for _ in range(world_size // tp_size)
            ]
        else:
            self.pgs = [placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK")]
        ready, _ = ray.wait([pg.ready() for pg in self.pgs], num_returns=len(self.pgs),
                            timeout=placement_timeout_s)
        if len(ready) < len(self.pgs):
            for pg in self.pgs:
                remove_placement_group(pg)
            packed = f" in groups of {tp_size} per node (tensor parallel)" if tp_size > 1 else ""
            raise PlacementError(
                f"the cluster could not place {world_size} actors of {bundle}{packed} within "
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
                scheduling_strategy=PlacementGroupSchedulingStrategy(*self._bundle(i)),
            ).remote(threads)
            for i in range(world_size)
        ]
        t0 = time.perf_counter()
        addr, port = ray.get(self.workers[0].rendezvous_address.remote())
        backend = "nccl" if device == "cuda" else "gloo"
        self._gather([
            w.init_distributed.remote(rank, world_size, addr, port, backend, collective_timeout_s)
            for rank, w in enumerate(self.workers)
        ], None)
        self.backend = backend
        self.startup_s = time.perf_counter() - t0
        self.nodes = ray.get([w.node_info.remote() for w in self.workers])
        self.node_ids = sorted({n["node_id"] for n in self.nodes})

    def _bundle(self, rank: int):
        """(placement group, bundle index) of a rank."""
        if self.tp_size > 1:
            return self.pgs[rank // self.tp_size], rank % self.tp_size
        return self.pgs[0], rank

    def call(self, method: str, *args, timeout_s: float | None = None, **kwargs) -> list:
        """The same call on every rank, in parallel; returns results in rank order. Raises
        WorkerLostError as soon as a rank is lost, or when no rank finishes within timeout_s."""
        return self._gather([getattr(w, method).remote(*args, **kwargs) for w in self.workers], timeout_s)

    def call_per_rank(self, method: str, args_per_rank: list[tuple], timeout_s: float | None = None) -> list:
        return self._gather([getattr(w, method).remote(*a) for w, a in zip(self.workers, args_per_rank)], timeout_s)

    def _gather(self, refs: list, timeout_s: float | None) -> list:
        """Like ray.get(refs), but raises as soon as any call fails: survivors of a dead peer sit
        in a collective until its timeout, and we must not wait for them to learn of the death."""
        rank_of = {ref: r for r, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=timeout_s)
            if not done:
                late = sorted(rank_of[r] for r in pending)
                raise WorkerLostError(
                    f"ranks {late} did not finish within {timeout_s:g}s (elastic.step_timeout_s): "
                    "a hung rank or collective", late[0], "timeout")
            try:
                ray.get(done[0])
            except ray.exceptions.RayActorError as exc:
                raise WorkerLostError(self._where(rank_of[done[0]]) + " died. Cause: "
                                      + str(exc).splitlines()[0], rank_of[done[0]], "died") from exc
            except ray.exceptions.RayTaskError as exc:
                if not _is_collective_failure(exc):
                    raise
                raise WorkerLostError(
                    self._where(rank_of[done[0]]) + " lost a peer in a collective: "
                    + str(exc.cause).splitlines()[0], rank_of[done[0]], "collective") from exc
        return ray.get(refs)

    def _where(self, rank: int) -> str:
        node = self.nodes[rank]["node_ip"] if rank < len(getattr(self, "nodes", [])) else "?"
        return f"rank {rank} on node {node}"

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
        for pg in self.pgs:
            remove_placement_group(pg)
        self.workers = []

    def check_tp_groups_share_nodes(self, tp: int) -> None:
        """For a group made without tp packing (e.g. shared across configs): its TP groups must
        still each sit on one node, or every layer's all-reduce would cross the network."""
        for start in range(0, self.world_size, tp):
            nodes = {n["node_id"] for n in self.nodes[start:start + tp]}
            if len(nodes) > 1:
                raise PlacementError(
                    f"ranks {start}..{start + tp - 1} form a TP group but sit on {len(nodes)} nodes; "
                    f"create the actor group with tp_size={tp}"
                )


def _is_collective_failure(exc: Exception) -> bool:
    """A torch collective that failed because a peer went away (gloo: connection closed or
    reset, NCCL: a communicator error, either: the process-group timeout)."""
    import torch.distributed as dist

    cause = getattr(exc, "cause", None)
    return isinstance(cause, dist.DistError) or any(
        phrase in str(cause) for phrase in ("Connection closed by peer", "Connection reset by peer",
                                            "Timed out waiting", "NCCL communicator"))


def _check_a_node_fits(bundle: dict, tp_size: int) -> None:
    """Fail at once, not after the placement timeout, if no node could ever hold a TP group."""
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    need = {k: v * tp_size for k, v in bundle.items()}
    if any(all(res.get(k, 0) >= v for k, v in need.items()) for res in nodes):
        return
    largest = max(nodes, key=lambda r: tuple(r.get(k, 0) for k in need), default={})
    raise PlacementError(
        f"a tensor-parallel group of {tp_size} actors must fit on one node ({_fmt(need)}), but "
        f"the largest node has {_fmt(largest) if largest else 'nothing'}; lower parallel.tp "
        f"(and raise parallel.dp or parallel.pp), or use larger nodes"
    )


def _fmt(res: dict) -> str:
    keys = [k for k in ("CPU", "GPU", "memory") if k in res]
    return ", ".join(f"{k}={res[k]:g}" for k in keys) or "nothing"
