"""Context parallelism (parallel.cp, Ulysses all-to-all attention) alone and with data parallel +
ZeRO, pipelines and tensor parallelism must be the single-process run: same seed, global batch
and data order, 5 fp32 steps; with and without document masking."""

from __future__ import annotations

import pytest

from raymp.trainer import Trainer
from helpers.parity import check_parity

# Attention over the whole sequence is computed for a share of the heads, and the per-token ops
# on a slice of it: the same sums as one process, regrouped; Adam can turn the rounding of a
# near-zero gradient into a few 1e-5 on a rare weight over 5 steps.
CP_WEIGHT_ATOL = 1e-4


def layout(tiny_cfg, cp=2, dp=1, pp=1, tp=1, zero=0, document_mask=False, **parallel):
    return tiny_cfg(
        parallel={"dp": dp, "cp": cp, "pp": pp, "tp": tp, "zero": zero, "micro_batch_size": 2, **parallel},
        train={"steps": 5, "global_batch_size": 8 * dp, "seq_len": 32, "log_every": 1},
        data={"document_mask": document_mask},
    )


@pytest.mark.parametrize("document_mask, checkpointing", [(False, False), (True, True)],
                         ids=["causal", "documents-ac"])
def test_cp2_matches_single_process(document_mask, checkpointing, group2, tiny_cfg):
    """With activation checkpointing the all-to-alls run again in backward's recomputation."""
    cfg = layout(tiny_cfg, document_mask=document_mask, activation_checkpointing=checkpointing)
    check_parity(cfg, group2, weight_atol=CP_WEIGHT_ATOL)


@pytest.mark.parametrize("zero", [1, 3])
def test_dp2_cp2_matches_single_process(zero, group4, tiny_cfg):
    check_parity(layout(tiny_cfg, dp=2, zero=zero), group4, weight_atol=CP_WEIGHT_ATOL)


@pytest.mark.parametrize("schedule, document_mask", [("1f1b", False), ("zbv", True)],
                         ids=["1f1b", "zbv-documents"])
def test_pp2_cp2_matches_single_process(schedule, document_mask, group4, tiny_cfg):
    """Zero-bubble schedules split backward in two: the all-to-all's gradient is in the first half."""
    cfg = layout(tiny_cfg, pp=2, schedule=schedule, document_mask=document_mask, micro_batch_size=1)
    check_parity(cfg, group4, weight_atol=CP_WEIGHT_ATOL)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_tp2_cp2_matches_single_process(sequence_parallel, group4, tiny_cfg):
    cfg = layout(tiny_cfg, tp=2, sequence_parallel=sequence_parallel)
    check_parity(cfg, group4, weight_atol=CP_WEIGHT_ATOL)


def test_dp2_cp2_pp2_zero2_matches_single_process(group8, tiny_cfg):
    """Three of the four dimensions at 2 on 8 actors, cp among them (all four would take 16)."""
    check_parity(layout(tiny_cfg, dp=2, pp=2, zero=2, schedule="gpipe"), group8, weight_atol=CP_WEIGHT_ATOL)


def test_cp2_pp2_tp2_matches_single_process(group8, tiny_cfg):
    check_parity(layout(tiny_cfg, pp=2, tp=2, sequence_parallel=True, schedule="1f1b"),
                 group8, weight_atol=CP_WEIGHT_ATOL)


def test_cp2_halves_saved_activations_and_the_planner_follows(group2, tiny_cfg):
    """At a long sequence, a cp=2 rank keeps about half of what a rank with whole sequences keeps
    (both run one sequence per micro-batch), and the planner's estimate is within 15% of it."""
    measured, estimated = {}, {}
    for cp, dp in ((1, 2), (2, 1)):
        cfg = tiny_cfg(model={"preset": "tiny", "max_seq_len": 1024},
                       parallel={"dp": dp, "cp": cp, "micro_batch_size": 1},
                       train={"steps": 1, "global_batch_size": 2, "seq_len": 1024})
        with Trainer(cfg, actor_group=group2, progress=False) as t:
            t.step()
            measured[cp] = max(
                r["activation_peak_bytes"] + r["loss_saved_peak_bytes"] for r in t.history[-1]["per_rank"]
            )
            estimated[cp] = max(e.activation_bytes for e in t.session.memory_estimate)
    seen = (
        f"saved activations per rank, seq_len 1024: cp=1 {measured[1] / 2**20:.1f} MiB (planner "
        f"{estimated[1] / 2**20:.1f}), cp=2 {measured[2] / 2**20:.1f} MiB (planner {estimated[2] / 2**20:.1f})"
    )
    assert 0.4 <= measured[2] / measured[1] <= 0.6, seen
    for cp in (1, 2):
        assert abs(estimated[cp] - measured[cp]) <= 0.15 * measured[cp], seen
