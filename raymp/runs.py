"""`raymp runs`: the runs of an experiment as a table, and two or more runs side by side, read
back through the MLflow client (the same store the UI shows: a sqlite file or a server URI)."""

from __future__ import annotations

import datetime as _dt

from raymp import metric_names as names
from raymp.config import ConfigError

COLUMNS = ("name", "run", "status", "layout", "steps", "loss", "val_loss", "tokens/s", "restarts", "started")
COMPARED_METRICS = (
    names.LOSS,
    names.VAL_LOSS,
    names.TOKENS_PER_S_MEDIAN,
    *(
        names.PER_STEP[k]
        for k in (
            "tokens_per_s",
            "step_time_s",
            "mfu",
            "model_tflops_per_device",
            "data_wait_fraction",
            "bubble_fraction",
        )
    ),
    names.PEAK_MEM,
    names.PER_STEP["restarts"],
)


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _experiment(client, name: str):
    exp = client.get_experiment_by_name(name)
    if exp is None:
        names = [e.name for e in client.search_experiments()]
        raise ConfigError(f"no experiment {name!r} in this store; it has: {', '.join(names) or 'none'} "
                          "(set tracking.experiment, or --experiment)")
    return exp


def list_runs(uri: str, experiment: str, limit: int = 50) -> list[dict]:
    """The newest `limit` runs of the experiment, one row each."""
    client = _client(uri)
    exp = _experiment(client, experiment)
    rows = []
    for run in client.search_runs(
        [exp.experiment_id], max_results=limit, order_by=["attributes.start_time DESC"]
    ):
        m, tags = run.data.metrics, run.data.tags
        steps = len({x.step for x in client.get_metric_history(run.info.run_id, names.LOSS)})
        rows.append(
            {
                "name": run.info.run_name,
                "run": run.info.run_id,
                "status": run.info.status,
                "layout": tags.get("raymp.layout", "?"),
                "steps": steps,
                "loss": m.get(names.LOSS),
                "val_loss": m.get(names.VAL_LOSS),
                "tokens/s": m.get(names.TOKENS_PER_S_MEDIAN, m.get(names.TOKENS_PER_S)),
                "restarts": int(tags.get("raymp.restarts", 0)),
                "started": _dt.datetime.fromtimestamp(run.info.start_time / 1000).strftime("%Y-%m-%d %H:%M"),
            }
        )
    return rows


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return str(value)


def format_rows(rows: list[dict], columns=COLUMNS) -> str:
    """A plain-text table (readable in job logs and terminals alike)."""
    cells = [[_cell(r.get(c)) if c != "run" else str(r[c])[:8] for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    line = lambda values: "  ".join(v.ljust(w) for v, w in zip(values, widths)).rstrip()  # noqa: E731
    return "\n".join([line(columns), line(["-" * w for w in widths])] + [line(row) for row in cells])


def _chosen(client, experiment: str, wanted: list[str]) -> list:
    """The runs named by id, id prefix or name, in the order given."""
    exp = _experiment(client, experiment)
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    chosen = []
    for key in wanted:
        match = [r for r in runs if r.info.run_id.startswith(key) or r.info.run_name == key]
        if len(match) != 1:
            raise ConfigError(f"{key!r} matches {len(match)} runs of {experiment!r}; give a run id "
                              "(or a longer prefix) from `raymp runs`")
        chosen.append(match[0])
    return chosen


def compare_runs(uri: str, experiment: str, wanted: list[str]) -> str:
    """Runs (by id, id prefix or name) side by side: the params that differ, then the last value
    of each key metric."""
    chosen = _chosen(_client(uri), experiment, wanted)
    names = [f"{r.info.run_name} ({r.info.run_id[:6]})" for r in chosen]
    keys = sorted({k for r in chosen for k in r.data.params})
    differing = [k for k in keys if len({r.data.params.get(k) for r in chosen}) > 1]
    rows = [{"": f"param {k}", **{n: r.data.params.get(k) for n, r in zip(names, chosen)}} for k in differing]
    rows += [{"": k, **{n: r.data.metrics.get(k) for n, r in zip(names, chosen)}}
             for k in COMPARED_METRICS if any(k in r.data.metrics for r in chosen)]
    rows += [{"": "tag raymp.layout", **{n: r.data.tags.get("raymp.layout") for n, r in zip(names, chosen)}}]
    return format_rows(rows, ["", *names])


# What a comparison is read for first, in this order, in one figure (the MLflow UI shows them in
# three sections of its chart view).
PLOTTED = ((names.LOSS, "training loss"), (names.TOKENS_PER_S, "tokens/s"),
           (names.PEAK_MEM, "peak memory (MiB, max over ranks)"))


def plot_comparison(uri: str, experiment: str, wanted: list[str], out: str) -> str:
    """Loss, throughput and peak memory by step of the chosen runs, one panel each, as a PNG at
    `out`. Returns its path."""
    from matplotlib.figure import Figure

    client = _client(uri)
    chosen = _chosen(client, experiment, wanted)
    fig = Figure(figsize=(5 * len(PLOTTED), 3.8))
    for ax, (key, label) in zip(fig.subplots(1, len(PLOTTED)), PLOTTED):
        for run in chosen:
            points = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
            if points:
                ax.plot(*zip(*points), label=f"{run.info.run_name} ({run.info.run_id[:6]})")
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    return out
