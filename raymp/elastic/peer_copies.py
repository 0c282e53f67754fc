"""In-memory redundancy (elastic.peer_copy_every): every k steps each rank's part of a checkpoint
is kept in Ray's object store twice, on its own node and on another, so the loss of a node costs
no read from storage: a restart loads the newest peer copy that still has every part, and falls
back to the disk checkpoint only when both copies of some part are gone (or the disk one is newer).

What only one rank holds (a ZeRO shard, a pipeline stage, a TP shard) is what this protects:
keep_survivors needs a second whole copy of the state in the layout itself, this makes one.
The driver owns the objects (an object dies with its owner, and a rank may be lost), so a rank
returns its part from a call, and a zero-CPU task pinned to the other node returns it again
there. The parts are DCP files (raymp.checkpoint.in_memory), so a copy loads into any layout.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raymp.checkpoint.restore import COLLECTIVE_KNOB, SETUP_KNOB
from raymp.checkpoint.store import Checkpoint
from raymp.runtime.rank_calls import WorkerLostError

PEER_MEMORY = "peer memory"  # where a restart's state came from (its event's "checkpoint"), for a peer copy


def _copy_task():
    """A task returning its argument: the return value is stored on the node the task runs on.
    Made here, not at module level, so Ray ships it by value and the worker running it imports
    nothing of raymp (importing torch there cost seconds of CPU beside the training, every time
    Ray started that worker again)."""
    def second_copy(part: dict) -> dict:
        return part

    # max_retries=0: a second copy lost with its node is not made again from the first (the
    # driver's core worker would try, pinned to the node that is gone, and say so on the console).
    return ray.remote(num_cpus=0, max_retries=0)(second_copy)


@dataclass
class PeerCopy:
    """The state after `step` steps: per rank of the layout that took it, its part on its own
    node and, once `copies` are ready, on `copy_nodes` (another node where there is one).
    `held`: the steps each rank's part holds, once it has handed the part over."""

    step: int
    position: dict
    parts: list
    nodes: list[str]
    copies: list
    copy_nodes: list[str]
    held: list

    def handed_over(self, timeout_s: float = 0) -> bool | None:
        """Whether every rank handed its part of this copy over (waiting at most timeout_s);
        None while some are still writing. A failed hand-over's errors are read here (Ray
        reports an error nobody read as unhandled)."""
        ready, _ = ray.wait(self.held, num_returns=len(self.held), timeout=timeout_s, fetch_local=False)
        if len(ready) < len(self.held):
            return None
        whole = True
        for held, part, copy in zip(self.held, self.parts, self.copies):
            try:
                whole = ray.get(held) == self.step and whole
            except ray.exceptions.RayError:
                whole = False
                _read_error(part)  # the same call's error
                _read_error(copy)  # the copy task's, made from it
        return whole

    def sources(self, alive: set[str], timeout_s: float = 0) -> list | None:
        """One live reference per part (its own node's, else the other node's ready copy); None
        when some part has no copy left, or was never handed over."""
        if not self.handed_over(timeout_s):
            return None
        ready = set(ray.wait(self.copies, num_returns=len(self.copies), timeout=0, fetch_local=False)[0])
        return choose_sources(self.parts, self.nodes, self.copies, self.copy_nodes, ready, alive)


def _read_error(ref) -> None:
    try:
        ray.get(ref, timeout=0)
    except Exception:
        pass


def choose_sources(parts, nodes, copies, copy_nodes, ready, alive: set[str]) -> list | None:
    chosen = []
    for part, node, copy, copy_node in zip(parts, nodes, copies, copy_nodes):
        if node in alive:
            chosen.append(part)
        elif copy in ready and copy_node in alive:
            chosen.append(copy)
        else:
            return None
    return chosen


def other_node(node: str, nodes: list[str], cluster: list[str] = ()) -> str:
    """The next node after `node` among the group's nodes; where the group sits on one node, the
    next among the cluster's live nodes (that node's loss would take every part with it); itself
    when there is no other."""
    ring = sorted(set(nodes)) if len(set(nodes)) > 1 else sorted(set(cluster) | {node})
    return ring[(ring.index(node) + 1) % len(ring)]


class PeerCopies:
    """The driver's side: when a copy is due, starting it on the ranks (they hand it over while
    the next step runs), and restoring the newest whole one."""

    def __init__(self, every: int, resources, say):
        """`resources`: the config's section (a take waits collective_timeout_s, a load setup_timeout_s)."""
        self.every, self.resources, self.say = every, resources, say
        self.kept: list[PeerCopy] = []  # the newest whole one, then any newer still being handed over
        self.blocked_s: list[float] = []  # per copy taken: how long the ranks paused for it
        self._copy = None

    def due(self, steps_done: int) -> bool:
        return self.every > 0 and steps_done > 0 and steps_done % self.every == 0

    def take(self, group, steps_done: int, position: dict) -> None:
        """A copy of every rank's part of the state after `steps_done` steps (called between
        steps, with no checkpoint save in flight on the ranks): they stage it and go on; each
        part reaches the object store once written, while the next step runs."""
        t0 = time.perf_counter()
        try:
            held = group.call(
                "start_peer_copy", timeout_s=self.resources.collective_timeout_s, knob=COLLECTIVE_KNOB
            )
        except WorkerLostError as lost:  # the run's next step is the one that failed
            raise WorkerLostError(
                f"the peer copy of step {steps_done}: {lost}", lost.rank, lost.kind, steps_done
            ) from lost
        self.blocked_s.append(time.perf_counter() - t0)
        if set(held) != {steps_done}:
            raise RuntimeError(
                f"peer copy: ranks hold states after steps {sorted(set(held))}, not {steps_done}"
            )
        calls = [w.finish_peer_copy.remote(steps_done) for w in group.workers]
        nodes = [n["node_id"] for n in group.nodes]
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        copy_nodes = [other_node(node, nodes, alive) for node in nodes]
        self._copy = self._copy or _copy_task()
        # On one node a second copy protects nothing: the part already outlives its rank's process.
        copies = [
            (
                part
                if node == own
                else self._copy.options(
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
                ).remote(part)
            )
            for (_, part), node, own in zip(calls, copy_nodes, nodes)
        ]
        self._settle()
        self.kept.append(
            PeerCopy(
                steps_done,
                position,
                [part for _, part in calls],
                nodes,
                copies,
                copy_nodes,
                [held for held, _ in calls],
            )
        )

    def _settle(self) -> None:
        """Keep the newest copy every rank has handed over, and any newer still on its way."""
        whole, coming = None, []
        for copy in self.kept:
            state = copy.handed_over()
            if state is None:
                coming.append(copy)
            elif state:
                whole = copy
        self.kept = ([whole] if whole else []) + [c for c in coming if whole is None or c.step > whole.step]

    def restore(self, group, newer_than: int | None, resetup) -> Checkpoint | None:
        """Load the newest peer copy that every part survives of (none older than the disk's newest
        state, step `newer_than`) into every rank; a copy whose load fails (a second copy that
        never arrived) is passed over, the ranks set up afresh. None when no copy loads."""
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        for copy in reversed(self.kept):
            if newer_than is not None and copy.step < newer_than:
                break
            # A live rank still handing its part over gets resources.collective_timeout_s.
            if (sources := copy.sources(alive, self.resources.collective_timeout_s)) is None:
                continue
            try:
                group.collect([w.load_peer_copy.remote(*sources) for w in group.workers],
                              self.resources.setup_timeout_s, SETUP_KNOB)
                return Checkpoint(PEER_MEMORY, copy.step, {"data_position": copy.position})
            except ray.exceptions.RayError as exc:
                self.say(f"elastic: the peer copy of step {copy.step} could not be loaded "
                         f"({str(exc).splitlines()[0][:200]})")
                resetup()
        return None
