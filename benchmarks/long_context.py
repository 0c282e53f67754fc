"""8. Long sequences: the longest seq_len that trains with cp=1 (one actor) vs cp=4 (context
parallel over 4 actors), every actor under the same memory cap.

The watchdog of benchmarks/scale.py (resident memory above the actor's start-up size; a
rank that passes it is stopped, the kernel's peak mark is checked after). One sequence per step
(global batch 1), the tiny model, so activations, which grow with the sequence, are what the cap
meets; context parallelism keeps 1/cp of them per rank. Sequence lengths double until one does
not train; cp=4 starts from the longest cp=1 managed."""

from __future__ import annotations

import tempfile

import ray

from benchmarks.common import run_config
from benchmarks.scale import capped_fit

LADDER = [1024, 2048, 4096, 8192, 16384, 32768]
MODEL = {"preset": "tiny", "max_seq_len": LADDER[-1]}


def _try(seq_len: int, cp: int, cap: int, steps: int, out: str) -> dict:
    cfg = run_config(f"long-cp{cp}", out, steps=steps, global_batch=1, seq_len=seq_len, micro_batch=1,
                     cpus_per_actor=1, model=MODEL, parallel={"cp": cp}, elastic={"enabled": False})
    return capped_fit(cfg, cp, cap, _activations)


def _activations(trainer, history) -> dict:
    """Saved activations of the largest rank, measured and as the planner estimated them."""
    saved = max(r["activation_peak_bytes"] + r["loss_saved_peak_bytes"] for r in history[-1]["per_rank"])
    return {
        "saved_bytes": saved,
        "estimate_bytes": max(e.activation_bytes for e in trainer.session.memory_estimate),
    }


def measure(opts) -> dict:
    cap = opts.long_cap_mib * 2**20
    ray.init(address="local", num_cpus=16, include_dashboard=False, log_to_driver=False)
    out = tempfile.mkdtemp(prefix="raymp-bench-long-")
    trials, longest, first = [], {}, 0
    for cp in (1, 4):
        for i in range(first, len(LADDER)):
            r = _try(LADDER[i], cp, cap, opts.scale_steps, out)
            trials.append({"cp": cp, "seq_len": LADDER[i], **r})
            if not r["trains"]:
                break
            longest[cp] = trials[-1]
            first = i  # cp=4 starts from the longest cp=1 trained: that one is checked again
    ray.shutdown()
    rows = [[str(t["cp"]), f"{t['seq_len']:,}", "yes" if t["trains"] else "no",
             f"{t['saved_bytes'] / 2**20:.0f}" if t["trains"] else "-",
             f"{t['estimate_bytes'] / 2**20:.0f}" if t["trains"] else "-",
             f"{t['peak_over_base'] / 2**20:.0f}" if t["trains"] else "-",
             f"{t['step_s']:.1f}" if t["trains"] else "-", t["why"] or ""] for t in trials]
    one, four = longest.get(1), longest.get(4)
    summary = (f"Longest that trains: {one['seq_len']:,} tokens with cp=1, {four['seq_len']:,} with cp=4 "
               f"({four['seq_len'] / one['seq_len']:.0f}x)." if one and four
               else "A ladder end was reached before a failure; see the rows.")
    return {
        "title": "8. Long sequences: longest seq_len, cp=1 vs cp=4, same per-actor memory cap",
        "setup": (
            f"Per-actor cap: {opts.long_cap_mib} MiB of resident memory above the actor's start-up size "
            "(the scale section's watchdog). The tiny model (4 layers, dim 64), fp32, one sequence per step, "
            f"byte vocabulary, {opts.scale_steps} steps; cp=4: Ulysses all-to-all attention over 4 actors. "
            "Every try on fresh actors. " + summary
        ),
        "columns": [
            "cp",
            "seq_len",
            "trains",
            "saved activations per rank (MiB)",
            "planner's estimate (MiB)",
            "peak new memory (MiB)",
            "step (s)",
            "why not",
        ],
        "rows": rows,
        "raw": {"trials": trials, "cap_bytes": cap},
        "notes": [
            "Saved activations are what autograd keeps for backward (raymp's ActivationMeter), the largest "
            "rank's; the planner's estimate is its per-rank activation figure for the same layout.",
            "What cp does not divide: each rank's copy of the model and optimizer state (cp ranks hold the "
            "same parameters; ZeRO over dp x cp shards them when dp or zero is set), the attention all-to-all's "
            "buffers, and the process's fixed costs.",
        ],
    }
