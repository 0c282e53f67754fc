"""MLflow from the driver only, in batches: one run per training run, never one per rank.

Per-call logging costs 4-11 ms on sqlite and 55-85 ms over HTTP (docs/design.md), so metrics are
buffered and written with log_batch every `flush_every` steps.

Each step appears once. MLflow cannot delete a logged point, and an elastic restart redoes the
steps after the checkpoint it resumes from (from the start without one). So, when the run
checkpoints or is elastic, a step's metrics are held back (provisional) until a checkpoint at or
after it commits, or the run ends; a restart drops the provisional steps it will redo. The MLflow
view lags the progress bar by up to checkpoint.every steps for it (an elastic run without
checkpoints: to its end). Only a run with neither logs at once.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from raymp.config import RunConfig, flatten, resolved_dict
from raymp.logs import MLFLOW_DB_SETUP, MLFLOW_SYSTEM_METRICS, quiet_loggers
from raymp.storage import local_artifact_root
from raymp.tracking_store import tracking_uri

# MLflow limits per log_batch call.
_MAX_METRICS, _MAX_PARAMS = 1000, 100


def artifact_location(uri: str, output_dir: str) -> str | None:
    """Where a new experiment keeps its artifacts. A server (http, https, databricks) and a
    file store have their own root (None). A database has none, and MLflow would then write to
    ./mlruns of whatever directory the driver started in: a sqlite database's artifacts go
    beside it, another database's under output_dir."""
    scheme = uri.split(":", 1)[0].split("+", 1)[0].lower() if ":" in uri else "file"
    if scheme in ("http", "https", "databricks", "file"):
        return None
    if scheme == "sqlite":
        path = uri.split(":///", 1)[1] if ":///" in uri else ""  # sqlite:////abs or sqlite:///relative
        if path and path != ":memory:":
            return (Path(path).resolve().parent / "mlartifacts").as_uri()
    return local_artifact_root(output_dir)


class RunTracker:
    """One MLflow run. With `resume_run_id` (a checkpoint's run), that run goes on: a job
    resumed from a checkpoint adds to the same curves instead of starting a second run."""

    def __init__(self, cfg: RunConfig, run_name: str, tags: dict[str, str], resume_run_id: str | None = None,
                 provisional: bool = False):
        from mlflow.tracking import MlflowClient

        self.uri = tracking_uri(cfg)
        if cfg.tracking.tracking_uri is None:
            Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)  # the embedded store's directory
        with quiet_loggers(*MLFLOW_DB_SETUP, level=logging.WARNING):  # creating a new database
            self.client = MlflowClient(tracking_uri=self.uri)
            exp = self.client.get_experiment_by_name(cfg.tracking.experiment)
        if exp is not None:
            self.experiment_id = exp.experiment_id
        else:
            location = artifact_location(self.uri, cfg.output_dir)
            self.experiment_id = self.client.create_experiment(
                cfg.tracking.experiment, artifact_location=location
            )
        self.flush_every = cfg.tracking.flush_every
        self._buffer: list = []
        self.provisional = provisional
        self._held: dict[int, list] = {}  # step -> metrics not final yet (see the module's docstring)
        self.time_in_mlflow_s = 0.0
        self.finished = False
        self._events = 0
        self.resumed = resume_run_id is not None and self._resumable(resume_run_id)
        self.previous_restarts = 0  # restarts of earlier drivers of this run (events numbered on)
        if self.resumed:
            self.run_id = resume_run_id
            before = self.client.get_run(resume_run_id).data.tags
            self.previous_restarts = int(before.get("raymp.restarts", 0))
            self._events = int(before.get("raymp.events", 0))
            self.client.update_run(resume_run_id, status="RUNNING")
            self.set_tags(tags)  # params are immutable in MLflow; the layout now is in the tags
        else:
            run = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags)
            self.run_id = run.info.run_id
            self.log_params(flatten(resolved_dict(cfg)))
        self._system = None
        if cfg.tracking.system_metrics:
            # MLflow's own psutil sampler (system/cpu_utilization_percentage, memory, network,
            # GPU when present), on the driver's machine, in a thread of its own.
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            for name in MLFLOW_SYSTEM_METRICS:  # its thread logs too: quiet for the process, not a block
                logging.getLogger(name).setLevel(logging.WARNING)
            self._system = SystemMetricsMonitor(
                self.run_id, sampling_interval=cfg.tracking.system_metrics_interval_s,
                resume_logging=self.resumed, tracking_uri=self.uri)
            self._system.start()

    def _resumable(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_run(run_id).info.experiment_id == self.experiment_id
        except MlflowException:  # another store, or the run was deleted
            return False

    def _timed(self, fn, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.time_in_mlflow_s += time.perf_counter() - t0

    def log_params(self, params: dict) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in sorted(params.items())]
        for i in range(0, len(items), _MAX_PARAMS):
            self._timed(self.client.log_batch, self.run_id, params=items[i : i + _MAX_PARAMS])

    def log_metrics(self, step: int, metrics: dict[str, float], final: bool = False) -> None:
        """A step's metrics; held back until publish_steps_before() passes the step when the
        run checkpoints (provisional), unless `final` (an event's metrics, never redone)."""
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        points = [Metric(k, float(v), ts, step) for k, v in metrics.items() if v is not None]
        if self.provisional and not final:
            self._held.setdefault(step, []).extend(points)
            return
        self._buffer += points
        if step % self.flush_every == 0:
            self.flush()

    def publish_steps_before(self, step: int) -> None:
        """Steps before `step` can no longer be redone (a checkpoint of `step` committed)."""
        for s in sorted(k for k in self._held if k < step):
            self._buffer += self._held.pop(s)
        self.flush()

    def drop_steps_from(self, step: int) -> None:
        """A restart redoes the steps from `step` on: their held metrics are superseded."""
        for s in [k for k in self._held if k >= step]:
            del self._held[s]

    def flush(self) -> None:
        while self._buffer:
            chunk, self._buffer = self._buffer[:_MAX_METRICS], self._buffer[_MAX_METRICS:]
            self._timed(self.client.log_batch, self.run_id, metrics=chunk)

    def log_text(self, text: str, artifact_file: str) -> None:
        self._timed(self.client.log_text, self.run_id, text, artifact_file)

    def log_figure(self, figure, artifact_file: str) -> None:
        self._timed(self.client.log_figure, self.run_id, figure, artifact_file)

    def log_artifact(self, path) -> None:
        self._timed(self.client.log_artifact, self.run_id, str(path))

    def set_tag(self, key: str, value: str) -> None:
        self._timed(self.client.set_tag, self.run_id, key, value)

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self._timed(self.client.log_batch, self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    @property
    def events(self) -> int:
        """Events logged to this run so far, by every driver it had."""
        return self._events

    def log_event(self, name: str, event: dict, step: int) -> None:
        """An event of the run (a restart, a resume) as events/<name>.json, and counted in the
        `events` tag so the runs table shows which runs had any."""
        self.flush()
        self.log_text(json.dumps({"step": step, **event}, indent=1, default=str), f"events/{name}.json")
        self._events += 1
        self.set_tag("raymp.events", str(self._events))

    def finish(self, status: str = "FINISHED", complete: bool = False) -> None:
        """End the run once (FINISHED, FAILED or KILLED); later calls do nothing. A `complete`
        run publishes its held steps; otherwise they are dropped, as a resume redoes them."""
        if self.finished:
            return
        if self._system is not None:
            self._system.finish()
        if complete:
            self.publish_steps_before(2**62)
        self.flush()
        self._timed(self.client.set_terminated, self.run_id, status)
        self.finished = True
