"""Elastic recovery and checkpoint cost, measured side by side on one simulated cluster.

    python benchmarks/recovery.py [--steps 30] [--models tiny small]

Recovery (dp=2 x pp=2, a checkpoint every 4 steps, one of two 3-CPU worker nodes removed after
step 10, elastic.wait_for_resources_s=0 so the run shrinks to dp=1 at once):
  detect         node removed -> the driver's WorkerLostError
  restart        teardown + re-plan + new actors + checkpoint load + streams (the driver's clock)
  to next step   node removed -> the first step completed after it
  redone         steps between the restored checkpoint and the failure, trained again

Checkpoint cost (dp=2 ZeRO-2, same actors for every row, rounds interleaved): mean time between
step completions from step 2 on (so a save's cost, and a background write slowing the steps
beside it, are both in), with no checkpoints, async every k steps, and blocking every k steps;
the ratio is against no checkpoints. "blocked" is the median time a save held the step loop;
the size is what one save writes (model + AdamW state). "in-run" prices the same cost inside
each run: the time the interval of the step before a save (its call carries the save when it can
ride) and the AFFECTED intervals after it took beyond the run's own median interval away from
saves: the loop's stall per save, and that spread over the k steps between saves. It needs no second run
to compare with, so it is free of the drift between runs (a few percent on this shared machine,
more than the cost being measured); what it cannot see is a cost spread evenly over every step.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time

from raymp.runtime.actor_group import ActorGroup
from raymp.runtime.simulated_cluster import SimulatedCluster
from raymp.trainer import Trainer

MODELS = {"tiny": dict(global_batch_size=16, seq_len=128), "small": dict(global_batch_size=16, seq_len=128)}


def config(root: str, model: str, steps: int, **sections) -> dict:
    cfg = {
        "name": f"bench-{model}", "seed": 3, "output_dir": f"{root}/runs",
        "model": {"preset": model},
        "parallel": {"dp": 2, "zero": 2, "micro_batch_size": 2},
        "train": {"steps": steps, "log_every": 1, "eval_batches": 0, **MODELS[model]},
        "optimizer": {"warmup_steps": 2},
        "data": {"source": "kjv", "tokenizer": "byte", "cache_dir": f"{root}/cache"},
        "resources": {"cpus_per_actor": 1.5},
        "tracking": {"enabled": False},
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def recovery(cluster, root: str, model: str, steps: int) -> dict:
    cfg = config(root, model, steps, parallel={"pp": 2, "schedule": "1f1b"},
                 checkpoint={"every": 4, "dir": f"{root}/ck-{model}"},
                 elastic={"wait_for_resources_s": 0})
    trainer = Trainer(cfg, progress=False)
    trainer.setup()
    thread = threading.Thread(target=trainer.fit, daemon=True)
    thread.start()
    while len(trainer.history) < 10:
        time.sleep(0.02)
    victim_id = trainer.group.nodes[-1]["node_id"]
    killed = time.time()
    cluster.remove(victim_id)
    thread.join()
    (event,) = trainer.restarts
    after = min(m["finished_at"] for m in trainer.history if m["finished_at"] > killed)
    steady = statistics.median(m["step_time_s"] for m in trainer.history[2:8])
    trainer.close()
    cluster.resize(2, 3)  # back to two worker nodes for the next run
    return {
        "model": model, "step_s": steady, "detect_s": event["detected_at"] - killed,
        "restart_s": event["restart_s"], "to_next_step_s": after - killed,
        "redone": event["failed_step"] - event["resumed_step"],
    }


AFFECTED = 3  # step intervals after a save's own that its background write and hand-over can slow


def in_run_cost(history: list[dict], every: int) -> dict:
    """A save's (or peer copy's) cost inside its own run, from the step completion times (see the
    module docstring): `stall_s`, the time per save the step loop lost; `fraction`, that spread
    over the steps between saves, as a share of the step time. Steps 0 and 1 (warm-up) are left out."""
    done = [m["finished_at"] for m in history]
    intervals = {i: done[i] - done[i - 1] for i in range(2, len(done))}
    saves = [s for s in range(len(done) - 1) if (s + 1) % every == 0]  # the save after step s
    # From step s's own interval (a save riding on the step's call is in it) to AFFECTED after.
    affected = {s + d for s in saves for d in range(AFFECTED + 1)} & set(intervals)
    baseline = statistics.median(v for i, v in intervals.items() if i not in affected)
    stall = sum(intervals[i] - baseline for i in affected) / len(saves)
    return {"stall_s": stall, "fraction": stall / (every * baseline)}


def checkpoint_cost(root: str, model: str, steps: int, every: int, rounds: int) -> list[dict]:
    group = ActorGroup(2, "cpu", cpus_per_actor=1.5, placement_timeout_s=120)
    modes = {"none": {"every": 0}, f"async every {every}": {"every": every, "async_save": True},
             f"async process every {every}": {"every": every, "async_save": "process"},
             f"blocking every {every}": {"every": every, "async_save": False},
             # elastic.peer_copy_every: no checkpoint on storage, each rank's part kept in the object store
             f"peer copy every {every}": {"every": 0, "peer_copy_every": every},
             f"peer copy every {4 * every}": {"every": 0, "peer_copy_every": 4 * every}}
    times = {name: [] for name in modes}
    blocked = {name: [] for name in modes}
    in_run = {name: [] for name in modes}
    size = 0
    try:
        for r in range(rounds):
            for name, ckpt in modes.items():
                directory = f"{root}/cost-{model}-{r}-{name.replace(' ', '-')}"
                ckpt = dict(ckpt)
                peer = {"peer_copy_every": ckpt.pop("peer_copy_every", 0)}
                cfg = config(
                    root, model, steps, checkpoint={**ckpt, "dir": directory, "keep_last": 1}, elastic=peer
                )
                with Trainer(cfg, actor_group=group, progress=False) as t:
                    h = t.fit()
                    blocked[name] += t.session.peer_copies.blocked_s
                times[name].append((h[-1]["finished_at"] - h[1]["finished_at"]) / (len(h) - 2))
                if k := ckpt["every"] or peer["peer_copy_every"]:
                    in_run[name].append(in_run_cost(h, k))
                blocked[name] += [m["checkpoint_blocked_s"] for m in h if "checkpoint_blocked_s" in m]
                if ckpt["every"] and os.path.isdir(directory):
                    latest = sorted(os.listdir(directory))[-1]
                    path = os.path.join(directory, latest)
                    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
                shutil.rmtree(directory, ignore_errors=True)
    finally:
        group.shutdown()
    base = statistics.median(times["none"])
    return [{"model": model, "mode": name, "step_s": statistics.median(v),
             "ratio": statistics.median(v) / base, "size_mb": size / 2**20 if name != "none" else 0.0,
             "blocked_s": statistics.median(blocked[name]) if blocked[name] else 0.0,
             "in_run": statistics.median(c["fraction"] for c in in_run[name]) if in_run[name] else None,
             "stall_s": statistics.median(c["stall_s"] for c in in_run[name]) if in_run[name] else None}
            for name, v in times.items()]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="raymp-bench-")
    cluster = SimulatedCluster(head_cpus=1)
    cluster.resize(2, 3)
    try:
        rec = [recovery(cluster, root, m, args.steps) for m in args.models]
        cost = [
            row for m in args.models for row in checkpoint_cost(root, m, args.steps, args.every, args.rounds)
        ]
    finally:
        cluster.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    print("\nRecovery from a lost node (dp=2 x pp=2 -> dp=1 x pp=2)")
    print("| model | step (s) | detect (s) | restart (s) | node lost -> next step (s) | steps redone |")
    print("|---|---|---|---|---|---|")
    for r in rec:
        print(f"| {r['model']} | {r['step_s']:.2f} | {r['detect_s']:.2f} | {r['restart_s']:.1f} | "
              f"{r['to_next_step_s']:.1f} | {r['redone']} |")
    print(f"\nCheckpoint cost (dp=2 ZeRO-2, {args.steps} steps, median of {args.rounds} interleaved rounds)")
    print("| model | checkpoints | time per step (s) | vs none | in-run | loop stall per save (s) | "
          "ranks blocked per save (s) | one checkpoint (MiB) |")
    print("|---|---|---|---|---|---|---|---|")
    for c in cost:
        stall = "-" if c["stall_s"] is None else f"{c['stall_s']:.3f}"
        extra = f"{c['blocked_s']:.3f} | {c['size_mb']:.1f}" if c["size_mb"] else "- | -"
        print(
            f"| {c['model']} | {c['mode']} | {c['step_s']:.3f} | {c['ratio']:.2f}x | {in_run_text(c)} | {stall} | {extra} |"
        )


def in_run_text(row: dict) -> str:
    return "-" if row["in_run"] is None else f"{100 * row['in_run']:+.1f}%"


if __name__ == "__main__":
    main()
