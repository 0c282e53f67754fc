"""The sweep's MLflow parent run: the search (space, metric, scheduler) as params, and at the end
the best trial (its params, value and run), a table of every trial and the metric drawn against
each searched field. The trials are its child runs (tracking.parent_run_id)."""

from __future__ import annotations

import json
import math

from raymp.config import RunConfig
from raymp.sweeps.spec import SweepSpec
from raymp.tracking import RunTracker


class ParentRun:
    def __init__(self, spec: SweepSpec, base: RunConfig):
        self.spec = spec
        tags = {"raymp.sweep": "parent", "raymp.layout": base.parallel.layout.tag()}
        self.tracker = RunTracker(base, spec.name, tags)
        self.run_id = self.tracker.run_id
        self.tracker.log_params({"sweep.metric": spec.metric, "sweep.mode": spec.mode,
                                 "sweep.samples": spec.samples, "sweep.trials": spec.trials(),
                                 "sweep.asha": json.dumps(spec.asha.model_dump() if spec.asha else None),
                                 **{f"sweep.space.{f}": json.dumps(how) for f, how in spec.space.items()}})

    def finish(self, result) -> None:
        tracker = self.tracker
        tracker.log_text(result.table() + "\n", "trials.txt")
        if (best := result.best) is not None:
            tracker.set_tags({"raymp.best_trial": best.trial_id, "raymp.best_run_id": best.run_id,
                              **{f"raymp.best.{f}": str(v) for f, v in best.params.items()}})
            tracker.log_metrics(0, {f"best/{result.metric}": best.value}, final=True)
        tracker.log_figure(self._figure(result), "metric_by_field.png")
        failed = all(t.status == "failed" for t in result.trials)
        tracker.finish("FAILED" if failed else "FINISHED", complete=True)

    def stopped(self) -> None:
        """The sweep was stopped (Ctrl-C, SIGTERM): its trials still running and the sweep itself
        end KILLED, with why, rather than stay RUNNING in MLflow."""
        client = self.tracker.client
        query = f"tags.mlflow.parentRunId = '{self.run_id}' and attributes.status = 'RUNNING'"
        running = client.search_runs([self.tracker.experiment_id], query)
        for run in running:
            client.set_tag(run.info.run_id, "raymp.trial_stop", "the sweep was stopped (Ctrl-C or SIGTERM)")
            client.set_terminated(run.info.run_id, "KILLED")
        self.tracker.finish("KILLED", complete=True)

    def _figure(self, result):
        """The metric at each trial's last step against each searched field (log axis for a
        loguniform field); the best trial marked."""
        from matplotlib.figure import Figure
        from matplotlib.ticker import NullFormatter

        fields = list(self.spec.space)
        fig = Figure(figsize=(4 * len(fields), 3.5))
        scored = [t for t in result.trials if t.value is not None and not math.isnan(t.value)]
        for i, f in enumerate(fields):
            ax = fig.add_subplot(1, len(fields), i + 1)
            numeric = all(isinstance(t.params.get(f), (int, float)) for t in scored)
            x = (lambda t: t.params.get(f)) if numeric else _labeller(f, [t.params.get(f) for t in scored])
            # A trial stopped early is drawn hollow: its last step is earlier than the others'.
            hollow = {"facecolors": "none", "edgecolors": "C0"}
            for status, style in (("completed", {}), ("stopped early", hollow)):
                group = [t for t in scored if t.status == status]
                if group:
                    ax.scatter([x(t) for t in group], [t.value for t in group], label=status, **style)
            if result.best is not None:
                ax.scatter([x(result.best)], [result.best.value], marker="*", s=200, color="C1", label="best")
            ax.legend(fontsize=8)
            if "loguniform" in self.spec.space[f]:
                ax.set_xscale("log")
                ax.xaxis.set_minor_formatter(NullFormatter())  # 2x10^-3, 3x10^-3, ... overlapped
            ax.set_xlabel(f)
            ax.set_ylabel(result.metric)
        fig.suptitle(f"{result.name}: {result.metric} at each trial's last step", fontsize=10)
        fig.tight_layout()
        return fig


def _labeller(field: str, values: list):
    """A short axis label per trial for a field that is not a number. A section's value (a whole
    `parallel:` of a layout search) is named by the keys in which the trials differ."""
    sections = [v for v in values if isinstance(v, dict)]
    varying = sorted({k for v in sections for k in v if any(w.get(k) != v.get(k) for w in sections)})

    def label(trial) -> str:
        value = trial.params.get(field)
        if isinstance(value, dict):
            return " ".join(f"{k}={value.get(k)}" for k in varying) or "same"
        return str(value)

    return label
