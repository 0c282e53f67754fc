"""The actors of the run's current layout and what is tied to them: the group, the config it was
launched with (stage split decided), the ranks' set-up reports, the planner's estimate, the
checkpoint coordinator, and the run's step counter (a launch sets it, each step advances it). The
Trainer steps it; the elastic controller drives it (abandon_save, teardown, relaunch, the failed
step) and changes its ranks through driver.rank_changes."""

from __future__ import annotations

from typing import Callable

from raymp.checkpoint.coordinator import CheckpointCoordinator
from raymp.checkpoint.restore import COLLECTIVE_KNOB, restore_newest_intact
from raymp.checkpoint.store import Checkpoint
from raymp.config import RunConfig, resolved_dict
from raymp.driver.failed_step import vote_record
from raymp.driver.launch import FromMemory, FromNewest, Launcher, RunParts
from raymp.driver.metrics import peak_tflops, step_metrics, with_stand_ins
from raymp.driver.step_calls import StepCalls
from raymp.driver.stopping import stop_signals_held
from raymp.elastic import with_dp
from raymp.models import model_args
from raymp.step_time import step_flops
from raymp.runtime.actor_group import ActorGroup
from raymp.runtime.report import RankReport, RankSetup
from raymp.version import __version__


class Session:
    def __init__(self, config: RunConfig, parts: RunParts, launcher: Launcher, say, run_name: str,
                 on_commit: Callable[[int], None], mlflow_record: Callable[[], dict | None]):
        """`on_commit(step)`: a commit made the steps before `step` final (tracking publishes
        them); `mlflow_record()`: the MLflow run a checkpoint records, if tracked."""
        self.config, self.launcher, self.say, self.run_name = config, launcher, say, run_name
        self.feed, self.lineage, self.device = parts.feed, parts.lineage, parts.device
        self.peer_copies, self.shared_group = parts.peer_copies, parts.shared_group
        self._on_commit, self._mlflow_record = on_commit, mlflow_record
        self.group: ActorGroup | None = None
        self.checkpoints: CheckpointCoordinator | None = None
        self.setup_info: list[RankSetup] = []  # per rank: coords, stages, parameters, set-up memory
        self.memory_estimate: list = []  # the planner's RankEstimate per pipeline stage
        self.initial_position = None  # where a run without a checkpoint started
        # The run's step counter: optimizer steps done, those before a restored position included.
        # A launch sets it to where its data streams start; each step's results advance it.
        self.global_step = 0
        self.calls = StepCalls(config)  # how steps are queued and collected, the failed one kept
        # A failed step its vote took, recorded for the Trainer (commit_failed_step).
        self.committed: tuple[int, list, dict] | None = None

    def start(self, position) -> Checkpoint | None:
        """The run's first launch: at the lineage's newest intact state, else at `position` (a
        resume position, or None: the first step). A restart that finds no checkpoint later
        starts again where this launch did (initial_position)."""
        restored = self.launch(FromNewest(position))
        self.initial_position = self.feed.start if restored is None else None
        return restored

    def launch(self, start: FromNewest | FromMemory, group: ActorGroup | None = None) -> Checkpoint | None:
        """The actors for self.config's layout (on `group`, else new ones), brought to the state
        `start` says (Launcher.launch). Returns what it restored from storage or a peer copy."""
        self.group = None
        self.calls.new_launch()
        launched = self.launcher.launch(self.config, start, group)
        self.group, self.config = launched.group, launched.config
        self.global_step = self.feed.start.step
        self.setup_info, self.memory_estimate = launched.setup_info, launched.memory_estimate
        self._step_constants = self._per_step_constants()
        c = self.config.checkpoint
        self.checkpoints = CheckpointCoordinator(
            self.lineage,
            c.every,
            c.async_save,
            self.say,
            c.write_timeout_s,
            on_commit=self._on_commit,
        )
        return launched.restored

    # -- calls on every rank -----------------------------------------------------------------

    def _per_step_constants(self) -> tuple[float, float | None, float]:
        """What every step's metrics divide by, fixed for a launch: the model FLOPs of a step, the
        device's peak, the planner's largest per-rank estimate."""
        cfg, t = self.config, self.config.train
        flops = step_flops(
            model_args(cfg.model, self.feed.data.vocab_size), t.global_batch_size, t.seq_len
        )
        estimate = max(e.measured_part_bytes for e in self.memory_estimate)
        return flops, peak_tflops(cfg, self.device), estimate

    def queued(self) -> bool:
        return self.calls.queued()  # a step queued on the ranks ahead of the driver (dispatch_ahead)

    def run_step(self, step: int, next_may_start: bool = False) -> tuple[list, dict]:
        """One optimizer step on every rank: (the ranks' reports, the step's metrics).
        `next_may_start`: the caller runs step+1 next with nothing in between on its side, so it
        may be queued on the ranks early (StepCalls.run; the save due between rides on this
        step's call: CheckpointCoordinator.order)."""
        reports, seconds = self.calls.run(self.group, self.config, self.checkpoints, self.peer_copies, step,
                                          next_may_start)
        self.global_step = step + 1
        return reports, step_metrics(step, reports, self.config.parallel.layout, self.config, seconds,
                                     *self._step_constants)

    def evaluate(self) -> float:
        return sum(losses := [x for x in self.group.call("evaluate") if x is not None]) / len(losses)

    def state_dict(self) -> dict:
        return {
            k: v for part in self.group.call("full_state_dict") if part is not None for k, v in part.items()
        }

    def layout_rows(self) -> list[dict]:
        lay = self.config.parallel.layout
        return [{"rank": r, **lay.coords(r), "stages": self.setup_info[r].stages, **info}
                for r, info in enumerate(self.group.nodes)]

    # -- what the elastic controller drives ---------------------------------------------------

    def abandon_save(self):
        return self.checkpoints.abandon()

    def teardown(self) -> None:
        self.calls.failed.read_results()
        if self.group is not None and self.group is not self.shared_group:
            self.group.shutdown()
        self.group = None
        self.calls.drop_queued()

    def relaunch(self, dp: int) -> Checkpoint | None:
        """The run again with `dp` replicas, from the lineage's newest intact state."""
        self.config = with_dp(self.config, dp)
        return self.launch(FromNewest(self.initial_position))  # counts only without a checkpoint

    def finished_failed_step(self) -> dict[int, RankReport]:
        """rank -> its report of the failed step, from the ranks whose call of it ended well
        (asked once the survivors answered: their calls of it have ended)."""
        return self.calls.failed.finished_at(self.global_step)

    def commit_failed_step(self, finished: dict[int, RankReport]) -> None:
        """The failed step was taken by every rank (its commit vote passed; `finished`: the reports
        that came back): record it (self.committed, for the Trainer) with the loss and samples the
        vote gathered from the ranks whose reports are lost, and count it done."""
        step, r = self.calls.failed.step, self.config.resources
        record = vote_record(self.group.workers, finished, step, r.collective_timeout_s, COLLECTIVE_KNOB)
        layout = self.config.parallel.layout
        reports = with_stand_ins(finished, record, layout)
        step_time = max(rep.compute_s for rep in finished.values())  # the step's end was never seen
        metrics = step_metrics(step, reports, layout, self.config, step_time, *self._step_constants)
        metrics["stand_in_ranks"] = [rep.rank for rep in reports if rep.stand_in]
        self.committed, self.global_step = (step, reports, metrics), step + 1

    def shut_down(self) -> None:
        """Kill the group's actors (a fault while re-forming it: a restart starts from nothing)."""
        if self.group is not None:
            self.group.shutdown()
        self.group = None

    # -- checkpoints --------------------------------------------------------------------------

    def checkpoint_meta(self) -> dict:
        """What a commit marker records besides its files and lineage."""
        meta = {"data_position": self.position().to_dict(),
                "layout": self.config.parallel.layout.record(), "run_name": self.run_name,
                "config": resolved_dict(self.config), "raymp_version": __version__}
        mlflow = self._mlflow_record()
        return {**meta, "mlflow": mlflow} if mlflow else meta

    def collect_saves(self, reports: list, metrics: dict) -> None:
        """Commit the save the ranks report finished with this step (before anything can stop
        or rewind the run: what they wrote is a good state)."""
        if (done := self.checkpoints.collect([r.checkpoint for r in reports])) is not None:
            metrics["checkpoint_committed"] = done.step

    def after_step(self, reports: list, steps_done: int, metrics: dict, wants_to_grow) -> bool:
        """Commit what the ranks finished writing and start the save due now. True when the
        run should grow back now: steps are left, it wants to (`wants_to_grow()`) and that save
        just committed."""
        started = self.checkpoints.after_step(self.group, [r.checkpoint for r in reports],
                                              [r.save_started for r in reports], steps_done,
                                              self.config.train.steps, self.checkpoint_meta, metrics)
        if self.peer_copies.due(steps_done) and self.checkpoints.pending is None:  # none in flight
            self.peer_copies.take(self.group, steps_done, self.position().to_dict())
        steps_left = steps_done < self.config.train.steps
        if not (started and steps_left and self.shared_group is None and wants_to_grow()):
            return False
        if (grown_from := self.checkpoints.finish(self.group)) is None:
            return False
        metrics["checkpoint_committed"] = grown_from.step
        return True

    def load(self, checkpoint: Checkpoint, say) -> None:
        """Every rank restored from `checkpoint` (saved under any layout), the streams restarted
        at its data position."""
        restore_newest_intact(
            self.group, [checkpoint], lambda: None, say, self.config.resources.setup_timeout_s
        )
        self.start_streams(checkpoint.data_position)

    def start_streams(self, position) -> None:
        feed = self.feed
        feed.start_streams(self.group, self.config.parallel.layout, self.config,
                           feed.checked(position, self.config.train.steps))
        self.global_step = feed.start.step

    def position(self):
        """Where the run is in the data now (DataPosition): saved with a checkpoint, continued from."""
        return self.feed.position(self.global_step)

    def save_now(self, steps_done: int) -> Checkpoint:
        """Save the state after `steps_done` steps and wait for its commit."""
        return self.checkpoints.save_now(self.group, steps_done, self.checkpoint_meta())

    def commit_in_flight(self, best_effort: bool = False) -> None:
        """Commit the save in flight at the end of the run (CheckpointCoordinator.commit_at_end)."""
        if self.checkpoints is not None:
            self.checkpoints.commit_at_end(self.group, best_effort)

    def commit_on_stop(self) -> None:
        """The run was stopped: commit the save in flight with further stop signals held until it
        is done (CheckpointCoordinator.commit_on_stop)."""
        if self.checkpoints is not None:
            def holding(step: int):
                return stop_signals_held(self.say, f"committing the checkpoint of step {step}")

            self.checkpoints.commit_on_stop(self.group, holding)

