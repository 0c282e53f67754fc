"""What the single controller costs per step: the driver's wall time per step minus the slowest
rank's own compute time, with step-by-step dispatch and with the next step queued ahead
(`train.dispatch_ahead`), side by side in one run on the same actors.

    python -m benchmarks.run_all --only driver
"""

from __future__ import annotations

import tempfile

import ray

from benchmarks.common import median, run_config, spread, steady
from benchmarks.sections import _interleaved, _max_loss_gap, _raymp_fit


def _overheads(history: list[dict]) -> list[float]:
    """Per step: driver wall minus the slowest rank's compute (the time no rank was working on
    the step as far as the driver could tell)."""
    return [m["step_time_s"] - max(r["compute_s"] for r in m["per_rank"]) for m in history]


def measure(opts) -> dict:
    from raymp.runtime.actor_group import ActorGroup

    out = tempfile.mkdtemp(prefix="raymp-bench-driver-")
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    steps = max(30, 3 * opts.steps)
    group = ActorGroup(2, "cpu", cpus_per_actor=1)
    variants = {}
    for name, ahead in (("step by step", False), ("dispatch ahead (default)", True)):
        cfg = run_config(f"driver-{ahead}", out, preset="tiny", dp=2, zero=2, steps=steps, global_batch=16,
                         seq_len=128, cpus_per_actor=1, train={"dispatch_ahead": ahead})
        variants[name] = lambda cfg=cfg: _raymp_fit(cfg, group)
    runs = _interleaved(variants, opts.reps)
    group.shutdown()
    ray.shutdown()
    reference = runs["step by step"][0]["losses"]
    rows = []
    for name, rs in runs.items():
        wall = [median(steady(r["step_times"])) * 1e3 for r in rs]
        compute = [median(steady([max(p["compute_s"] for p in m["per_rank"]) for m in r["history"]])) * 1e3
                   for r in rs]
        over = [median(steady(_overheads(r["history"]))) * 1e3 for r in rs]
        rows.append(
            [
                name,
                f"{median(wall):.1f}",
                f"{median(compute):.1f}",
                f"{median(over):.2f}",
                spread(over),
                f"{max(_max_loss_gap(r['losses'], reference) for r in rs):.1e}",
            ]
        )
    return {
        "title": "7. Driver overhead per step: step-by-step dispatch vs dispatch ahead",
        "setup": (
            f"model `tiny`, dp=2 ZeRO-2, global batch 16 x 128 tokens, fp32, 2 CPU actors x 1 thread, "
            f"Python API (`Trainer.fit`), {steps} steps per run, median of steps 3..{steps}, {opts.reps} "
            "interleaved rounds on the same actors. Overhead = driver wall per step minus the slowest "
            "rank's compute in that step (the rank's own clock around `train_step`)."
        ),
        "columns": [
            "dispatch",
            "driver wall (ms)",
            "slowest rank compute (ms)",
            "overhead (ms)",
            "overhead per round (ms)",
            "max loss gap",
        ],
        "rows": rows,
        "raw": {
            name: {
                "step_times_s": [r["step_times"] for r in rs],
                "overheads_s": [_overheads(r["history"]) for r in rs],
                "losses": [r["losses"] for r in rs],
            }
            for name, rs in runs.items()
        },
        "notes": [
            "Step by step, the actors idle while the driver gathers the reports, aggregates the "
            "metrics and sends the next call; with dispatch ahead the next call is already queued on "
            "each actor, so what remains is Ray's return of the results."
        ],
    }
