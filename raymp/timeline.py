"""One pipeline step as a picture: a row per pp rank, time across, each action a box.

Events come from the stages' clocks (raymp.parallel.pipeline.StepClock): (stage, kind, micro_batch,
start_s, end_s), kind F (forward, incl. loss), B (full backward), I (input grad), W (weight grad).
Written as a PNG (matplotlib) and as Chrome-trace JSON (chrome://tracing, ui.perfetto.dev).
"""

from __future__ import annotations

import json
from pathlib import Path

from raymp.storage import join, staged

COLORS = {"F": "#4c78a8", "B": "#54a24b", "I": "#9ecf8b", "W": "#f58518"}
NAMES = {"F": "forward", "B": "backward", "I": "backward (input)", "W": "backward (weights)"}


def chrome_trace(events_by_pp_rank: list[list], title: str) -> dict:
    """Trace Event Format: one thread per pp rank, complete ('X') events in microseconds."""
    trace = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": title}}]
    for rank, events in enumerate(events_by_pp_rank):
        trace.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": rank,
                      "args": {"name": f"pp rank {rank}"}})
        for stage, kind, mb, start, end in events:
            trace.append({
                "ph": "X", "pid": 0, "tid": rank, "name": f"{kind}{mb}", "cat": NAMES[kind],
                "ts": start * 1e6, "dur": (end - start) * 1e6,
                "args": {"stage": stage, "micro_batch": mb},
            })
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def render_png(events_by_pp_rank: list[list], path: str | Path, title: str) -> Path:
    # The Figure API, not pyplot: no backend to choose, and no change to the caller's (a
    # notebook's inline plots keep working after a timeline is drawn).
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    path = Path(path)
    rows = len(events_by_pp_rank)
    end = max((e[4] for events in events_by_pp_rank for e in events), default=1.0) * 1e3
    fig = Figure(figsize=(12, 0.7 * rows + 1.6))
    ax = fig.subplots()
    for rank, events in enumerate(events_by_pp_rank):
        y = rows - 1 - rank
        ax.broken_barh([(0, end)], (y - 0.4, 0.8), facecolors="#eeeeee")  # idle unless covered
        for stage, kind, mb, start, stop in events:
            x, w = start * 1e3, (stop - start) * 1e3
            ax.broken_barh([(x, w)], (y - 0.4, 0.8), facecolors=COLORS[kind], edgecolors="white",
                           linewidth=0.5)
            if w > end / 60:
                ax.text(x + w / 2, y, str(mb), ha="center",
                        va="center", fontsize=6, color="white")
    ax.set_yticks(range(rows), [f"pp rank {r}" for r in reversed(range(rows))])
    ax.set_xlim(0, end)
    ax.set_xlabel("time since step start (ms)")
    ax.set_title(title, fontsize=10)
    kinds = sorted({e[1] for events in events_by_pp_rank for e in events}, key="FBIW".index)
    handles = [Patch(color=COLORS[k], label=NAMES[k]) for k in kinds]
    handles.append(Patch(color="#eeeeee", label="idle (bubble)"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=len(handles),
              fontsize=8, frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def write_timeline(events_by_pp_rank: list[list], directory: str | Path, title: str) -> dict[str, Path]:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    png = render_png(events_by_pp_rank, directory / "timeline.png", title)
    trace = directory / "timeline.json"
    trace.write_text(json.dumps(chrome_trace(events_by_pp_rank, title)))
    return {"png": png, "trace": trace}


def run_timeline(events, step: int, cfg, history: list[dict], run_name: str, location: str,
                 on_drawn=None) -> dict[str, str]:
    """A run's last pipelined step drawn, titled with its schedule, micro-batches and bubble
    (measured, and in theory), into `location` (a path or a URI)."""
    if cfg.parallel.pp == 1:
        raise RuntimeError("timeline() needs a pipeline: parallel.pp is 1")
    if not events:
        raise RuntimeError("no step has run yet; call step() or fit() first")
    lay, metrics = cfg.parallel.layout, history[-1]
    theory = metrics["bubble_fraction_theory"]
    title = (
        f"{run_name}: step {step}, schedule {lay.schedule}, pp={lay.pp}, "
        f"{lay.micro_batches(cfg.train.global_batch_size)} micro-batches; bubble "
        f"{metrics['bubble_fraction']:.1%}"
        + (f" (theory {theory:.1%})" if theory is not None else "")
    )
    with staged(location) as local:
        drawn = write_timeline(events, local, title)
        if on_drawn is not None:
            on_drawn(list(drawn.values()))
    return {kind: join(location, path.name) for kind, path in drawn.items()}
