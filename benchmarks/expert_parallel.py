"""13. Expert parallelism on CPU actors: tiny-moe and small-moe at dp 4 with the experts on every
rank (ep 1), split over 2 ranks (ep 2) and over 4 (ep 4), in interleaved rounds: tokens/s, the
share of the step the slowest rank spent in its all-to-alls (raymp's own `moe_all_to_all_s`),
the load imbalance, and the loss against ep 1 (the same training: every step's routing equal).

    python -m benchmarks.run_all --only ep --update
"""

from __future__ import annotations

import statistics
import tempfile

import ray

from benchmarks.common import run_config, spread, steady, window

MODELS = ("tiny-moe", "small-moe")
DEGREES = (1, 2, 4)
DP = 4


def _fit(cfg: dict, group) -> dict:
    from raymp.config import config_from_dict
    from raymp.trainer import Trainer

    with Trainer(config_from_dict(cfg), actor_group=group, progress=False) as trainer:
        history = trainer.fit()
    return {"step_times": [m["step_time_s"] for m in history], "losses": [m["loss"] for m in history],
            "all_to_all": [m.get("moe_all_to_all_s", 0.0) for m in history],
            "imbalance": [m["moe_imbalance_max"] for m in history]}


def measure(opts) -> dict:
    from raymp.runtime.actor_group import ActorGroup

    # one CPU beyond the actors: the data streams' Ray Data tasks
    ray.init(address="local", num_cpus=DP + 1, include_dashboard=False, log_to_driver=False)
    group = ActorGroup(DP, "cpu", cpus_per_actor=1)
    out = tempfile.mkdtemp(prefix="raymp-bench-ep-")
    steps = opts.steps + 2  # two warm-up steps outside the timed window
    rows, raw = [], {}
    for preset in MODELS:
        runs: dict[int, list] = {ep: [] for ep in DEGREES}
        for _ in range(opts.reps):  # interleaved rounds: drift lands on every degree alike
            for ep in DEGREES:
                cfg = run_config(f"{preset}-ep{ep}", out, preset=preset, steps=steps, global_batch=16,
                                 seq_len=128, dp=DP, micro_batch=2, cpus_per_actor=1)
                cfg["parallel"]["ep"] = ep
                runs[ep].append(_fit(cfg, group))
        mean = {ep: statistics.median(window(r["step_times"])["mean"] for r in rs) for ep, rs in runs.items()}
        for ep, rs in runs.items():
            last = rs[-1]
            share = statistics.median(
                statistics.fmean(steady(r["all_to_all"])) / window(r["step_times"])["mean"] for r in rs
            )
            gap = max(abs(a - b) / abs(b) for a, b in zip(last["losses"], runs[1][-1]["losses"]))
            rows.append([preset, f"ep {ep}", f"{16 * 128 / mean[ep]:,.0f}", f"{mean[ep] / mean[1]:.2f}x",
                         "-" if ep == 1 else f"{share:.1%}",
                         f"{last['imbalance'][0]:.2f} -> {last['imbalance'][-1]:.2f}",
                         f"{last['losses'][-1]:.4f}", f"{gap:.1e}"])
            raw[f"{preset} ep{ep}"] = {"runs": rs,
                                       "step_mean_s": spread(window(r["step_times"])["mean"] for r in rs)}
    group.shutdown()
    ray.shutdown()
    return {
        "title": "13. Expert parallelism: ep 1 vs 2 vs 4 on CPU actors",
        "setup": (
            f"dp {DP} on {DP} CPU actors of 1 CPU each, ZeRO-0, global batch 16 x 128 byte tokens (2 "
            f"sequences per micro-batch), fp32, {opts.steps} timed steps after 2 warm-up ones, {opts.reps} "
            "interleaved rounds (median of the rounds' mean step). ep 1: every rank holds all experts; "
            "ep 2 / 4: each block's experts split over 2 / 4 ranks, routed tokens sent to them by "
            "all-to-all. All-to-all share: the slowest rank's seconds in its all-to-alls (forward and "
            "backward, `moe_all_to_all_s`) over the mean step. Imbalance: the worst block's busiest "
            "expert over the mean at the first and last step. Loss gap: against ep 1, largest relative "
            "difference over the steps."
        ),
        "columns": ["model", "experts", "tok/s", "step vs ep 1", "all-to-all share", "imbalance (max/mean)",
                    "final loss", "loss gap vs ep 1"],
        "rows": rows,
        "raw": raw,
        "notes": [
            "Expert parallelism is for memory (each rank holds 1/ep of the experts' state); what it does to "
            "the step on CPU actors is the table's: every rank still runs the whole dense part, the "
            "exchange is gloo over loopback TCP, and a collapsed router (tiny scale, docs/design.md) sends most rows to one rank's "
            "experts, which then runs most of the expert work while the others wait in the all-to-all.",
        ],
    }
