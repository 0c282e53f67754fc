"""Pipeline bubble and activation memory, measured: p=4 stages, m in {4, 8, 16, 32} micro-batches,
GPipe vs 1F1B, on CPU actors (one thread each), one shared actor group.

    python benchmarks/pipeline_bubble.py [--steps 3] [--preset small] [--seq-len 128]

Bubble: idle time over (stages x makespan) of one step, from the stages' own clocks (the median of
the steps after the first, which includes one-off shape inference). Theory: (p-1)/(m+p-1).
Activation memory: peak bytes autograd holds for backward on each stage (saved-tensor hooks),
the quantity GPipe (all m micro-batches in flight) and 1F1B (at most p - stage) differ in.
On a machine with fewer cores than stages the actors share cores, which stretches busy phases
and shifts the measured bubble; the table reports cores so the reader can judge.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import ray

from raymp.config import config_from_dict
from raymp.parallel.pipeline import theoretical_bubble
from raymp.runtime.actor_group import ActorGroup
from raymp.trainer import Trainer

PP = 4
MICRO_BATCHES = (4, 8, 16, 32)
SCHEDULES = ("gpipe", "1f1b")


def measure_bubble(group, schedule: str, m: int, pp: int, preset: str, seq_len: int, steps: int,
                   out_dir: str) -> dict:
    """One p-stage run of `schedule` with m micro-batches of 1 on `group` (pp actors)."""
    cfg = config_from_dict({
        "name": f"bubble-{schedule}-m{m}",
        "output_dir": out_dir,
        "model": {"preset": preset},
        "parallel": {"dp": 1, "pp": pp, "schedule": schedule, "micro_batch_size": 1},
        "train": {"steps": steps, "global_batch_size": m, "seq_len": seq_len},
        "optimizer": {"warmup_steps": 0},
        "data": {"source": "kjv", "tokenizer": "byte"},
        "tracking": {"enabled": False},
    })
    with Trainer(cfg, actor_group=group, progress=False) as trainer:
        history = trainer.fit()
    steady = history[1:] or history
    by_stage = sorted(history[-1]["per_rank"], key=lambda r: r["rank"])
    return {
        "bubble": statistics.median(h["bubble_fraction"] for h in steady),
        "bubbles": [h["bubble_fraction"] for h in steady],
        "theory": theoretical_bubble(schedule, pp, m, 2 if schedule == "interleaved" else 1),
        "step_s": statistics.median(h["step_time_s"] for h in steady),
        "act_mib": [r["activation_peak_bytes"] / 2**20 for r in by_stage],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()

    ray.init(
        address="local", num_cpus=max(PP, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False
    )
    group = ActorGroup(PP, "cpu", cpus_per_actor=1, placement_timeout_s=120, collective_timeout_s=300)
    results = {}
    with tempfile.TemporaryDirectory() as out_dir:
        for m in MICRO_BATCHES:
            for schedule in SCHEDULES:
                results[schedule, m] = measure_bubble(group, schedule, m, PP, args.preset, args.seq_len,
                                                         args.steps, out_dir)
    group.shutdown()

    print(f"\nPipeline bubble, p={PP} stages, model {args.preset}, seq_len {args.seq_len}, micro-batch 1, "
          f"{os.cpu_count()} cores, {PP} CPU actors x 1 thread, median of steps 2..{args.steps}\n")
    print(f"{'m':>4} | {'theory':>7} | {'GPipe':>7} | {'1F1B':>7} | {'GPipe step':>10} | {'1F1B step':>9}")
    print("-" * 61)
    for m in MICRO_BATCHES:
        g, f = results["gpipe", m], results["1f1b", m]
        print(f"{m:>4} | {g['theory']:>7.1%} | {g['bubble']:>7.1%} | {f['bubble']:>7.1%} | "
              f"{g['step_s'] * 1e3:>8.0f}ms | {f['step_s'] * 1e3:>7.0f}ms")
    print("\nPeak activation memory per stage (MiB), GPipe vs 1F1B\n")
    header = " | ".join(f"stage {s}: GPipe / 1F1B" for s in range(PP))
    print(f"{'m':>4} | {header}")
    print("-" * (7 + len(header)))
    for m in MICRO_BATCHES:
        g, f = results["gpipe", m], results["1f1b", m]
        cells = " | ".join(
            f"{g['act_mib'][s]:>10.1f} / {f['act_mib'][s]:>5.1f}".ljust(len("stage 0: GPipe / 1F1B"))
            for s in range(PP)
        )
        print(f"{m:>4} | {cells}")


if __name__ == "__main__":
    main()
