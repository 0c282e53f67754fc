"""Mixture-of-experts layouts are numerically the single-process run: the same losses (1e-5
relative over 5 fp32 steps), the same weights and router biases, and at every step the same
routing (tokens each expert got in every block) and the same balance loss."""

from __future__ import annotations

import pytest
import torch

from raymp.config import config_from_dict
from raymp.models import model_args
from raymp.models.moe import MoEArgs
from raymp.planner import estimate
from raymp.reference import train_single_process
from raymp.trainer import Trainer
from helpers.parity import LOSS_RTOL, assert_losses_match, assert_weights_match, run_parallel


def moe_cfg(tiny_cfg, **parallel):
    # A balance loss strong enough to move the router in 5 steps, and a bias rate that changes
    # which expert wins within them.
    return tiny_cfg(model={"preset": "tiny-moe", "max_seq_len": 64,
                           "moe": {"aux_loss_coef": 0.1, "bias_update_rate": 0.01}},
                    parallel={"micro_batch_size": 2, **parallel})


def check_moe_parity(cfg, group, weight_atol=2e-5):
    losses, history, state = run_parallel(cfg, group)
    routing = []
    ref_losses, ref_state = train_single_process(config_from_dict(cfg), routing=routing)
    assert_losses_match(losses, ref_losses, LOSS_RTOL)
    assert_weights_match(state, ref_state, atol=weight_atol)  # the router biases (buffers) included
    assert any(name.endswith("expert_bias") for name in ref_state)
    for step, (metrics, ref) in enumerate(zip(history, routing)):
        assert set(metrics["routing"]) == set(ref)
        for block, r in ref.items():
            got = metrics["routing"][block]
            assert got["tokens_per_expert"] == r["tokens_per_expert"], f"step {step} {block}"
            assert got["aux_loss"] == pytest.approx(r["aux_loss"], rel=1e-5), f"step {step} {block}"
        assert metrics["moe_dropped_tokens"] == 0
        assert metrics["moe_imbalance_max"] >= 1.0
    assert losses[-1] < losses[0]
    return history


@pytest.mark.parametrize("zero", [1, 3])
def test_moe_dp2_matches_single_process(zero, group2, tiny_cfg):
    check_moe_parity(moe_cfg(tiny_cfg, dp=2, zero=zero), group2)


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_moe_pp2_matches_single_process(schedule, group2, tiny_cfg):
    check_moe_parity(moe_cfg(tiny_cfg, dp=1, pp=2, schedule=schedule), group2)


def test_moe_dp2_pp2_zero3_with_checkpointing_matches(group4, tiny_cfg):
    check_moe_parity(moe_cfg(tiny_cfg, dp=2, pp=2, zero=3, activation_checkpointing=True), group4)


@pytest.mark.parametrize("dp,zero,ac", [(2, 0, False), (4, 0, False), (2, 1, False), (2, 3, False), (4, 2, False),
                                       (2, 0, True)])
def test_moe_expert_parallel_matches_single_process(dp, zero, ac, group2, group4, tiny_cfg):
    """ep 2: each rank holds half of every block's experts, tokens sent to them by all-to-all;
    at dp 4 two pairs of ranks each split the experts, and each expert's gradient averages over
    the two ranks that hold it. Under ZeRO-1 the dense parameters' optimizer state is sharded
    over dp, the experts' is not (ExpertsApartOptimizer). With activation checkpointing every
    rank recomputes its blocks, all-to-alls included, in the same order in backward. Weights
    within 5e-5 (measured 2.0e-5 and 2.3e-5; dp 2 without ep: 0.9e-5): an expert's GEMM now
    sums the tokens of every rank of its group at once, in another order than one process's
    micro-batch by micro-batch, and lr 1e-2 Adam carries that rounding into a few weights. Losses (within 6e-8) and every step's routing are held as tightly as for
    every other layout."""
    cfg = moe_cfg(tiny_cfg, dp=dp, ep=2, zero=zero, micro_batch_size=1, activation_checkpointing=ac)
    history = check_moe_parity(cfg, group2 if dp == 2 else group4, weight_atol=5e-5)
    assert all(m["moe_all_to_all_s"] > 0 for m in history)  # gloo blocks: the host times it


@pytest.mark.parametrize("schedule,zero", [("1f1b", 0), ("zbv", 0), ("1f1b", 1)])
def test_moe_expert_parallel_pipeline_matches_single_process(schedule, zero, group4, tiny_cfg):
    """ep 2 x pp 2: the two ranks of each stage split its blocks' experts; both run the stage's
    micro-batches in the schedule's order, so their all-to-alls pair up (zero bubble: in the
    backward of the inputs). Under ZeRO-1 each stage's dense state is sharded beside its experts'."""
    check_moe_parity(moe_cfg(tiny_cfg, dp=2, ep=2, pp=2, schedule=schedule, zero=zero, micro_batch_size=1),
                     group4, weight_atol=5e-5)


@pytest.mark.parametrize("ep", [1, 2])
def test_moe_hsdp_matches_single_process(ep, group4, tiny_cfg):
    """dp 4 as 2 replicas x 2 shards: the routing counts are summed over both mesh dimensions.
    With ep 2 each group's two ranks split the experts, and the groups replicate them."""
    history = check_moe_parity(moe_cfg(tiny_cfg, dp=4, dp_replicate=2, ep=ep, zero=3, micro_batch_size=1),
                               group4, weight_atol=5e-5 if ep > 1 else 2e-5)
    assert all((m.get("moe_all_to_all_s", 0) > 0) == (ep > 1) for m in history)


def test_moe_eight_actor_hsdp_expert_parallel_layout_matches(group8, tiny_cfg):
    """dp 8 as 2 HSDP groups of 4 with ep 2, ZeRO-2: each group's experts split over ep 2 and each
    shard sharded again over the group's two ranks that hold it, replicated over the groups."""
    history = check_moe_parity(moe_cfg(tiny_cfg, dp=8, dp_replicate=2, ep=2, zero=2, micro_batch_size=1),
                               group8, weight_atol=5e-5)
    assert all(m["moe_all_to_all_s"] > 0 for m in history)


@pytest.mark.parametrize("sp", [False, True])
def test_moe_tensor_parallel_matches_single_process(sp, group2, tiny_cfg):
    """tp 2 (+SP): attention split over the two ranks, each MoE feed-forward run whole on both
    (under SP on the gathered sequence, its output sliced back), so the routing is one process's.
    Weights within 1e-4, as for dense TP (tests/integration/test_parity_tp.py: the row-parallel
    sums round differently; measured 2.2e-5 on 1 expert weight of 32768)."""
    check_moe_parity(moe_cfg(tiny_cfg, dp=1, tp=2, sequence_parallel=sp), group2, weight_atol=1e-4)


def test_moe_pipeline_and_tensor_parallel_matches_single_process(group4, tiny_cfg):
    """pp 2 x tp 2 + SP (1F1B): each stage's attention split over its tp pair, its MoE blocks run
    whole on both."""
    cfg = moe_cfg(tiny_cfg, dp=1, pp=2, tp=2, sequence_parallel=True, schedule="1f1b", micro_batch_size=1)
    check_moe_parity(cfg, group4, weight_atol=1e-4)


@pytest.mark.parametrize("zero", [0, 3])
def test_moe_expert_and_tensor_parallel_matches_single_process(zero, group4, tiny_cfg):
    """dp 2 x ep 2 x tp 2 + SP: the two replicas split every block's experts (an all-to-all per
    tp rank, each carrying the whole sequence), attention split over tp."""
    cfg = moe_cfg(tiny_cfg, dp=2, ep=2, tp=2, sequence_parallel=True, zero=zero, micro_batch_size=1)
    history = check_moe_parity(cfg, group4, weight_atol=1e-4)
    assert all(m["moe_all_to_all_s"] > 0 for m in history)


@pytest.mark.parametrize("parallel", [dict(dp=2, ep=2, zero=3), dict(dp=1, pp=2, schedule="1f1b"),
                                      dict(dp=1, tp=2)])
def test_compiled_moe_blocks_match_eager_single_process(parallel, group2, tiny_cfg):
    """train.compile with MoE: each block's attention and norms (and a dense block whole) compiled,
    the routed feed-forward eager; the losses, weights and every step's routing as eager's.
    2e-4 on the weights, as for compiled dense blocks (tests/integration/test_compile.py)."""
    cfg = moe_cfg(tiny_cfg, micro_batch_size=1, **parallel)
    cfg["train"]["compile"] = True
    check_moe_parity(cfg, group2, weight_atol=2e-4)


@pytest.mark.parametrize("parallel", [dict(dp=1, cp=2), dict(dp=2, cp=2, zero=3), dict(dp=2, cp=2, ep=2),
                                      dict(dp=2, cp=2, ep=2, zero=3)])
def test_moe_context_parallel_matches_single_process(parallel, group2, group4, tiny_cfg):
    """cp with MoE, balanced by the router bias alone (aux_loss_coef 0: the sequence-wise loss needs
    whole sequences, refused under cp): each rank routes its slice of every sequence, and the
    tokens per expert, summed over dp x cp, move the bias as one process's do. Under ep the two dp
    replicas at each cp rank split the experts, whose gradients average over both cp ranks too.
    Weights to 1e-4, as for dense cp (tests/integration/test_parity_cp.py: attention's sums
    regrouped by head)."""
    cfg = moe_cfg(tiny_cfg, micro_batch_size=1, **parallel)
    cfg["model"]["moe"]["aux_loss_coef"] = 0.0
    check_moe_parity(cfg, group2 if parallel["dp"] == 1 else group4, weight_atol=1e-4)


def test_moe_eight_actor_layout_matches(group8, tiny_cfg):
    """dp 2 x pp 4, a stage per layer (the first one dense), ZeRO-1."""
    check_moe_parity(moe_cfg(tiny_cfg, dp=2, pp=4, zero=1, micro_batch_size=1), group8)


def test_moe_eight_actor_expert_parallel_layout_matches(group8, tiny_cfg):
    """dp 4 x pp 2 with ep 2, ZeRO-3: each stage's experts split over two ranks, each shard
    sharded again over the two ranks holding it."""
    check_moe_parity(moe_cfg(tiny_cfg, dp=4, pp=2, ep=2, zero=3, micro_batch_size=1), group8,
                     weight_atol=5e-5)


@pytest.mark.parametrize("save_as,load_as", [
    (dict(dp=2, zero=1), dict(dp=1, pp=2, schedule="1f1b")),
    (dict(dp=2, zero=1), dict(dp=2, zero=3)),
    (dict(dp=2, zero=1), dict(dp=2, ep=2, zero=1)),
    (dict(dp=2, ep=2, zero=1), dict(dp=1, pp=2, schedule="1f1b")),
    (dict(dp=2, ep=2, zero=3), dict(dp=2, zero=1)),
    (dict(dp=1, tp=2, sequence_parallel=True), dict(dp=2, ep=2, zero=3)),
])
def test_moe_checkpoint_loads_into_another_layout(save_as, load_as, tmp_path, data_cache, group2):
    """Saved at dp 2 ZeRO-1 (with or without ep 2) or tp 2 + SP, loaded at pp 2 / ZeRO-3 / ep 2
    (or ep 1): every weight and router bias bit for bit, then the same losses and routing as the run that
    went on."""
    from helpers.checkpoint_runs import run_cfg

    def cfg(**kw):
        c = run_cfg(tmp_path, data_cache, tmp_path / "checkpoints", **kw)
        c["model"] = {
            "preset": "tiny-moe",
            "max_seq_len": 64,
            "moe": {"aux_loss_coef": 0.1, "bias_update_rate": 0.01},
        }
        return c

    with Trainer(cfg(every=3, **save_as), actor_group=group2, progress=False) as t:
        t.fit(3)
        weights = t.state_dict()
        expected = t.fit()[3:]
    assert any(key.endswith("expert_bias") and value.abs().sum() > 0 for key, value in weights.items())
    with Trainer(cfg(resume=str(tmp_path / "checkpoints" / "step-00000003"), **load_as),
                 actor_group=group2, progress=False) as t:
        loaded = t.state_dict()
        assert loaded.keys() == weights.keys()
        for key, value in weights.items():
            assert torch.equal(loaded[key], value), key
        rest = t.fit()
    for got, want in zip(rest, expected, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
        assert _same_routing(got["routing"], want["routing"]), got["step"]


def test_moe_checkpoint_reshards_from_ep2_to_ep4_to_ep1(tmp_path, data_cache, group4):
    """Saved at ep 2, loaded at ep 4 (each rank now holds 2 of a block's 8 experts, not 4), saved
    there and loaded at ep 1: every weight and router bias bit for bit at each load, then the same
    losses and routing as the run that went on at ep 2."""
    from helpers.checkpoint_runs import run_cfg

    def cfg(saves: str, **kw):
        c = run_cfg(tmp_path, data_cache, tmp_path / saves, steps=6, every=2, **kw)
        c["model"] = {"preset": "tiny-moe", "max_seq_len": 64,
                      "moe": {"aux_loss_coef": 0.1, "bias_update_rate": 0.01}}
        c["parallel"]["micro_batch_size"] = 1
        c["checkpoint"]["keep_last"] = 3
        return c

    def same(got: dict, want: dict) -> None:
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert torch.equal(got[key], value), key

    with Trainer(cfg("at_ep2", dp=4, ep=2), actor_group=group4, progress=False) as t:
        t.fit(2)
        at_2 = t.state_dict()
        expected = t.fit()[2:]  # fit returns the run's whole history
    with Trainer(cfg("at_ep4", dp=4, ep=4, resume=str(tmp_path / "at_ep2" / "step-00000002")),
                 actor_group=group4, progress=False) as t:
        same(t.state_dict(), at_2)
        went_on = t.fit(2)  # to step 4
        at_4 = t.state_dict()
    with Trainer(cfg("at_ep1", dp=4, resume=str(tmp_path / "at_ep4" / "step-00000004")),
                 actor_group=group4, progress=False) as t:
        same(t.state_dict(), at_4)
        went_on += t.fit()
    for got, want in zip(went_on, expected, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
        assert _same_routing(got["routing"], want["routing"]), got["step"]


def _same_routing(got: dict, want: dict) -> bool:
    return all(got[b]["tokens_per_expert"] == want[b]["tokens_per_expert"]
               and got[b]["aux_loss"] == pytest.approx(want[b]["aux_loss"], rel=1e-5) for b in want)


def check_memory_estimate(cfg: dict, group) -> None:
    """Measured model state + saved activations (largest rank, first step) against the planner:
    within 5% without expert parallelism. Under ep the planner prices each rank's expert
    activations at the most a dropless router can send it (MoEArgs.received_share), a bound this
    step's router does not reach: the measure lies between the estimate at balanced routing
    (less 5%) and that bound."""
    cfg = {**cfg, "train": {**cfg["train"], "steps": 1}}
    with Trainer(cfg, actor_group=group, progress=False) as t:
        metrics = t.step()
        config, vocab = t.config, t.data.vocab_size
    measured, estimated = metrics["memory_measured_bytes_max"], metrics["memory_estimate_bytes_max"]
    lay = config.parallel.layout
    if lay.ep == 1:
        assert abs(estimated - measured) <= 0.05 * measured, (measured, estimated)
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(MoEArgs, "received_share", lambda self, ep: 1.0)
        ranks = estimate(model_args(config.model, vocab), lay, config.train.global_batch_size,
                         config.train.seq_len, config.bf16)
    balanced = max(r.measured_part_bytes for r in ranks)
    assert 0.95 * balanced <= measured <= estimated, (balanced, measured, estimated)


@pytest.mark.parametrize(
    "parallel", [dict(dp=2, zero=1), dict(dp=1, pp=2), dict(dp=2, zero=3, activation_checkpointing=True),
                 dict(dp=2, ep=2), dict(dp=2, ep=2, zero=1), dict(dp=2, ep=2, zero=3),
                 dict(dp=1, tp=2), dict(dp=1, tp=2, sequence_parallel=True)]
)
def test_planner_memory_estimate_matches_moe_runs(parallel, group2, tiny_cfg):
    """The planner counts each block as it is (dense or MoE: its experts' state, the routed
    copies and expert activations it saves): within 5% of the measured model state +
    activations without ep (measured here within 0.1%), and within its routing bound under ep
    (check_memory_estimate)."""
    check_memory_estimate(moe_cfg(tiny_cfg, **parallel), group2)


def test_planner_memory_estimate_matches_a_context_parallel_moe_run(group2, tiny_cfg):
    """cp2 (aux_loss_coef 0): each rank's expert activations are those of its slice of the tokens."""
    cfg = moe_cfg(tiny_cfg, dp=1, cp=2)
    cfg["model"]["moe"]["aux_loss_coef"] = 0.0
    check_memory_estimate(cfg, group2)


@pytest.mark.parametrize("parallel", [dict(dp=4, ep=4, zero=3), dict(dp=4, ep=2, zero=1),
                                      dict(dp=4, dp_replicate=2, ep=2, zero=3)])
def test_planner_memory_estimate_of_four_rank_expert_parallel_runs(parallel, group4, tiny_cfg):
    """ep 4; ZeRO-1 with ep 2, whose experts' optimizer state is not sharded over the two ranks
    holding the same experts (ExpertsApartOptimizer); and HSDP 2x2 with ep 2 (the experts split
    by ep inside each group, replicated over the groups): priced as the runs hold them."""
    check_memory_estimate(moe_cfg(tiny_cfg, **parallel), group4)
