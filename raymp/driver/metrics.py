"""One step's metrics from its ranks' reports: loss, throughput, data wait, memory measured and
estimated, FLOPs and MFU, and for pipelines the bubble measured from the stages' clocks."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from raymp.config import RunConfig
from raymp.layout import Layout
from raymp.models.moe import imbalance
from raymp.parallel.pipeline import bubble_stats, theoretical_bubble
from raymp.runtime.commit_vote import StepRecord
from raymp.runtime.report import RankReport


def step_metrics(step: int, reports: list[RankReport], layout: Layout, cfg: RunConfig, step_time: float,
                 flops: float, peak_tflops: float | None, estimate_bytes: float) -> dict:
    """The step's metrics (the run's history entry); `flops` are the model FLOPs of one step."""
    t = cfg.train
    readers = [reports[r] for r in layout.ranks_where(pp=0)]
    data_wait = max(r.data_wait_s for r in readers)
    losses = [r.loss for r in reports if r.loss is not None]  # last stages only
    achieved = flops / step_time / layout.world_size / 1e12
    metrics = {
        "step": step,
        "finished_at": time.time(),
        "dp": layout.dp,
        "loss": sum(losses) / len(losses),
        "grad_norm": reports[0].grad_norm,
        "lr": reports[0].lr,
        "step_time_s": step_time,
        "tokens_per_s": t.global_batch_size * t.seq_len / step_time,
        "data_wait_s": data_wait,
        "data_wait_fraction": data_wait / step_time,
        # The global batch as the replicas read it (tp rank 0 of each), in replica order.
        "sample_ids": np.concatenate(
            [reports[layout.rank_of(dp=d, pp=0, tp=0)].sample_ids for d in range(layout.dp)]
        ),
        "peak_mem_bytes_max": max(r.peak_mem_bytes for r in reports),
        "memory_measured_bytes_max": max(r.measured_bytes for r in reports),
        "memory_step": reports[0].memory_step,  # the step those bytes were measured on (train.memory_every)
        "memory_estimate_bytes_max": estimate_bytes,
        "model_tflops_per_device": achieved,
        "mfu": achieved / peak_tflops if peak_tflops else None,
    }
    if layout.pp > 1:
        metrics.update(pipeline_metrics(reports, layout, t.global_batch_size))
    metrics.update(moe_metrics(reports, layout))
    metrics["per_rank"] = [r.public() for r in reports]
    return metrics


def with_stand_ins(reports: dict[int, RankReport], record: StepRecord, layout: Layout) -> list[RankReport]:
    """Every rank's report of a step its commit vote took, from those that came back (rank ->
    report): a lost rank's is a copy of a peer's that holds the same part of the model (its
    pp, tp and cp; another replica), with the loss and samples the vote gathered from the lost
    rank itself, marked stand_in (its times and memory are the peer's)."""
    def part(rank: int) -> tuple:
        c = layout.coords(rank)
        return c["pp"], c["tp"], c["cp"]

    out = []
    for rank in range(layout.world_size):
        if rank in reports:
            out.append(reports[rank])
            continue
        peer = next(reports[r] for r in sorted(reports) if part(r) == part(rank))
        out.append(replace(peer, rank=rank, loss=record.losses[rank], sample_ids=record.sample_ids[rank],
                           checkpoint=None, save_started=None, stand_in=True))
    return out


def moe_metrics(reports: list[RankReport], layout: Layout) -> dict:
    """MoE models: the global batch's routing of every block (from the stage that holds it; its
    replicas summed the counts already), the balance loss summed over blocks, and the load
    imbalance (busiest expert over the mean) of the worst block; under expert parallelism the
    most seconds a rank spent in its all-to-alls. Routing is dropless: no token is ever dropped."""
    routing = {}
    for stage in range(layout.pp):
        routing.update(reports[layout.rank_of(dp=0, pp=stage, tp=0)].routing)
    if not routing:
        return {}
    by_block = {name: imbalance(r["tokens_per_expert"]) for name, r in routing.items()}
    out = {"routing": routing, "moe_aux_loss": sum(r["aux_loss"] for r in routing.values()),
           "moe_imbalance": by_block, "moe_imbalance_max": max(by_block.values()), "moe_dropped_tokens": 0}
    exchanges = [r.expert_exchange_s for r in reports if r.expert_exchange_s is not None]
    if exchanges:  # expert parallelism: the rank that spent longest in its all-to-alls
        out["moe_all_to_all_s"] = max(exchanges)
    return out


def stage_events(reports: list[RankReport], layout: Layout, dp: int = 0) -> list[list]:
    """The stage clocks' events of one pipeline replica, stage by stage (what timeline() draws)."""
    return [reports[layout.rank_of(dp=dp, pp=s, tp=0)].pipeline_events for s in range(layout.pp)]


def pipeline_metrics(reports: list[RankReport], layout: Layout, global_batch: int) -> dict:
    """Bubble per replica from the stages' clocks (averaged over replicas), next to theory."""
    stats = [bubble_stats(stage_events(reports, layout, d)) for d in range(layout.dp)]
    return {
        "bubble_fraction": sum(s["bubble_fraction"] for s in stats) / len(stats),
        "bubble_fraction_theory": theoretical_bubble(
            layout.schedule, layout.pp, layout.micro_batches(global_batch), layout.stages_per_rank
        ),
        "stage_busy_s": stats[0]["busy_s"],
        "stage_idle_s": stats[0]["idle_s"],
        "activation_peak_bytes_max": max(r.activation_peak_bytes for r in reports),
    }


def peak_tflops(cfg: RunConfig, device: str) -> float | None:
    """The device's dense peak for MFU: the configured one, or the cluster's on GPUs."""
    peak = cfg.tracking.peak_tflops_per_device
    if peak is None and device == "cuda" and cfg.cluster is not None:
        peak = cfg.cluster.gpu_tflops
    return peak
