"""Where an actor group's ranks run: its placement groups, and which bundle each rank's actor
uses. A bundle outlives its actor: one whose actor was let go stays reserved on its node, and one
on a lost node is re-placed by Ray once a node has room again. Those free bundles are where
ranks joining a running group start (ActorGroup.grow)."""

from __future__ import annotations

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group


class PlacementError(RuntimeError):
    """The cluster cannot host the layout; the message says what was asked and what is free."""


class Placement:
    """`tp_size` ranks in a row form a tensor-parallel group; each such group gets its own
    STRICT_PACK placement group, so its traffic (an all-reduce per layer) never leaves a node.
    Without TP, one PACK group holds every rank. Pipeline stages and dp replicas may span nodes."""

    def __init__(self, bundle: dict, tp_size: int):
        self.bundle, self.tp_size = bundle, tp_size
        self.pgs: list = []
        self.slots: list[tuple] = []  # rank -> (placement group, bundle index)

    def reserve(self, world_size: int, timeout_s: float) -> None:
        """Bundles for `world_size` ranks, ready on live nodes within `timeout_s`."""
        tp = self.tp_size
        if tp > 1:
            _check_a_node_fits(self.bundle, tp)
            self.pgs = [placement_group([dict(self.bundle) for _ in range(tp)], strategy="STRICT_PACK")
                        for _ in range(world_size // tp)]
            self.slots = [(self.pgs[r // tp], r % tp) for r in range(world_size)]
        else:
            self.pgs = [placement_group([dict(self.bundle) for _ in range(world_size)], strategy="PACK")]
            self.slots = [(self.pgs[0], r) for r in range(world_size)]
        ready, _ = ray.wait([pg.ready() for pg in self.pgs], num_returns=len(self.pgs), timeout=timeout_s)
        if len(ready) < len(self.pgs):
            packed = f" in groups of {tp} per node (tensor parallel)" if tp > 1 else ""
            raise PlacementError(
                f"the cluster could not place {world_size} actors of {self.bundle}{packed} within "
                f"{timeout_s:g}s (resources.placement_timeout_s). Free now: "
                f"{_fmt(ray.available_resources())}; total: {_fmt(ray.cluster_resources())}. "
                "Lower parallel.dp/pp/tp or resources.cpus_per_actor, or add nodes."
            )
        self.slots = self._grouped_by_node(self.slots)

    def _grouped_by_node(self, slots: list[tuple]) -> list[tuple]:
        """The slots reordered so that the ranks on one node are consecutive (nodes in the order
        of their first slot; a TP group's `tp_size` slots move together). The outer dims (dp,
        then pp) are contiguous rank blocks, so a node holds whole replicas where they fit and
        its loss takes as few copies of the state as it can. Ray's order alone put a 2x2x2 run's
        TP groups 0 and 3 on one node: its loss took half of both replicas, and keep_survivors
        had nothing whole to go on with."""
        where = {pg.id: placement_group_table(pg).get("bundles_to_node_id", {}) for pg in self.pgs}
        nodes: dict = {}
        for i in range(0, len(slots), self.tp_size):
            pg, index = slots[i]
            nodes.setdefault(where[pg.id].get(index), []).extend(slots[i:i + self.tp_size])
        return [slot for same_node in nodes.values() for slot in same_node]

    def node_of(self, rank: int) -> str | None:
        pg, index = self.slots[rank]
        return placement_group_table(pg).get("bundles_to_node_id", {}).get(index)

    def rescheduling(self, pg_ids: set | None = None) -> bool:
        """Whether a node holding one of the bundles (of the placement groups `pg_ids`, if given)
        was lost (Ray is re-placing them)."""
        return any(placement_group_table(pg).get("state") == "RESCHEDULING"
                   for pg in self.pgs if pg_ids is None or pg.id in pg_ids)

    def adopt(self, pgs: list) -> None:
        """Placement groups made elsewhere (warm spares') are this placement's from now on."""
        self.pgs += [pg for pg in dict.fromkeys(pgs) if pg not in self.pgs]

    def keep(self, ranks: list[int]) -> None:
        """Only these ranks' actors go on, in this order; the others' bundles become free."""
        self.slots = [self.slots[r] for r in ranks]

    def has_free(self) -> bool:
        """Cheap (no call to Ray): some bundle has no rank."""
        return sum(pg.bundle_count for pg in self.pgs) > len(self.slots)

    def free(self) -> list[tuple]:
        """The free bundles a new rank can start in now, in the order new ranks take them: of
        placement groups whose every bundle is placed, and under TP only whole groups (a new
        TP group must share a node)."""
        if not self.has_free():
            return []
        taken, out = set(self.slots), []
        for pg in self.pgs:
            bundles = [(pg, i) for i in range(pg.bundle_count)]
            free = [s for s in bundles if s not in taken]
            if free and (self.tp_size == 1 or len(free) == len(bundles)) and \
                    placement_group_table(pg).get("state") == "CREATED":
                out += free
        return out

    def release(self) -> None:
        for pg in self.pgs:
            try:
                remove_placement_group(pg)
            except Exception:  # already gone with the cluster
                pass
        self.pgs, self.slots = [], []


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
