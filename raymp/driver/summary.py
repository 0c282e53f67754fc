"""What the driver prints about a run: the one-line description at the start, the summary at
the end, and the per-rank memory table (measured beside the planner's estimate)."""

from __future__ import annotations

from raymp.config import RunConfig
from raymp.layout import Layout
from raymp.planner import peer_copy_bytes
from raymp.runtime.report import RankReport

MEMORY_KEYS = ("rank", "param_bytes", "grad_bytes", "optim_bytes", "activation_peak_bytes",
               "loss_saved_peak_bytes", "peak_mem_bytes")


def describe(run_name: str, cfg: RunConfig, num_params: int, manifest: dict, device: str, backend: str,
             stage_layers: list[list[int]] | None, run_dir: str, checkpoint_dir: str, estimates: list) -> str:
    """The run's first lines. `estimates`: the planner's RankEstimate per pipeline stage."""
    lay, t = cfg.parallel.layout, cfg.train
    pipeline = ""
    if lay.pp > 1:
        pipeline = (
            f"; pipeline {lay.schedule}, {lay.num_stages} stages, layers {[len(s) for s in stage_layers]}"
        )
    copies = ""
    if every := cfg.elastic.peer_copy_every:
        copies = (
            f"\npeer copies every {every} steps (elastic.peer_copy_every): up to "
            f"{max(peer_copy_bytes(e) for e in estimates) / 2**20:,.1f} MiB of Ray's object store per rank"
        )
    return (
        f"raymp run {run_name}: {num_params / 1e6:.2f}M params, data {manifest['source']!r} "
        f"({manifest['samples']:,} samples, {manifest['tokenizer']} tokens), "
        f"{lay.text()}{' (sequence parallel)' if lay.sequence_parallel else ''} on "
        f"{lay.world_size} {device} actor(s) ({backend}); global batch {t.global_batch_size} x "
        f"{t.seq_len} tokens = {lay.micro_batches(t.global_batch_size)} micro-batch(es) of "
        f"{lay.micro_batch_size} per replica; precision {cfg.precision}{pipeline}\nkept in "
        f"{run_dir} (config.yaml), checkpoints in {checkpoint_dir}, prepared data in "
        f"{cfg.data.cache_dir}{copies}"
    )


def steady_median(history: list[dict], key: str) -> float:
    """The median of `key` over the second half of the steps, the run's steady state: the first
    steps include warm-up (allocator, data streams starting), and a last step's value is noise."""
    tail = history[len(history) // 2:] or history
    return sorted(m[key] for m in tail)[len(tail) // 2]


def summary(history: list[dict], feed, steps_done: int, manifest: dict, tracking,
            compiled: bool = False) -> str:
    """The end-of-run lines: losses, throughput, data position, compile cost, memory, MLflow run.
    `feed`: the run's data feed (held-out batches, the position after `steps_done` steps)."""
    if not history:
        return "no steps run"
    h = history
    eval_batches, position = feed.eval_batches, feed.position(steps_done)
    tps = steady_median(h, "tokens_per_s")
    last = h[-1]
    lines = [f"done: {len(h)} steps, loss {h[0]['loss']:.4f} -> {last['loss']:.4f}, median {tps:,.0f} "
             f"tokens/s, peak memory {last['peak_mem_bytes_max'] / 2**20:.0f} MiB/rank"]
    vals = [m["val_loss"] for m in h if m.get("val_loss") is not None]
    lines.append(
        (f"validation loss {vals[-1]:.4f} on {eval_batches} held-out batch(es); " if vals else "")
        + f"data: {manifest['tokens']:,} tokens, epoch {position.epoch} offset {position.offset}; "
        f"median data wait {steady_median(h, 'data_wait_fraction'):.1%} of step time")
    if compiled and len(h) > 1:
        steady = steady_median(h, "step_time_s")
        lines.append(
            f"train.compile: the first step took {h[0]['step_time_s']:.1f} s (compiling the blocks), "
            f"about {max(0.0, h[0]['step_time_s'] - steady):.1f} s more than a steady step ({steady:.3f} s)"
        )
    lines.append(
        f"model state + activations per rank: measured {last['memory_measured_bytes_max'] / 2**20:.1f} MiB, "
        f"planner estimate {last['memory_estimate_bytes_max'] / 2**20:.1f} MiB (max over ranks)")
    if tracking.run_id is not None:
        lines.append(f"MLflow run {tracking.run_id} in {tracking.uri} "
                     f"(view: mlflow ui --backend-store-uri {tracking.uri})")
    return "\n".join(lines)


def memory_rows(per_rank: list[dict], estimates: list, layout: Layout) -> list[dict]:
    """Per rank: model-state bytes and activations measured at a step, beside the planner's
    estimate of this rank's pipeline stage."""
    rows = []
    for r in per_rank:
        e = estimates[layout.coords(r["rank"])["pp"]]
        rows.append({
            **{k: r.get(k, 0) for k in MEMORY_KEYS},
            "measured_bytes": RankReport(**r).measured_bytes,
            "estimated_bytes": e.measured_part_bytes,
            "estimated_transient_bytes": e.buffer_bytes,
        })
    return rows
