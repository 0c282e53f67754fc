"""What a failed step left on the ranks, read once the survivors have answered: the calls of it
that ended well, and the record of its commit vote (raymp.runtime.commit_vote) from a survivor.
The Session records the step from them when every survivor took it whole."""

from __future__ import annotations

import ray

from raymp.runtime.rank_calls import WorkerLostError
from raymp.runtime.commit_vote import StepRecord
from raymp.runtime.report import RankReport


def ended_well(refs: list) -> dict[int, RankReport]:
    """rank -> the result of its call in `refs` (by rank), for the calls that have ended without
    an error (none is waited for). Every ended call is read, the failed ones too: Ray prints an
    "Unhandled error" for a failed result never read."""
    ready = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0])
    finished = {}
    for rank, ref in enumerate(refs):
        if ref in ready:
            try:
                finished[rank] = ray.get(ref)
            except Exception:  # the rank's step failed: it did not take the step whole
                continue
    return finished


def vote_record(workers: list, ranks, step: int, timeout_s: float, knob: str) -> StepRecord:
    """The record of `step`'s commit vote from the first of `ranks` that answers with it (the lost
    rank's replica was let go: its ranks may not)."""
    for rank in ranks:
        try:
            record = ray.get(workers[rank].step_record.remote(step), timeout=timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            continue
        if record is not None:
            return record
    raise WorkerLostError(f"step {step}: no survivor answered with the commit vote's record in time "
                          f"({knob})", None, "died", step)
