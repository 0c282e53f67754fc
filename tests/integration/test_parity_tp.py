"""Tensor parallelism (with and without sequence parallelism) alone and in every combination
with data parallel + ZeRO and pipelines, up to dp=2 x pp=2 x tp=2 on 8 actors, must be the
single-process run: same seed, global batch and data order, 5 fp32 steps."""

from __future__ import annotations

import pytest

from raymp.trainer import Trainer
from helpers.parity import check_parity as check_parity_with


def layout(tiny_cfg, dp=1, pp=1, tp=2, zero=0, **parallel):
    return tiny_cfg(
        parallel={"dp": dp, "pp": pp, "tp": tp, "zero": zero, "micro_batch_size": 2, **parallel},
        train={"steps": 5, "global_batch_size": 8 * dp, "seq_len": 32, "log_every": 1},
    )


# TP splits each matmul's reduction (row-parallel sums partial products), so fp32 rounding
# differs from one process; Adam's normalised update turns a near-zero gradient's rounding into
# up to ~4e-5 on a rare weight (seen: 1 of 16384) over 5 steps.
TP_WEIGHT_ATOL = 1e-4


def check_parity(cfg, group):
    return check_parity_with(cfg, group, weight_atol=TP_WEIGHT_ATOL)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_tp2_matches_single_process(sequence_parallel, group2, tiny_cfg):
    check_parity(layout(tiny_cfg, sequence_parallel=sequence_parallel), group2)


@pytest.mark.parametrize("zero", [0, 3])
def test_dp2_tp2_matches_single_process(zero, group4, tiny_cfg):
    check_parity(layout(tiny_cfg, dp=2, zero=zero, sequence_parallel=True), group4)


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_pp2_tp2_matches_single_process(schedule, group4, tiny_cfg):
    check_parity(layout(tiny_cfg, pp=2, schedule=schedule, micro_batch_size=1), group4)


@pytest.mark.parametrize("zero,sequence_parallel", [(2, False), (3, True)])
def test_dp2_pp2_tp2_on_8_actors_matches_single_process(zero, sequence_parallel, group8, tiny_cfg):
    cfg = layout(tiny_cfg, dp=2, pp=2, zero=zero, sequence_parallel=sequence_parallel, micro_batch_size=1)
    history = check_parity(cfg, group8)
    assert {r["rank"] for r in history[-1]["per_rank"]} == set(range(8))


def test_logits_are_never_whole_on_one_tp_rank(group2, tiny_cfg):
    """Vocabulary 4096, micro-batch 2 x 32 tokens: full fp32 logits are 1 MiB. Under tp=2 each
    rank holds half, and what the loss keeps for backward stays below the full logits."""
    def run(tp):
        cfg = tiny_cfg(model={"preset": "tiny", "max_seq_len": 64, "vocab_size": 4096},
                       parallel={"dp": 2 // tp, "tp": tp, "micro_batch_size": 2},
                       train={"steps": 1, "global_batch_size": 4, "seq_len": 32})
        with Trainer(cfg, actor_group=group2, progress=False) as t:
            return t.step()["per_rank"]

    full = 2 * 32 * 4096 * 4
    single = run(1)
    sharded = run(2)
    # Without TP, each rank materialises the full logits, and the loss keeps at least that much.
    assert all(r["logits_bytes"] == full and r["loss_saved_peak_bytes"] >= full for r in single)
    for r in sharded:
        assert r["logits_bytes"] == full // 2
        assert r["loss_saved_peak_bytes"] <= 0.6 * full, r["loss_saved_peak_bytes"]


def test_tp2_parameter_bytes_are_half_the_sharded_weights_plus_the_replicated(group2, tiny_cfg):
    cfg = layout(tiny_cfg)
    with Trainer(cfg, actor_group=group2, progress=False) as t:
        t.step()
        memory = t.memory()
        m = t.config.model
    vocab = 256
    norms = (2 * m.n_layers + 1) * m.dim  # RMSNorm weights: replicated on every TP rank
    sharded = t.num_params - norms  # every linear and the (tied) embedding/head
    expected = 4 * (sharded / 2 + norms)
    for r in memory:
        assert abs(r["param_bytes"] - expected) <= 0.05 * expected, (r, expected)
    assert vocab * m.dim < sharded
