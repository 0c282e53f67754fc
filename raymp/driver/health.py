"""Training health: what the run does after a step whose gradients were not finite, and how long
a step may take before a rank counts as hung.

The ranks decide the step itself: the gradient norm is one all-reduce over every rank's
gradients, so every rank sees the same value and, when it is not finite, none applies the update
(a NaN or inf loss on any rank reaches the norm through backward). The state stays the last good
one, so no checkpoint or peer copy can hold what the step would have made. The LR schedule moves
on, so the step counts as a step whose batch was passed over (the one-process reference skips the
same batch the same way). What happens next is the policy's (`train.on_nonfinite`): go on (and stop
anyway after `train.nonfinite_limit` such steps in a row: a diverged run), go back to the newest
checkpoint and redo the steps from it (a transient fault, a flipped bit, leaves no trace; the same
step non-finite again is no transient fault, and stops the run), or stop.
"""

from __future__ import annotations

import math

from raymp.config.schema import TrainingConfig


class NonFiniteError(RuntimeError):
    """The run stopped on non-finite steps; the message says which and what to change."""


class NonFinitePolicy:
    """Counts non-finite steps and says, or stops, as train.on_nonfinite asks."""

    def __init__(self, train: TrainingConfig, warn):
        self.on_nonfinite, self.limit, self.warn = train.on_nonfinite, train.nonfinite_limit, warn
        self.in_a_row = 0
        self.skipped: list[int] = []  # the steps whose update was not applied
        self.restored_for: set[int] = set()  # steps the run went back to a checkpoint for

    def after_step(self, metrics: dict) -> bool:
        """Mark the step's metrics (`update_skipped`) and act on a non-finite one: a line
        always; NonFiniteError when the policy or the limit says stop. True: go back to the
        newest checkpoint and redo the steps from it (train.on_nonfinite=restore)."""
        finite = math.isfinite(metrics["grad_norm"])
        metrics["update_skipped"] = 0 if finite else 1
        if finite:
            self.in_a_row = 0
            return False
        step = metrics["step"]
        self.skipped.append(step)
        self.in_a_row += 1
        what = f"step {step}: the gradient norm is {metrics['grad_norm']} (loss {metrics['loss']:.4g})"
        if self.on_nonfinite == "restore":
            if step in self.restored_for:
                raise NonFiniteError(
                    f"{what} again after going back to a checkpoint for it: no transient fault, "
                    "the run stops with its last good state; lower optimizer.lr, or set "
                    "train.on_nonfinite=skip to pass the batch over"
                )
            self.restored_for.add(step)
            self.warn(f"{what}; its update was not applied, the run goes back to its newest checkpoint "
                      "(train.on_nonfinite=restore)")
            return True
        if self.on_nonfinite == "stop":
            raise NonFiniteError(f"{what}; its update was not applied and the run stops "
                                 "(train.on_nonfinite=stop; 'skip' passes such a batch over)")
        if self.in_a_row >= self.limit:
            raise NonFiniteError(
                f"{what}: {self.in_a_row} non-finite steps in a row (train.nonfinite_limit={self.limit}): "
                "the training diverged and the run stops with its last good state; lower optimizer.lr "
                "or resume from an earlier checkpoint")
        self.warn(f"{what}; its update was not applied, the batch is passed over (train.on_nonfinite=skip)")
        return False


class StepDeadline:
    """How long the driver waits for a step before it counts a rank as hung (a stopped process,
    a deadlocked collective): elastic.step_timeout_s when set; else hang_factor times the
    slowest step of this launch so far, at least hang_floor_s. A launch's first step (compiling,
    warming up) neither has a deadline nor sets one, so it never raises a false alarm; the second
    sets the first deadline, and every step from the third on has one, with the shipped defaults."""

    def __init__(self, elastic):
        self.fixed, self.factor, self.floor = (
            elastic.step_timeout_s,
            elastic.hang_factor,
            elastic.hang_floor_s,
        )
        self.new_launch()

    def new_launch(self) -> None:
        self.first_seen = False  # this launch's first step is done (and not counted)
        self.slowest: float | None = None  # the slowest of this launch's steps after its first

    def observe(self, step_time_s: float) -> None:
        if self.first_seen:
            self.slowest = step_time_s if self.slowest is None else max(self.slowest, step_time_s)
        self.first_seen = True

    def limit(self, writes_checkpoint_s: float | None = None) -> tuple[float | None, str]:
        """(seconds to wait for the next step or None, the setting that gave them).
        `writes_checkpoint_s`: the step's call also writes a checkpoint to storage before it
        returns (a blocking save riding on it), which may take that much longer
        (checkpoint.write_timeout_s); such a step is not observe()d either."""
        seconds, knob = self._step_limit()
        if seconds is None or writes_checkpoint_s is None:
            return seconds, knob
        return seconds + writes_checkpoint_s, (
            f"{knob}, plus checkpoint.write_timeout_s={writes_checkpoint_s:g} "
            "for the checkpoint the step writes"
        )

    def _step_limit(self) -> tuple[float | None, str]:
        if self.fixed is not None:
            return self.fixed, "elastic.step_timeout_s"
        slowest = self.slowest
        if not self.factor or slowest is None:
            return None, "elastic.step_timeout_s"
        seconds = max(self.floor, self.factor * slowest)
        return seconds, (
            f"the automatic step deadline, {seconds:.0f}s: elastic.hang_factor={self.factor:g} x the "
            f"slowest step so far ({slowest:.2f}s), at least elastic.hang_floor_s={self.floor:g}"
        )
