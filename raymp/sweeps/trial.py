"""One trial of a sweep: a whole raymp run (its own actors, data stream, MLflow run nested under
the sweep's) driven one optimizer step per Tune iteration, so Tune's scheduler sees every step's
metrics and can stop the trial between two steps."""

from __future__ import annotations

import json
import logging
import signal
import threading
from pathlib import Path
from typing import Any

from ray import tune

from raymp.driver.summary import steady_median
from raymp.errors import user_errors
from raymp.trainer import Trainer
from raymp.sweeps.spec import override

# What a trial reports besides its step metrics: its MLflow run, how many steps it ran and, at
# its last step, the median step time of its steady state (what a layout search compares).
RUN_ID = "raymp_run_id"
STEPS_DONE = "raymp_steps"
STEADY_STEP_S = "raymp_steady_step_s"
CHECKPOINT_FILE = "raymp_checkpoint.json"  # in Tune's checkpoint: which raymp checkpoint it is


class RaympTrial(tune.Trainable):
    """Tune's class API (not a function): Tune calls cleanup() when its scheduler stops a trial,
    which is where the trial's MLflow run is marked with why it ended and its actors let go."""

    def setup(self, config: dict[str, Any], base: dict, sweep_name: str, parent_run_id: str | None,
              metric: str) -> None:
        self.trainer = self.tracker = None  # a reused process's last trial ended in reset_config
        self.params, self.metric, self.last = dict(config), metric, None
        name = f"{sweep_name}-{self.trial_id}"
        sets = [override(field, value) for field, value in self.params.items()]
        sets += [override("tracking.run_name", name)]
        if parent_run_id:
            sets.append(override("tracking.parent_run_id", parent_run_id))
        # Tune says "checkpoint created" at every save; the sweep's table is what the user reads.
        for logger in ("ray.tune", "ray.train"):
            logging.getLogger(logger).setLevel(logging.WARNING)
        self.ended: str | None = None  # why the run ended, when it did not run all its steps
        self.setup_error: Exception | None = None
        # A restarted trial is the same run: checkpoint.resume=auto finds its latest checkpoint
        # and its MLflow run goes on (load_checkpoint then makes it the one Tune names). A trial's
        # directory is new on its first start, where `never` and `auto` do the same.
        if base["checkpoint"]["resume"] == "never":
            sets.append(override("checkpoint.resume", "auto"))
        try:
            self.trainer = Trainer(base, sets, progress=False)
            self.trainer.setup()
            # The trial's MLflow run, None where tracking.enabled is false.
            self.tracker = getattr(self.trainer.tracking, "tracker", None)
        except user_errors() as exc:
            # Raised from the first step instead: an error in an actor's creation is printed by
            # Ray with its traceback, one in a call only reaches Tune (the sweep prints its line).
            self.setup_error, self.ended = exc, f"could not start: {exc}"

    def step(self) -> dict:
        if self.setup_error is not None:
            raise self.setup_error
        trainer = self.trainer
        try:
            metrics = trainer.step()  # a lost node is recovered inside, as in a single run
        except Exception as exc:
            self.ended = f"failed at step {trainer.global_step}: {exc}"
            raise
        result = {k: float(v) for k, v in metrics.items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool)}
        # A metric some steps lack (val_loss between validations) is carried from the last step
        # that had it, so the scheduler compares every trial at every rung.
        self.last = result.get(self.metric, self.last)
        if self.last is not None:
            result[self.metric] = self.last
        result[STEPS_DONE] = trainer.global_step
        result[RUN_ID] = self.tracker.run_id if self.tracker is not None else ""
        result["done"] = trainer.global_step >= trainer.config.train.steps
        if result["done"]:  # as fit() ends: the last save committed, then the MLflow run
            result[STEADY_STEP_S] = steady_median(trainer.history, "step_time_s")
            trainer.session.commit_in_flight()
            trainer.end_tracking("FINISHED")
        return result

    def save_checkpoint(self, checkpoint_dir: str) -> None:
        """A raymp checkpoint (sharded, verified, committed in the run's own checkpoint.dir) that
        Tune's checkpoint names: a paused or restarted trial goes on from exactly that state."""
        saved = self.trainer.save_checkpoint()
        Path(checkpoint_dir, CHECKPOINT_FILE).write_text(json.dumps({"path": saved.path, "step": saved.step}))

    def load_checkpoint(self, checkpoint_dir: str) -> None:
        saved = json.loads(Path(checkpoint_dir, CHECKPOINT_FILE).read_text())
        if self.trainer.global_step != saved["step"]:
            self.trainer.load_checkpoint(saved["path"])

    def reset_config(self, new_config: dict[str, Any]) -> bool:
        """The next trial in this trial's process (the sweep's reuse_actors): the last one ends
        as cleanup() ends it, the next starts as setup() starts it (Tune's with_parameters
        subclass passes the sweep's arguments again), without a new process importing torch,
        Tune and MLflow. Its actors are its own, as in a new process."""
        self.cleanup()
        self.setup(new_config)
        return True

    def stop(self) -> None:
        """The trial's process ends after this (Tune then sends __ray_terminate__)."""
        end_at_once_on_sigterm()
        super().stop()

    def cleanup(self) -> None:
        trainer, self.trainer = getattr(self, "trainer", None), None
        if trainer is None:  # its config was refused (Tune's error says why), or it ended already
            return
        if trainer.global_step < trainer.config.train.steps:
            why = self.ended or f"stopped early by the sweep's scheduler after step {trainer.global_step}"
            if getattr(self, "tracker", None) is not None:  # none when its set-up failed
                self.tracker.set_tag("raymp.trial_stop", why)
            # Its steps are final (a stopped trial is not resumed): published, not dropped.
            trainer.end_tracking("FAILED" if self.ended else "KILLED", complete=True)
        trainer.close()


def end_at_once_on_sigterm() -> None:
    """A process on its way out: SIGTERM (the sweep's job ending while it still finalizes) ends it
    with no Python run. Ray's handler raises SystemExit wherever Python is, and raised inside a
    weakref callback of the interpreter's teardown, Python prints it as "Exception ignored in"
    with a traceback, under the sweep's table. Signal handlers are set in the main thread only,
    where Ray runs a synchronous actor's calls."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
