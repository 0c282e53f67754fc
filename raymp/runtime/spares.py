"""Warm spares (elastic.spares): Worker actors started ahead of need, each group of them in a
placement group of its own, that take lost ranks' places when the survivors grow back
(ActorGroup.grow). A cold join starts a process and imports torch and the model code (seconds);
a spare has done that while the run trained, and imported Ray Data (Worker.prepare_to_join),
so only the process group, the set-up and the state transfer are left.

A spare's placement group is its own, not a bundle of the ranks' group: Ray marks a whole
placement group RESCHEDULING when one of its nodes is lost, and while the ranks' group waits for
room, a bundle in it could not be joined. A spare group waits for room the same way (it starts
when Ray places it); only spares whose actors have prepared are taken.
"""

from __future__ import annotations

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group


class WarmSpares:
    """`count` spare ranks, in groups of `unit` (a TP group's size: a joining TP group must share
    a node), started by `start_actor(slot)` in their own placement groups."""

    def __init__(self, count: int, unit: int, bundle: dict, start_actor):
        if count % unit:
            raise ValueError(f"{count} spare ranks are not whole groups of {unit} (the TP size)")
        self.count, self.unit, self.bundle, self._start_actor = count, unit, bundle, start_actor
        self.groups: list[tuple] = []  # (placement group, [actor], their prepare_to_join refs)
        self.refill()

    def refill(self) -> None:
        """Start spares up to the count; their placement groups are placed when the cluster has room."""
        while len(self.groups) * self.unit < self.count:
            pg = placement_group([dict(self.bundle) for _ in range(self.unit)],
                                 strategy="STRICT_PACK" if self.unit > 1 else "PACK")
            actors = [self._start_actor((pg, i)) for i in range(self.unit)]
            self.groups.append((pg, actors, [a.prepare_to_join.remote() for a in actors]))

    def ready(self) -> int:
        """Spare ranks that can join now (started, their actors alive); dead ones are let go and
        new ones started in their place."""
        return sum(len(g[1]) for g in self._started_groups())

    def take(self, ranks: int) -> list[tuple[tuple, object]]:
        """Up to `ranks` ready spare ranks, whole groups, as (slot, actor); they leave the pool
        (their placement group is the taker's from now on: Placement.adopt)."""
        taken, started = [], self._started_groups()
        for group in started:
            pg, actors, _ = group
            if len(taken) + len(actors) <= ranks:
                taken += [((pg, i), actor) for i, actor in enumerate(actors)]
                self.groups.remove(group)
        return taken

    def _started_groups(self) -> list[tuple]:
        """The groups whose actors have all answered, read once: a group with a dead actor (its
        node lost) is let go and a new one started, never raised to the caller."""
        alive, started = [], []
        for group in self.groups:
            try:
                if _started(group):
                    started.append(group)
                alive.append(group)
            except ray.exceptions.RayActorError:
                _release(group)
        self.groups = alive
        self.refill()
        return started

    def unplaced(self, wait_s: float = 1.0) -> int:
        """Spare ranks whose placement group the cluster has no room for yet (after `wait_s` more)."""
        waiting = [g[0] for g in self.groups if placement_group_table(g[0]).get("state") != "CREATED"]
        if waiting:
            ray.wait([pg.ready() for pg in waiting], num_returns=len(waiting), timeout=wait_s)
        return sum(len(g[1]) for g in self.groups if placement_group_table(g[0]).get("state") != "CREATED")

    def pids(self) -> list[int]:
        """The process ids of the ready spares (tests: which process joined)."""
        return [info["pid"] for g in self._started_groups() for info in ray.get(g[2])]

    def shutdown(self) -> None:
        for group in self.groups:
            _release(group)
        self.groups, self.count = [], 0


def _started(group: tuple) -> bool:
    """Whether every actor of the group has answered (raises RayActorError for a dead one)."""
    done, pending = ray.wait(group[2], num_returns=len(group[2]), timeout=0)
    if pending:
        return False
    ray.get(done)
    return True


def _release(group: tuple) -> None:
    pg, actors, _ = group
    for actor in actors:
        try:
            ray.kill(actor)
        except Exception:  # already gone with its node
            pass
    try:
        remove_placement_group(pg)
    except Exception:
        pass
