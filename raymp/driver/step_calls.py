"""How a step's calls reach the ranks and come back. Apart from the Session (which actors, which
config, which step) because its rules are about timing alone: a step is queued with the save that
rides on it, at most one step ahead of the driver (train.dispatch_ahead), and collected within
the step deadline, which learns from each step; a lost rank's step is kept for the elastic
controller to read (FailedStep)."""

from __future__ import annotations

import time
from typing import NamedTuple

from raymp.checkpoint.coordinator import CheckpointCoordinator
from raymp.config import RunConfig
from raymp.driver.failed_step import FailedStep
from raymp.driver.health import StepDeadline
from raymp.elastic.peer_copies import PeerCopies
from raymp.runtime.actor_group import ActorGroup
from raymp.runtime.rank_calls import WorkerLostError
from raymp.runtime.report import RankReport


class _Queued(NamedTuple):
    step: int
    refs: list
    dispatched_at: float
    carries_save: bool  # the save due after the step rides on its call


class StepCalls:
    def __init__(self, config: RunConfig):
        self.deadline = StepDeadline(config.elastic)  # how long a step may take before a rank counts as hung
        self.failed = FailedStep()  # the calls of the step a rank was lost in
        self.queued_early: list[int] = []  # steps queued before the previous one's results were read
        self._ahead: _Queued | None = None  # queued on the ranks, not yet collected
        self._last_collected = 0.0  # when the last step's results came back

    def new_launch(self) -> None:
        """The group's actors or config changed: nothing is queued, and the deadline learns anew."""
        self.drop_queued()
        self.deadline.new_launch()

    def drop_queued(self) -> None:
        """The step queued ahead goes with the group it was queued on (torn down or re-formed)."""
        self._ahead = None

    def queued(self) -> bool:
        return self._ahead is not None

    def run(self, group: ActorGroup, config: RunConfig, checkpoints: CheckpointCoordinator,
            peer_copies: PeerCopies, step: int, next_may_start: bool) -> tuple[list[RankReport], float]:
        """Run `step` on every rank: (the ranks' reports, seconds from its start to its results).
        `next_may_start`: step+1 follows with nothing in between on the caller's side, so it is
        queued on the ranks before this step's results are read; they start it the moment this
        one ends, while the driver handles this step's results. Not across a save that could not
        ride on the step's call, nor a peer copy. Look-ahead is one step deep."""
        ahead, self._ahead = self._ahead, None
        pending = ahead if ahead is not None and ahead.step == step else \
            self._dispatch(group, config, checkpoints, step)
        save_between = checkpoints.due(step + 1, config.train.steps) and not pending.carries_save
        if next_may_start and not (save_between or peer_copies.due(step + 1)):
            self._ahead = self._dispatch(group, config, checkpoints, step + 1)
            self.queued_early.append(step + 1)
        # A step queued early starts when the one before it ends.
        started = max(pending.dispatched_at, self._last_collected)
        # A blocking save riding on the step is written inside its call: more time, not a hang.
        c = config.checkpoint
        writes = c.write_timeout_s if pending.carries_save and not c.async_save else None
        try:
            reports = group.collect(pending.refs, *self.deadline.limit(writes))
        except WorkerLostError as lost:
            # The survivors' calls end with errors of their own: read later (FailedStep.read_results).
            self.failed.record(step, pending.refs, self._ahead.refs if self._ahead else [])
            self._ahead = None  # its ranks are torn down with the failed step's
            raise WorkerLostError(f"step {step}: {lost}", lost.rank, lost.kind, step) from lost
        self._last_collected = time.perf_counter()
        if writes is None:
            self.deadline.observe(self._last_collected - started)
        return reports, self._last_collected - started

    @staticmethod
    def _dispatch(group: ActorGroup, config: RunConfig, checkpoints: CheckpointCoordinator,
                  step: int) -> _Queued:
        """Queue `step` on every rank, with the save due after it when it can ride on the call
        (CheckpointCoordinator.order)."""
        order = checkpoints.order(step + 1, config.train.steps)
        return _Queued(step, group.submit("train_step", step, order), time.perf_counter(), order is not None)
