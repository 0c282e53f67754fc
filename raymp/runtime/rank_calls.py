"""Waiting on the same call made on every rank: results in rank order, and a lost rank known
the moment Ray knows it. Survivors of a dead peer sit in a collective until its timeout, so the
driver must never wait for them to learn of the death: the first failed call ends the wait.
ActorGroup makes the calls; how they are waited on is here."""

from __future__ import annotations

import time
from typing import Callable

import ray

from raymp.runtime.peer_loss import is_peer_loss

WATCH_PERIOD_S = 1.0  # how often a starting group checks that its nodes are still there


class WorkerLostError(RuntimeError):
    """A rank is gone or stuck: its actor (or node) died, a collective failed because a peer
    did, or a call ran past its time limit. `kind` is 'died', 'collective' or 'timeout'."""

    def __init__(self, message: str, rank: int | None = None, kind: str = "died", step: int | None = None):
        super().__init__(message)
        self.rank, self.kind, self.step = rank, kind, step


class JoinFailed(WorkerLostError):
    """A rank that was joining the group was lost (in the rendezvous, its set-up or while taking
    its state): the ranks that were there still hold their state (Worker.keep_state), and the
    group is back to them alone."""


def deadline_in(timeout_s: float | None) -> float | None:
    """The monotonic time `timeout_s` from now (None: no deadline)."""
    return None if timeout_s is None else time.monotonic() + timeout_s


def gather(refs: list, deadline: float | None, knob: str, where: Callable[[int], str], watch=None) -> list:
    """Like ray.get(refs) (one ref per rank, in rank order), but raises WorkerLostError as soon as
    any call fails because its rank died or lost a peer in a collective, or at `deadline` (the
    error names `knob`, the setting that gave it). `where(rank)` says where a rank runs.
    `watch()`, if given, is called about once a second while waiting and may raise."""
    rank_of = {ref: r for r, ref in enumerate(refs)}
    pending = list(refs)
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        wait_s = left
        if watch is not None:
            watch()
            wait_s = WATCH_PERIOD_S if left is None else min(WATCH_PERIOD_S, left)
        done, pending = ray.wait(pending, num_returns=1, timeout=wait_s)
        if not done and wait_s != left:
            continue  # a watch period ended, not the deadline
        if not done:
            late = sorted(rank_of[r] for r in pending)
            raise WorkerLostError(
                f"ranks {late} did not finish in time ({knob}): a hung rank or collective, or an "
                "actor that never started", late[0], "timeout")
        try:
            ray.get(done[0])
        except ray.exceptions.RayActorError as exc:
            raise WorkerLostError(where(rank_of[done[0]]) + " died. Cause: "
                                  + str(exc).splitlines()[0], rank_of[done[0]], "died") from exc
        except ray.exceptions.RayTaskError as exc:
            if not is_peer_loss(getattr(exc, "cause", None)):
                raise
            raise WorkerLostError(
                where(rank_of[done[0]]) + " lost a peer in a collective: "
                + str(exc.cause).splitlines()[0], rank_of[done[0]], "collective") from exc
    return ray.get(refs)


def first_answers(refs: list, timeout_s: float, knob: str,
                  grace_s: float) -> tuple[dict[int, object], list[int]]:
    """(rank -> result of the ranks whose call answered, the ranks still silent): a dead rank's
    call fails at once and is left out; once one rank has answered, the others get `grace_s`
    more. WorkerLostError (naming `knob`) when none answers within `timeout_s`."""
    rank_of = {ref: r for r, ref in enumerate(refs)}
    alive, pending, deadline = {}, list(refs), deadline_in(timeout_s)
    while pending:
        left = max(0.0, deadline - time.monotonic())
        done, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not done:
            break
        try:
            alive[rank_of[done[0]]] = ray.get(done[0])
            if len(alive) == 1:
                deadline = time.monotonic() + grace_s
        except ray.exceptions.RayActorError:
            continue
    if not alive:
        raise WorkerLostError(f"no surviving rank ended its failed step in time ({knob})", None, "timeout")
    return alive, [rank_of[ref] for ref in pending]
