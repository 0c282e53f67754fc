"""Tracking as a callback: what the driver tells MLflow at the run's start, after each step, at
a commit, at a restart and at the end. The driver calls these hooks; the MLflow calls themselves
are raymp.tracking's."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import ray
import torch
import yaml

from raymp.config import ConfigError, RunConfig, resolved_dict
from raymp import metric_names as names
from raymp.driver.summary import steady_median
from raymp.layout import Layout
from raymp.tracking import RunTracker
from raymp.version import __version__


class RunTracking:
    """The run's MLflow run: a new one, or the one a resumed checkpoint (or
    tracking.resume_run_id) names, which goes on with a resume event."""

    def __init__(self, cfg: RunConfig, run_name: str, tags: dict[str, str], resume, lineage_id: str,
                 step: int, params: dict, plan: dict):
        # checkpoint.resume=auto continues this run, so its MLflow run goes on; a checkpoint named
        # by path may be another run's (a warm start), which gets a run of its own.
        record = (resume.meta.get("lineage") or {}) if resume is not None else {}
        continuing = resume is not None and (
            record["id"] == lineage_id if record.get("id") else cfg.checkpoint.resume == "auto")
        previous = (resume.meta.get("mlflow") or {}) if continuing else {}
        run_id = cfg.tracking.resume_run_id or previous.get("run_id")
        # A step can be redone when the run checkpoints (a restart or resume goes back to the
        # last checkpoint) or restarts (without a checkpoint, from the start): held until final.
        self.tracker = tracker = RunTracker(cfg, run_name, tags, resume_run_id=run_id,
                                            provisional=cfg.checkpoint.every > 0 or cfg.elastic.enabled)
        if cfg.tracking.resume_run_id and not tracker.resumed:
            raise ConfigError(f"tracking.resume_run_id {run_id!r} is not a run of experiment "
                              f"{cfg.tracking.experiment!r} in {tracker.uri}; check the id (raymp runs)")
        if tracker.resumed:
            # Numbered by the run's events: a run resumed twice keeps both records.
            tracker.log_event(
                f"resume-{tracker.events + 1}",
                {
                    "step": step,
                    "checkpoint": resume.path if resume else None,
                    "layout": cfg.parallel.layout.record(),
                },
                step,
            )
        else:
            tracker.log_text(yaml.safe_dump(resolved_dict(cfg), sort_keys=False), "config.yaml")
            tracker.log_params(params)
            if resume is not None:
                tracker.set_tags({"raymp.resumed_from": resume.path})
        tracker.log_text(json.dumps(plan, indent=1, default=str), "layout.json")

    @classmethod
    def start(
        cls,
        cfg: RunConfig,
        run_name: str,
        session,
        device: str,
        num_params: int,
        resume,
        lineage_id: str,
        step: int,
        data_params: dict,
    ) -> "RunTracking":
        """The tracking of a run whose actors were just launched (their layout goes in layout.json)."""
        plan = {
            "layout": session.layout_rows(),
            "memory_estimate": [vars(e) for e in session.memory_estimate],
            "stage_layers": cfg.parallel.stage_layers,
        }
        tags = run_tags(cfg, device, session.group.backend, num_params)
        return cls(cfg, run_name, tags, resume, lineage_id, step, data_params, plan)

    @property
    def run_id(self) -> str:
        return self.tracker.run_id

    def record(self) -> dict:
        """The MLflow run as a checkpoint records it (a resume continues it)."""
        return {"run_id": self.tracker.run_id, "tracking_uri": self.tracker.uri}

    @property
    def uri(self) -> str:
        return self.tracker.uri

    def on_step(self, metrics: dict) -> None:
        logged = {name: metrics[k] for k, name in names.PER_STEP.items() if metrics.get(k) is not None}
        logged[names.PEAK_MEM] = metrics["peak_mem_bytes_max"] / 2**20
        # Measured on this step, not carried from an earlier one:
        if metrics["memory_step"] == metrics["step"]:
            logged[names.MEASURED_MEM] = metrics["memory_measured_bytes_max"] / 2**20
            logged[names.ESTIMATED_MEM] = metrics["memory_estimate_bytes_max"] / 2**20
        for r in metrics["per_rank"]:
            logged[names.rank_peak_mem(r["rank"])] = r["peak_mem_bytes"] / 2**20
        self.tracker.log_metrics(metrics["step"], logged)

    def on_commit(self, step: int) -> None:
        """A commit makes the steps before it final: their metrics go to MLflow."""
        self.tracker.publish_steps_before(step)

    def on_restart(self, event: dict, restarts_here: int, dp: int) -> None:
        """Redone steps leave the MLflow record, and the event is logged, numbered after the
        restarts of earlier drivers of the same run."""
        tracker = self.tracker
        tracker.drop_steps_from(event["resumed_step"])
        number = tracker.previous_restarts + restarts_here
        tracker.log_event(f"restart-{number}", event, event["resumed_step"])
        tracker.set_tags({"raymp.layout": Layout.from_record(event["layout_after"]).tag(),
                          "raymp.dp": str(dp), "raymp.restarts": str(number)})
        tracker.log_metrics(event["resumed_step"], {names.RESTART_NUMBER: number, names.ELASTIC_DP: dp,
                                                    names.RESTART_S: event["restart_s"]}, final=True)

    def log_artifacts(self, paths) -> None:
        for path in paths:
            self.tracker.log_artifact(path)

    def finish(self, status: str, history: list[dict], run_name: str, latest, complete: bool) -> None:
        """What a resume and `raymp runs` read (the last checkpoint, the throughput), then the
        run's end status, and only then the loss curve: a stopped run may be killed soon after
        (`ray job stop` sends SIGKILL RAY_JOB_STOP_WAIT_TIME_S after SIGTERM, 3 s by default), and
        drawing the figure costs seconds of CPU on a busy machine (CI once found the run still
        RUNNING after the job had stopped)."""
        try:
            if history:
                self.tracker.log_metrics(history[-1]["step"], {
                    names.TOKENS_PER_S_MEDIAN: steady_median(history, "tokens_per_s")}, final=True)
            if latest is not None:
                self.tracker.set_tags(
                    {"raymp.checkpoint": latest.path, "raymp.checkpoint_step": str(latest.step)}
                )
        finally:
            # No checkpoint to resume from: a later run starts over in a run of its own, so the
            # held steps are never redone here.
            self.tracker.finish(status, complete=complete or latest is None)  # flushes the metrics first
        if history:
            self.tracker.log_figure(loss_figure(history, run_name), "loss_curve.png")

    def close(self, complete: bool) -> None:
        self.tracker.finish("FINISHED", complete=complete)


def run_tags(cfg: RunConfig, device: str, backend: str, num_params: int) -> dict[str, str]:
    lay = cfg.parallel.layout
    return {
        "raymp.layout": lay.tag(),
        "raymp.dp": str(lay.dp), "raymp.cp": str(lay.cp), "raymp.pp": str(lay.pp), "raymp.tp": str(lay.tp),
        "raymp.zero": str(lay.zero), "raymp.world_size": str(lay.world_size),
        "raymp.schedule": lay.schedule if lay.pp > 1 else "none",
        "raymp.device": device, "raymp.backend": backend, "raymp.num_params": str(num_params),
        "raymp.version": __version__, "torch.version": torch.__version__,
        "ray.version": ray.__version__, "ray.address": ray.get_runtime_context().gcs_address,
        **({"git.commit": commit} if (commit := git_commit()) else {}),
        **({"mlflow.parentRunId": cfg.tracking.parent_run_id} if cfg.tracking.parent_run_id else {}),
    }


def loss_figure(history: list[dict], title: str):
    """Training (and validation) loss by step; the Figure API, so no global pyplot state."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    ax.plot([m["step"] for m in history], [m["loss"] for m in history], label="train loss")
    val = [(m["step"], m["val_loss"]) for m in history if m.get("val_loss") is not None]
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    return fig


def git_commit() -> str | None:
    """The commit of the code being run, when it runs from a git checkout (a job's working dir)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


class NoTracking:
    """The hooks with tracking.enabled=false: every one a no-op, so the driver never asks."""

    tracker = run_id = uri = None

    def record(self) -> None: ...

    def on_step(self, metrics: dict) -> None: ...
    def on_commit(self, step: int) -> None: ...
    def on_restart(self, event: dict, restarts_here: int, dp: int) -> None: ...
    def log_artifacts(self, paths) -> None: ...
    def finish(self, status: str, history: list[dict], run_name: str, latest, complete: bool) -> None: ...
    def close(self, complete: bool) -> None: ...
