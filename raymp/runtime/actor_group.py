"""One Worker actor per device, joined into one torch process group; the same call on every
rank (waited on as raymp.runtime.rank_calls waits); a group that shrinks to its survivors and
grows back.

Kept separate from any one training run so tests (and notebooks) can reuse the same processes
for several configs of the same world size: actor start-up costs seconds, a re-setup does not.
"""

from __future__ import annotations

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raymp.config import ResourcesConfig
from raymp.runtime.placement import Placement, PlacementError
from raymp.runtime.rank_calls import WorkerLostError, deadline_in, first_answers, gather
from raymp.runtime.spares import WarmSpares
from raymp.runtime.worker import Worker


# The bounds' defaults are the config's (resources.*): one authority for each.
_DEFAULT = ResourcesConfig.model_fields


class ActorGroup:
    """One Worker actor per rank, in the bundles of raymp.runtime.placement (a TP group on one
    node), joined into one torch process group."""

    def __init__(self, world_size: int, device: str = "cpu",
                 cpus_per_actor: float = _DEFAULT["cpus_per_actor"].default,
                 placement_timeout_s: float = _DEFAULT["placement_timeout_s"].default,
                 collective_timeout_s: float = _DEFAULT["collective_timeout_s"].default,
                 worker_cls: type = Worker, tp_size: int = 1,
                 rendezvous_timeout_s: float = _DEFAULT["rendezvous_timeout_s"].default,
                 on_event=None, spares: int = 0):
        """`on_event(name, info)`, if given, is called once the placement groups are ready
        ("placed", with the node of every rank's bundle), before any actor starts: tests use it
        to lose a node at that exact moment. `spares`: warm spare ranks (elastic.spares), started
        once the group has formed."""
        if world_size % tp_size:
            raise ValueError(f"world size {world_size} is not a multiple of the TP size {tp_size}")
        self.world_size, self.device, self.tp_size, self.cpus = world_size, device, tp_size, cpus_per_actor
        self.workers, self.backend = [], "nccl" if device == "cuda" else "gloo"
        self.spares: WarmSpares | None = None
        self.placement = Placement(
            {"CPU": cpus_per_actor, **({"GPU": 1} if device == "cuda" else {})}, tp_size
        )
        # Threads of their own beside the step: "control" for abandon_step, "copies" for
        # finish_peer_copy (a peer copy is handed over while the next step runs).
        self._remote_cls = ray.remote(concurrency_groups={"control": 1, "copies": 1})(worker_cls)
        try:
            self.placement.reserve(world_size, placement_timeout_s)
            if on_event is not None:
                on_event("placed", {"bundle_nodes": [self.placement.node_of(r) for r in range(world_size)]})
            self.workers = [self._start_worker(slot) for slot in self.placement.slots]
            self._join(["init_distributed"] * world_size, collective_timeout_s, rendezvous_timeout_s,
                       self._check_placement)
            if spares:
                self.spares = WarmSpares(spares, tp_size, self.placement.bundle, self._start_worker)
        except BaseException:
            self.shutdown()  # a half-built group never outlives its failure: its resources go back
            raise

    def _start_worker(self, slot: tuple):
        return self._remote_cls.options(
            num_cpus=self.cpus, num_gpus=1 if self.device == "cuda" else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(*slot),
        ).remote(max(1, int(self.cpus)))

    def _join(
        self, methods: list[str], collective_timeout_s: float, rendezvous_timeout_s: float, watch=None
    ) -> None:
        """Form the process group of self.workers, in order: rank 0's address, then each rank's
        method (init_distributed for new actors, rejoin for survivors), then where each is."""
        knob, deadline = "resources.rendezvous_timeout_s", deadline_in(rendezvous_timeout_s)
        addr, port = self._gather([self.workers[0].rendezvous_address.remote()], deadline, knob, watch)[0]
        self.formation = (addr, port)
        self._gather(
            [
                getattr(w, m).remote(rank, len(self.workers), addr, port, self.backend, collective_timeout_s)
                for rank, (w, m) in enumerate(zip(self.workers, methods))
            ],
            deadline,
            knob,
            watch,
        )
        self.nodes = self._gather([w.node_info.remote() for w in self.workers], deadline, knob, watch)
        self.node_ids = sorted({n["node_id"] for n in self.nodes})

    def survivors(
        self, method: str, timeout_s: float, knob: str, grace_s: float, grace_knob: str
    ) -> dict[int, object]:
        """rank -> result of `method` on the ranks that are alive and free. It runs after the
        calls queued on a rank have ended (a survivor's failed step first); a dead rank's call
        fails at once and the rank is left out. Once one rank has answered, the others get
        `grace_s` more: one still inside its failed step then is waiting on a lost peer that
        gloo never told it about (raymp.runtime.peer_loss), and is let go (killed)."""
        alive, late = first_answers([getattr(w, method).remote() for w in self.workers], timeout_s,
                                    knob, grace_s)
        self.kill_ranks(late)
        return alive

    def abandon_steps(self) -> list:
        """Tell every rank to drop the step it runs (a peer is lost; Worker.abandon_step), so the
        survivors are free at once instead of at their next collective. Returns the calls' refs,
        for the caller to read (a dead rank's fails)."""
        return [w.abandon_step.remote(self.formation) for w in self.workers]

    def kill_ranks(self, ranks) -> None:
        """Kill these ranks' actors (their sockets close with them, so no peer waits on them)."""
        for rank in ranks:
            try:
                ray.kill(self.workers[rank])
            except Exception:  # already gone with its node
                pass

    def shrink_to(self, ranks: list[int], collective_timeout_s: float, rendezvous_timeout_s: float,
                  add: int = 0) -> None:
        """Go on with the actors of `ranks` only, in that order: the others are killed, the kept
        ones join a new process group, keeping their processes and memory; with `add` new
        ranks after them (grow(): warm spares first), in the same process group.
        (The placement groups stay: a lost node's bundle waits to be re-placed by Ray, where
        grow() can start a rank again.)"""
        self.kill_ranks(r for r in range(len(self.workers)) if r not in ranks)
        self.workers = [self.workers[r] for r in ranks]
        self.placement.keep(ranks)
        self.world_size = len(ranks)
        if add:
            self.grow(add, collective_timeout_s, rendezvous_timeout_s)
        else:
            self._join(["rejoin"] * len(ranks), collective_timeout_s, rendezvous_timeout_s)

    def forget_joined(self, before: int) -> None:
        """A join that failed: the ranks it started (from `before` on) are killed and forgotten,
        their bundles free for the next try. The kept ranks' process group is broken: they re-form
        one among themselves when they go on (shrink_to)."""
        self.kill_ranks(range(before, len(self.workers)))
        self.workers = self.workers[:before]
        self.placement.keep(list(range(before)))
        self.world_size = before

    def has_room(self) -> bool:
        """Cheap (no call to Ray): a free bundle or a warm spare may let ranks join."""
        return self.placement.has_free() or bool(self.spares and self.spares.groups)

    def joinable(self) -> int:
        """How many ranks grow() can start now: ready warm spares, and free bundles on live nodes."""
        free = len(self.placement.free()) if self.placement.has_free() else 0
        return free + (self.spares.ready() if self.spares else 0)

    def grow(self, count: int, collective_timeout_s: float, rendezvous_timeout_s: float) -> None:
        """`count` new ranks after the current ones: warm spares first, then new actors in free
        bundles; all join one new process group, the current ranks keeping their processes and
        memory (rejoin). The spares used are replaced (started anew where the cluster has room)."""
        free, ready = self.placement.free(), self.spares.ready() if self.spares else 0
        if ready + len(free) < count:
            raise PlacementError(f"{count} ranks cannot join: {ready} warm spares are ready and "
                                 f"{len(free)} free bundles are placed")
        warm = self.spares.take(count) if ready else []
        slots = free[:count - len(warm)]
        self.placement.adopt([slot[0] for slot, _ in warm])
        new = [slot for slot, _ in warm] + slots
        self.placement.slots += new
        self.workers += [actor for _, actor in warm] + [self._start_worker(slot) for slot in slots]
        old, self.world_size = self.world_size, len(self.workers)
        try:
            self._join(
                ["rejoin"] * old + ["init_distributed"] * count,
                collective_timeout_s,
                rendezvous_timeout_s,
                lambda: self._check_placement({slot[0].id for slot in new}),
            )
        finally:
            if self.spares:
                self.spares.refill()

    def _check_placement(self, pg_ids: set | None = None) -> None:
        """Raise at once if a node holding one of our bundles (those of `pg_ids` only, if given:
        the new ranks' while some join) was lost while the group starts: an actor not yet started
        there would wait for Ray to re-place its bundle, and the peers that did start would wait
        for it in the rendezvous until the timeout."""
        if self.placement.rescheduling(pg_ids):
            raise WorkerLostError("a node holding part of the new actor group was lost while it "
                                  "started (its placement group is being re-placed)", None, "died")

    def call(self, method: str, *args, timeout_s: float | None = None, knob: str = "elastic.step_timeout_s",
             **kwargs) -> list:
        """The same call on every rank, in parallel; returns results in rank order. Raises
        WorkerLostError as soon as a rank is lost, or when the ranks have not all finished within
        timeout_s (the error names `knob`, the setting that gave it)."""
        return self.collect(self.submit(method, *args, **kwargs), timeout_s, knob)

    def submit(self, method: str, *args, **kwargs) -> list:
        """The same call queued on every rank; collect() its results. A call queued behind another
        starts the moment that one ends (Ray runs an actor's calls in order)."""
        return [getattr(w, method).remote(*args, **kwargs) for w in self.workers]

    def collect(
        self, refs: list, timeout_s: float | None = None, knob: str = "elastic.step_timeout_s"
    ) -> list:
        """Results of submit()'s refs in rank order, as call() gathers them; timeout_s counts from now."""
        return self._gather(refs, deadline_in(timeout_s), knob)

    def call_per_rank(self, method: str, args_per_rank: list[tuple], timeout_s: float | None = None,
                      knob: str = "elastic.step_timeout_s") -> list:
        return self._gather([getattr(w, method).remote(*a) for w, a in zip(self.workers, args_per_rank)],
                            deadline_in(timeout_s), knob)

    def _gather(self, refs: list, deadline: float | None, knob: str, watch=None) -> list:
        return gather(refs, deadline, knob, self._where, watch)

    def _where(self, rank: int) -> str:
        node = self.nodes[rank]["node_ip"] if rank < len(getattr(self, "nodes", [])) else "?"
        return f"rank {rank} on node {node}"

    def shutdown(self) -> None:
        """Kill the actors and give back the placement groups (also those of a half-built group)."""
        for w in self.workers:
            try:
                ray.kill(w)
            except Exception:  # already gone with its node
                pass
        if self.spares:
            self.spares.shutdown()
        self.placement.release()
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
