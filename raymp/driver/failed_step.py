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


class FailedStep:
    """The calls of the step a rank was lost in, by rank, and every call of the group whose result
    was not read then (the step queued after it, the steps the survivors abandoned): the calls
    that ended well say who took the step (finished_at), and every result is read once its call
    ends (read_results; Ray prints an "Unhandled error" for a failed result never read)."""

    def __init__(self):
        self.step: int | None = None
        self._calls: list = []
        self._unread: list = []

    def record(self, step: int, calls: list, queued: list) -> None:
        """`step`'s `calls` failed; `queued`: the calls of the step queued after it."""
        self.step, self._calls, self._unread = step, calls, calls + queued

    def add_unread(self, calls: list) -> None:
        self._unread += calls

    def finished_at(self, step: int) -> dict[int, RankReport]:
        """rank -> its report of the failed step, when it is `step` (the run's next), from the
        ranks whose call of it ended well."""
        return ended_well(self._calls) if self.step == step else {}

    def read_results(self) -> None:
        """Read the results that are in (errors, known already)."""
        unread, self._unread = self._unread, []
        if unread:
            ended_well(unread)
