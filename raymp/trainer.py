"""The driver: sets a run up, loops over its steps (one call per actor per step), and hands each
concern to the component that owns it: the data feed (raymp.driver.feed), launching a layout
(raymp.driver.launch), step metrics (raymp.driver.metrics), checkpoints
(raymp.checkpoint.coordinator), tracking (raymp.driver.tracking_hooks) and elastic recovery
(raymp.elastic.controller).

    trainer = raymp.Trainer("configs/tiny.yaml", overrides=["parallel.dp=2"])
    trainer.fit()                 # or: trainer.step() repeatedly, inspecting in between
    trainer.history[-1]["loss"]; trainer.layout(); trainer.state_dict()
    trainer.close()
"""

from __future__ import annotations

import datetime as _dt
import sys
import uuid
from pathlib import Path

import yaml

import raymp.storage as storage
from raymp.checkpoint.store import Checkpoint, read_marker
from raymp.config import RunConfig, resolved_dict
from raymp.data import DataPosition
from raymp.driver.feed import DataFeed
from raymp.driver.health import NonFinitePolicy
from raymp.driver.stragglers import StragglerWatch
from raymp.driver.launch import Launcher, RunParts, as_config, check_vocab, num_params
from raymp.driver.metrics import stage_events
from raymp.driver.run_setup import check_destinations, open_lineage, removed_if_setup_fails, say_resume
from raymp.driver.rank_changes import RankChanges
from raymp.driver.session import Session
from raymp.driver.summary import describe, memory_rows, summary
from raymp.driver.tracking_hooks import NoTracking, RunTracking
from raymp.elastic.controller import ElasticController
from raymp.elastic.peer_copies import PeerCopies
from raymp.elastic.policy import RecoveryPolicy, ScalingPolicy
from raymp.elastic.states import Running
from raymp.progress import StepProgress
from raymp.runtime.actor_group import ActorGroup
from raymp.runtime.rank_calls import WorkerLostError
from raymp.config.rules import compiles
from raymp.optim import warmup_note
from raymp.ray_connection import connect
from raymp.runtime.cluster import check_local_cpus, resolve_device
from raymp.timeline import run_timeline


class Trainer:
    def __init__(self, config: RunConfig | str | Path | dict, overrides: list[str] | None = None,
                 *, actor_group: ActorGroup | None = None, progress: bool = True,
                 data_position: DataPosition | dict | None = None, worker_cls: type | None = None):
        """`worker_cls` replaces the Worker class of the groups the trainer builds (fault tests
        inject failing storage this way and still get elastic restarts)."""
        self._config = as_config(config, overrides)
        self._shared_group, self._worker_cls, self._resume_position = actor_group, worker_cls, data_position
        self.progress_enabled, self._ready, self.history = progress, False, []
        # Built by setup(): the data feed, the current actors (session), the elastic controller.
        self.feed: DataFeed | None = None
        self.session: Session | None = None
        self.elastic: ElasticController | None = None
        self.run_name = self.config.tracking.run_name or _default_run_name(self.config)
        self.run_dir = storage.join(self.config.output_dir, self.run_name)  # a path or a URI (output_dir's)
        self.tracking: RunTracking | NoTracking = NoTracking()  # the MLflow hooks
        # on_event(name, info): ("placed", bundle nodes), ("step", steps done), on the training thread,
        # which waits for it: scripted faults (tests, local_cluster.py) happen at an exact point.
        self.on_event = None
        self._say = self._log
        self.health = NonFinitePolicy(self.config.train, self._warn)
        e = self.config.elastic
        self.stragglers = StragglerWatch(e.straggler_factor, e.straggler_steps, self._warn)
        self.last_pipeline_events, self._last_pipeline_step = None, None  # the last step's, for timeline()

    @property
    def config(self) -> RunConfig:
        """The run's config as launched now (dp after an elastic restart, the stage split decided)."""
        return self.session.config if self.session is not None else self._config

    @property
    def group(self) -> ActorGroup | None:
        return self.session.group if self.session is not None else None

    @property
    def checkpoints(self):
        return self.session.checkpoints if self.session is not None else None

    @property
    def failures(self) -> list[dict]:
        # Every lost rank, in order (while recovering too).
        return self.elastic.failures if self.elastic else []

    @property
    def restarts(self) -> list[dict]:
        # Every restart (failure, rewind, growing back) as its event.
        return self.elastic.restarts if self.elastic else []

    # -- set-up -------------------------------------------------------------------------------

    def setup(self) -> "Trainer":
        if self._ready:
            return self
        cfg, lay = self.config, self.config.parallel.layout
        check_destinations(cfg)
        # One CPU beyond the actors' for the Ray Data tasks that prepare and stream the data.
        check_local_cpus(cfg.resources.address, cfg.resources.cpus_per_actor)
        connect(cfg.resources.address, lay.world_size * cfg.resources.cpus_per_actor + 1)
        self.feed = DataFeed(cfg, self._log)
        check_vocab(cfg, self.feed)
        self.device = resolve_device(cfg.resources.device, lay.world_size, cfg.optimizer.cpu_offload)
        with removed_if_setup_fails(self.run_dir):
            self.lineage = open_lineage(cfg, self.run_dir, self._warn, self._resume_position)
            say = lambda *a: self._say(*a)  # noqa: E731 (fit() moves the printing to its progress bar)
            parts = RunParts(self.feed, self.lineage, self.device,
                             PeerCopies(cfg.elastic.peer_copy_every, cfg.resources, say), self._shared_group)
            launcher = Launcher(parts, say, warn=self._warn, worker_cls=self._worker_cls,
                                on_event=self._on_group_event)
            self.session = Session(cfg, parts, launcher, say, self.run_name,
                                   on_commit=lambda step: self.tracking.on_commit(step),
                                   mlflow_record=lambda: self.tracking.record())
            self.elastic = ElasticController(
                self.session, RankChanges(self.session),
                RecoveryPolicy(cfg.elastic, self._shared_group is not None),
                ScalingPolicy(lay, self.device, self.feed.node, cfg.elastic.grow_back), say)
            self.elastic.subscribe(self._on_elastic_state)
            self.resumed_from = resume = self.session.start(self._resume_position)
        if resume is not None:
            say_resume(resume, self.config, self._log)
        if note := warmup_note(cfg.optimizer, cfg.train.steps):
            self._log(note)
        self.num_params = num_params(self.config, self.data.vocab_size)
        storage.write_text(storage.join(self.run_dir, "config.yaml"),
                           yaml.safe_dump(resolved_dict(self.config), sort_keys=False))
        if cfg.tracking.enabled:
            self.tracking = RunTracking.start(
                self.config,
                self.run_name,
                self.session,
                self.device,
                self.num_params,
                resume,
                self.lineage.id,
                self.global_step,
                self.feed.params(),
            )
        self._ready = True
        return self

    def _on_group_event(self, name: str, info: dict) -> None:
        """The actor group's events ("placed"), passed on to the Trainer's on_event if set."""
        if self.on_event:
            self.on_event(name, info)

    def _log(self, *args) -> None:
        if self.progress_enabled:
            print(*args, flush=True)

    def _warn(self, text: str) -> None:
        """What a user must see whatever the progress setting (a state passed over for an older
        one): through the progress display when it is on, else on stderr."""
        if self.progress_enabled:
            self._say(text)
        else:
            print(text, file=sys.stderr, flush=True)

    @property
    def tracker(self):
        """The run's MLflow RunTracker (None with tracking.enabled=false)."""
        return self.tracking.tracker

    @property
    def data(self):
        return self.feed.data

    @property
    def order(self):
        return self.feed.order

    @property
    def global_step(self) -> int:
        """Optimizer steps done (including those before a restored data position)."""
        return self.session.global_step if self.session is not None else 0

    # -- the step loop ------------------------------------------------------------------------

    def step(self, _dispatch_ahead_until: int = 0) -> dict:
        """Run one optimizer step on every actor and return the aggregated metrics. A lost rank is
        recovered as the elastic policy decides, and the run's next step (after a restart from
        storage, an earlier one: see restarts) is taken then; a run that recovers from nothing
        raises WorkerLostError. (fit() passes its target: the next step may then be queued on the
        actors early, train.dispatch_ahead.)"""
        self.setup()
        while True:
            try:
                return self._step_once(_dispatch_ahead_until)
            except WorkerLostError as lost:
                self.elastic.recover(lost)
                if self.session.committed is not None:  # the failed step was taken: recorded, not redone
                    (step, reports, metrics), self.session.committed = self.session.committed, None
                    return self._record(step, reports, metrics, saves=False)

    def _step_once(self, _dispatch_ahead_until: int) -> dict:
        joining = self.elastic.join_if_room(now=not self.session.queued())  # lost replicas back, live
        t, step = self.config.train, self.global_step
        if step >= t.steps:
            raise RuntimeError(f"the run is complete: train.steps={t.steps} steps done")
        eval_due = self.feed.eval_due(step, t)
        ahead = (
            t.dispatch_ahead
            and step + 1 < _dispatch_ahead_until
            and not (eval_due or joining or self.on_event)
            and not (self.session.checkpoints.due(step + 1, t.steps) and self.elastic.grows_at_checkpoint())
        )
        reports, metrics = self.session.run_step(step, next_may_start=ahead)
        return self._record(step, reports, metrics)

    def _record(self, step: int, reports: list, metrics: dict, saves: bool = True) -> dict:
        """A step's results into the history, the health check, checkpoints and tracking.
        `saves`: false for a failed step its commit vote took (the controller abandoned the save
        in flight; one due after this step is not started, the next due one is)."""
        t = self.config.train
        metrics["restarts"] = len(self.restarts)
        if self.config.parallel.pp > 1:  # for timeline(), not in the history
            self.last_pipeline_events = stage_events(reports, self.config.parallel.layout)
            self._last_pipeline_step = step
        if self.feed.eval_due(step, t):
            metrics["val_loss"] = self.evaluate()
        self.history.append(metrics)
        if saves:
            self.session.collect_saves(reports, metrics)
        # Before a save starts: a run that stops saves nothing more.
        if self.health.after_step(metrics):  # train.on_nonfinite=restore
            self.elastic.rewind(step, f"step {step}: non-finite gradient norm {metrics['grad_norm']}")
            return metrics
        if saves:  # a step recorded for a lost rank has its peer's times: not a measurement of it
            self.stragglers.after_step([r.own_s for r in reports], self.config.parallel.layout, metrics,
                                       self._where, launch=len(self.restarts))
            if "straggler_rank" in metrics and self.config.elastic.replace_stragglers:
                self._replace_straggler(metrics["straggler_rank"])
        if saves and self.session.after_step(reports, self.global_step, metrics,
                                             self.elastic.grows_at_checkpoint):
            self.elastic.grow()  # from the checkpoint just committed
        self.tracking.on_step(metrics)
        return metrics

    def _replace_straggler(self, rank: int) -> None:
        why_not = self.elastic.replace_straggler(rank)
        self._warn(f"straggler: rank {rank} is not replaced: {why_not}" if why_not else
                   f"straggler: replacing rank {rank} (elastic.replace_stragglers): its process is stopped, "
                   "its peers go on and a new one joins in its place")

    def _where(self, rank: int) -> str:
        node = self.session.group.nodes[rank]
        return f" (node {node['node_ip']}, pid {node['pid']})"

    def fit(self, steps: int | None = None) -> list[dict]:
        """Train to `train.steps` (or `steps` more steps). Returns the per-step metrics."""
        self.setup()
        total = self.config.train.steps
        target = min(total if steps is None else self.global_step + steps, total)
        bar = StepProgress(total, self.config.train.log_every, self.progress_enabled)
        self._say = bar.print  # restarts inside a step (growing back) print through the bar
        bar.print(self.describe())
        status = "FAILED"
        try:
            while self.global_step < target:
                bar.update(self.step(_dispatch_ahead_until=target))
                if self.on_event is not None:
                    self.on_event("step", {"done": self.global_step})
            self.session.commit_in_flight()
            status = "FINISHED"
        except KeyboardInterrupt:
            status = "KILLED"
            self.session.commit_on_stop()
            raise
        finally:
            bar.close()
            if self.config.parallel.pp > 1 and self.history:
                paths = self.timeline(on_drawn=self.tracking.log_artifacts)
                bar.print(
                    f"pipeline timeline of the last step: {paths['png']} (Chrome trace: {paths['trace']})"
                )
            if status != "FINISHED" or self.global_step >= total:
                self.end_tracking(status)
        bar.print(self.summary())
        return self.history

    def end_tracking(self, status: str, complete: bool | None = None) -> None:
        """End the MLflow run (FINISHED, KILLED or FAILED) with what a resume and `raymp runs`
        read, then the loss curve. `complete` (default: all train.steps done) publishes the steps
        after the last checkpoint; an incomplete run drops them, as its resume redoes them."""
        latest = self.checkpoints.store.latest() if self.checkpoints else None
        done = self.global_step >= self.config.train.steps if complete is None else complete
        self.tracking.finish(status, self.history, self.run_name, latest, complete=done)

    # -- checkpoints --------------------------------------------------------------------------

    def save_checkpoint(self) -> Checkpoint:
        """Write a checkpoint of the state after the steps done so far, and wait until it is
        committed (fit() saves every checkpoint.every steps by itself). A save of this step already
        started (checkpoint.every) is committed and returned rather than written twice."""
        self.setup()
        self.session.commit_in_flight()
        latest = self.checkpoints.store.latest()
        if latest is not None and latest.step == self.global_step and self.lineage.owns(latest):
            return latest
        return self.session.save_now(self.global_step)

    def load_checkpoint(self, checkpoint: str | Checkpoint) -> None:
        """Continue from a committed checkpoint (saved under any layout): weights, optimizer
        state, LR schedule and data position."""
        self.setup()
        self.session.load(read_marker(checkpoint) if isinstance(checkpoint, str) else checkpoint, self._warn)
        self._drop_history_from(self.global_step)

    def _on_elastic_state(self, state) -> None:
        """After a restart (Running again, `after` it): the steps from the resumed one on will run
        again, so they leave the history and MLflow, which logs the restart."""
        if isinstance(state, Running) and state.after is not None:
            event = state.after
            self._drop_history_from(event["resumed_step"])
            self.tracking.on_restart(event, len(self.restarts), self.config.parallel.dp)

    def _drop_history_from(self, step: int) -> None:
        """The run goes on at `step` (a restart, a loaded checkpoint): the steps from it on will
        run again, so their records leave the history."""
        self.history = [m for m in self.history if m["step"] < step]

    # -- data and inspection ------------------------------------------------------------------

    def data_position(self) -> DataPosition:
        """Where the run is in its data (steps done, samples consumed, epoch, offset): saved
        with a checkpoint; restore_data_position() continues from it, with any layout."""
        self.setup()
        return self.session.position()

    def restore_data_position(self, position: DataPosition | dict) -> None:
        """Continue from a saved data position: the next step reads exactly what the step after
        the saved one would have read in an uninterrupted run."""
        self.setup()
        self.session.start_streams(position)

    def evaluate(self) -> float | None:
        """Mean loss on the held-out validation batches (None if train.eval_batches is 0)."""
        self.setup()
        return self.session.evaluate() if self.feed.eval_batches else None

    def layout(self) -> list[dict]:
        """Which actor holds what, where: rank, mesh coordinates, pipeline stages (stage index ->
        layer indices), node, pid, GPU ids."""
        self.setup()
        return self.session.layout_rows()

    def memory(self) -> list[dict]:
        """Per-rank model-state bytes (params, grads, optimizer) measured at the last step."""
        if not self.history:
            raise RuntimeError("no step has run yet; call step() or fit() first")
        return memory_rows(
            self.history[-1]["per_rank"], self.session.memory_estimate, self.config.parallel.layout
        )

    def state_dict(self) -> dict:
        """Full, unsharded model weights on the driver (CPU tensors), stages merged."""
        self.setup()
        return self.session.state_dict()

    def timeline(self, directory: str | Path | None = None, on_drawn=None) -> dict[str, str]:
        """Draw the last step's pipeline (dp replica 0) as timeline.png and timeline.json (Chrome trace) in
        `directory` (path or URI; default: the run directory); returns where. fit() logs them via `on_drawn`.
        """
        return run_timeline(self.last_pipeline_events, self._last_pipeline_step, self.config,
                            self.history, self.run_name, str(directory or self.run_dir), on_drawn)

    def describe(self) -> str:
        self.setup()
        return describe(
            self.run_name,
            self.config,
            self.num_params,
            self.data.manifest,
            self.device,
            self.group.backend,
            self.config.parallel.stage_layers,
            self.run_dir,
            self.lineage.store.root,
            self.session.memory_estimate,
        )

    def summary(self) -> str:
        return summary(
            self.history, self.feed, self.global_step, self.data.manifest, self.tracking,
            compiles(self.config, self.device)
        )

    # -- tear-down ----------------------------------------------------------------------------

    def close(self) -> None:
        try:
            if self._ready:
                self.session.commit_in_flight(best_effort=True)  # a lost rank: the save stays uncommitted
        finally:
            self.tracking.close(complete=self.global_step >= self.config.train.steps)
            if self.session is not None:
                self.session.teardown()
            self._ready = False

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _default_run_name(cfg: RunConfig) -> str:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{cfg.name}-{cfg.parallel.layout.tag()}-{stamp}-{uuid.uuid4().hex[:4]}"
