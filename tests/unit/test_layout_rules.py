"""One authority on layouts (raymp.layout): config validation and the planner judge every layout
alike, and `parallel: auto` only ever proposes layouts the config accepts. No Ray, no actors."""

from __future__ import annotations

import itertools
import random

import pytest

from raymp.config import ConfigError, ModelConfig, config_from_dict
from raymp.config.loading import with_model_shape
from raymp.layout import Layout
from raymp.models import model_args
from raymp.models.shape import TOKENIZER_VOCAB, model_shape
from raymp.planner import layout_problem, plan
from raymp.step_time import Cluster

GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 4, "n_positions": 256, "vocab_size": 256}
LLAMA = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 172, "num_hidden_layers": 4, "max_position_embeddings": 256, "vocab_size": 256}
QWEN2 = {"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 1,
         "intermediate_size": 128, "num_hidden_layers": 3, "max_position_embeddings": 256, "vocab_size": 256}
MODELS = {
    "tiny": {"preset": "tiny"},
    "tiny 8 layers": {"preset": "tiny", "n_layers": 8},
    "odd built-in": {"preset": None, "dim": 96, "n_layers": 6, "n_heads": 6, "n_kv_heads": 3, "ffn_dim": 200,
                     "max_seq_len": 256, "vocab_size": 300, "rope_theta": 10000.0, "norm_eps": 1e-5,
                     "tie_embeddings": True, "init_std": 0.02},
    "gpt2 n_inner=256": {"hf_config": {**GPT2, "n_inner": 256}},
    "gpt2 n_inner=258": {"hf_config": {**GPT2, "n_inner": 258}},
    "llama": {"hf_config": LLAMA},
    "qwen2": {"hf_config": QWEN2},
}
WIDE = Cluster(nodes=1, gpus_per_node=8)  # no layout below is refused for its node size


def _run(model: str, parallel: dict, global_batch: int, seq_len: int) -> dict:
    return {"model": MODELS[model], "parallel": parallel,
            "train": {"global_batch_size": global_batch, "seq_len": seq_len, "steps": 20},
            "optimizer": {"warmup_steps": 1}}


def _config_verdict(run: dict) -> str:
    try:
        config_from_dict(run)
        return ""
    except ConfigError as err:
        return str(err)


def _planner_verdict(run: dict) -> str:
    """What `raymp plan --compare` says of the layout: the planner's own judgement."""
    model = ModelConfig.model_validate(with_model_shape(run["model"]))
    vocab = TOKENIZER_VOCAB["byte"]
    p = run["parallel"]
    layout = Layout(**{k: v for k, v in p.items() if k != "stage_layers"})
    return layout_problem(model_args(model, vocab), layout, run["train"]["global_batch_size"],
                          run["train"]["seq_len"], WIDE, model_shape(model, vocab, "byte"))


def _layouts():
    for dp, cp, pp, tp, zero, mbs, sp, schedule, gb, seq in itertools.product(
            (1, 2, 3, 4), (1, 1, 2, 4), (1, 2, 4), (1, 2, 4), (0, 1, 2, 3), (1, 2), (False, True),
            ("gpipe", "1f1b", "interleaved", "zbv", "dualpipev"), (8, 12, 16), (30, 32)):
        virtual = (None, 3) if schedule == "interleaved" else (None,)
        for v in virtual:
            yield {"dp": dp, "cp": cp, "pp": pp, "tp": tp, "zero": zero, "micro_batch_size": mbs,
                   "sequence_parallel": sp, "schedule": schedule, "virtual_stages": v}, gb, seq


def test_planner_and_config_agree_on_2500_layouts():
    cases = list(itertools.product(MODELS, _layouts()))
    sample = random.Random(0).sample(cases, 2500)
    disagree, accepted = [], 0
    for model, (parallel, gb, seq) in sample:
        run = _run(model, parallel, gb, seq)
        config, planner = _config_verdict(run), _planner_verdict(run)
        accepted += config == ""
        if (config == "") != (planner == ""):
            disagree.append((model, parallel, gb, seq, config or "accepted", planner or "accepted"))
    assert not disagree, f"{len(disagree)} disagreements, e.g. {disagree[:3]}"
    assert 200 < accepted < 2300, "the sample should hold plenty of both verdicts"


@pytest.mark.parametrize(
    "model, parallel, gb, verdict",
    [
        # The cases that once disagreed (config said one thing, the planner the other).
        (
            "tiny 8 layers",
            {"pp": 4, "schedule": "zbv", "micro_batch_size": 2},
            8,
            "needs at least 8 micro-batches",
        ),
        ("tiny 8 layers", {"pp": 4, "schedule": "gpipe", "micro_batch_size": 2}, 8, ""),
        ("gpt2 n_inner=256", {"tp": 4}, 8, ""),
        ("gpt2 n_inner=258", {"tp": 4}, 8, "must divide n_inner (258)"),
        ("llama", {"tp": 2, "sequence_parallel": True}, 8, ""),
        (
            "gpt2 n_inner=256",
            {"tp": 2, "sequence_parallel": True},
            8,
            "not implemented for the Hugging Face gpt2 model",
        ),
        # Context parallelism: the built-in model only; cp x tp splits the heads; cp splits the sequence.
        ("tiny", {"cp": 2, "tp": 2, "sequence_parallel": True}, 8, ""),
        ("llama", {"cp": 2}, 8, "parallel.cp is implemented for the built-in model only"),
        ("tiny", {"cp": 4, "tp": 2}, 8, "must divide model.n_heads (4)"),
        ("odd built-in", {"cp": 3}, 8, "parallel.cp = 3 must divide train.seq_len (32)"),
        # HSDP: FSDP2 on a 2-D mesh, dp = dp_replicate x dp_shard.
        ("tiny", {"dp": 4, "dp_replicate": 2, "zero": 3}, 8, ""),
        (
            "tiny",
            {"dp": 4, "dp_replicate": 3, "zero": 3},
            12,
            "parallel.dp_replicate (3) must divide parallel.dp (4)",
        ),
        ("tiny", {"dp": 4, "dp_replicate": 2, "zero": 1}, 8, "needs parallel.zero 2 or 3"),
    ],
)
def test_once_disagreeing_cases_get_one_verdict(model, parallel, gb, verdict):
    run = _run(model, parallel, gb, 32)
    config, planner = _config_verdict(run), _planner_verdict(run)
    assert (config == "") == (planner == "") == (verdict == "")
    assert verdict in config and verdict in planner


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("nodes, gpus", [(1, 2), (1, 4), (2, 4), (1, 8)])
def test_auto_only_proposes_layouts_the_config_accepts(model, nodes, gpus):
    cluster = {"nodes": nodes, "gpus_per_node": gpus, "gpu_memory_gb": 80}
    base = _run(model, {}, 16, 30)  # 30: sequence parallelism must not be proposed where it cannot split
    cfg = config_from_dict({**base, "parallel": "auto", "cluster": cluster})
    assert cfg.parallel.world_size == nodes * gpus
    m = ModelConfig.model_validate(with_model_shape(MODELS[model]))
    result = plan(model_args(m, 256), Cluster(nodes, gpus), 16, 30, shape=model_shape(m, 256, "byte"))
    for candidate in result.candidates:  # every layout the planner judges, not only the best
        lay = candidate.layout
        assert not (
            lay.data_parallel_size == 1 and lay.zero > 0
        ), f"a no-op proposed: {lay.text(detail=True)}"
        config_from_dict({**base, "parallel": lay.as_parallel()})


def test_layout_text_forms_and_records_round_trip():
    lay = Layout(dp=2, pp=2, tp=2, zero=3, micro_batch_size=2, sequence_parallel=True, schedule="gpipe")
    assert lay.text() == "dp=2 pp=2 tp=2 zero=3"
    assert lay.text(detail=True) == "dp=2 pp=2 tp=2 zero=3 mbs=2 gpipe +SP"
    assert lay.tag() == "dp2-pp2-tp2-zero3"
    assert Layout.from_record(lay.record()).text() == lay.text()
    assert [lay.coords(r) for r in (0, 1, 2, 7)] == [
        {"dp": 0, "cp": 0, "pp": 0, "tp": 0}, {"dp": 0, "cp": 0, "pp": 0, "tp": 1},
        {"dp": 0, "cp": 0, "pp": 1, "tp": 0}, {"dp": 1, "cp": 0, "pp": 1, "tp": 1}]
    assert all(lay.rank_of(**lay.coords(r)) == r for r in range(lay.world_size))
    assert lay.ranks_where(pp=0) == [0, 1, 4, 5]


def test_context_parallel_ranks_sit_between_dp_and_pp():
    """cp next to dp, so dp x cp flattens into the one group gradients average over."""
    lay = Layout(dp=2, cp=2, pp=2, tp=1, zero=3)
    assert lay.world_size == 8 and lay.data_parallel_size == 4
    assert lay.text() == "dp=2 cp=2 pp=2 tp=1 zero=3" and lay.tag() == "dp2-cp2-pp2-tp1-zero3"
    assert [lay.coords(r) for r in (1, 2, 5)] == [
        {"dp": 0, "cp": 0, "pp": 1, "tp": 0},
        {"dp": 0, "cp": 1, "pp": 0, "tp": 0},
        {"dp": 1, "cp": 0, "pp": 1, "tp": 0},
    ]
    assert all(lay.rank_of(**lay.coords(r)) == r for r in range(lay.world_size))
    assert Layout.from_record(lay.record()) == lay
    assert Layout.from_record({"dp": 2, "pp": 1, "tp": 1, "zero": 0}).cp == 1  # records from before cp


def test_hsdp_layout_shards_inside_replica_groups():
    lay = Layout(dp=4, zero=3, cp=2, dp_replicate=2)
    assert (lay.dp_shard, lay.zero_shards, lay.data_parallel_size) == (2, 4, 8)
    assert (
        lay.text() == "dp=4 (2x2 HSDP) cp=2 pp=1 tp=1 zero=3" and lay.tag() == "dp4-hsdp2-cp2-pp1-tp1-zero3"
    )
    assert Layout.from_record(lay.record()) == lay


def test_configs_raymp_derives_are_validated_once_without_reading_the_model_again(monkeypatch):
    """Issue 41: one way to derive a config (config.derived). The driver's stage split and an
    elastic re-plan are validated by every rule, once, and never read the user's model again (a
    Hugging Face config, or a factory built on the meta device, was read when the run loaded)."""
    from raymp.config import RunConfig, derived
    from raymp.config import loading
    from raymp.driver.launch import with_stage_split
    from raymp.elastic.capacity import with_dp
    from helpers.hf_cases import LLAMA

    cfg = config_from_dict(
        {
            "model": {"hf_config": LLAMA},
            "parallel": {"dp": 2, "pp": 2, "micro_batch_size": 2},
            "train": {"global_batch_size": 8, "seq_len": 32},
        }
    )

    def read_again(model):
        raise AssertionError("the model was read again")

    validations = []
    validate = RunConfig.model_validate
    monkeypatch.setattr(loading, "probed_shape", read_again)
    monkeypatch.setattr(RunConfig, "model_validate",
                        lambda data, **kw: validations.append(1) or validate(data, **kw))
    split = with_stage_split(cfg, 256)
    assert split.parallel.stage_layers == [[0, 1], [2, 3]] and cfg.parallel.stage_layers is None
    assert validations == [1]
    assert with_dp(split, 1).parallel.dp == 1 and validations == [1, 1]
    assert split.model == cfg.model  # the shape read at load, carried as it was
    # A change the rules refuse is refused with the field and where the change came from.
    refused = r"re-planned to dp=3\):\n  train.global_batch_size \(8\) must be divisible"
    with pytest.raises(ConfigError, match=refused):
        derived(cfg, {"parallel.dp": 3}, "re-planned to dp=3")


def test_whole_replicas_are_those_every_rank_of_which_survived():
    assert Layout(dp=2, pp=2).whole_replicas([0, 1, 2]) == [[0, 1]]
    assert Layout(dp=4).whole_replicas([1, 2, 3]) == [[1], [2], [3]]
    assert Layout(dp=2, pp=2, tp=2).whole_replicas([0, 1, 2, 3, 4, 5, 6]) == [[0, 1, 2, 3]]
    assert Layout(dp=2, pp=2, tp=2).replica_of(5) == [4, 5, 6, 7]
    # HSDP: a whole copy of the state is a group of shards; its survivors keep the shard size.
    hsdp = Layout(dp=4, zero=3, dp_replicate=2)
    assert (
        hsdp.state_replicas == 2
        and hsdp.replica_of(1) == [0, 1]
        and hsdp.whole_replicas([1, 2, 3]) == [[2, 3]]
    )
    assert hsdp.settings_keeping(1) == {"dp": 2, "dp_replicate": 1} and Layout(dp=4).settings_keeping(3) == {
        "dp": 3
    }
    assert Layout(dp=4, zero=3).state_replicas == 1 and Layout(dp=4).state_replicas == 4


def test_spares_come_in_whole_copies_or_with_peer_copies_in_tp_groups_and_join_from_the_first_copy():
    """Layout.spare_unit and copy_source: the rules elastic.spares and a joining rank ask."""
    ddp_pp = Layout(dp=2, pp=2)  # two whole copies of two ranks
    assert ddp_pp.spare_unit(peer_copies=False) == ddp_pp.spare_unit(peer_copies=True) == 2
    assert [ddp_pp.copy_source(r) for r in (2, 3)] == [0, 1]
    zero_tp = Layout(dp=2, tp=2, zero=2)  # one copy over four ranks: a lost TP group's place
    assert zero_tp.spare_unit(peer_copies=False) == 4 and zero_tp.spare_unit(peer_copies=True) == 2
    hsdp = Layout(dp=4, zero=3, dp_replicate=2)  # two copies of two shards each
    assert hsdp.spare_unit(peer_copies=True) == 2 and hsdp.copy_source(3) == 1


def test_elastic_replanning_validates_one_whole_config_not_one_per_dp_tried():
    """dp 7, 6 and 5 cannot split a global batch of 8 into whole micro-batches: the layout rules screen
    them out, and the one whole config built is dp=4's."""
    from raymp.elastic.capacity import _largest_valid, largest_valid_dp, with_dp

    cfg = config_from_dict({"parallel": {"dp": 8, "micro_batch_size": 1},
                            "train": {"global_batch_size": 8, "seq_len": 32}, "model": {"preset": "tiny"}})
    built = []
    assert _largest_valid(cfg, 7, lambda c, n: built.append(n) or with_dp(c, n), lambda n: {"dp": n}) == 4
    assert built == [4]
    assert largest_valid_dp(cfg, 3) == 2 and largest_valid_dp(cfg, 8) == 8


def test_expert_parallel_groups_are_consecutive_dp_replicas_and_a_whole_copy_is_one_group():
    """ep borrows dp replicas (innermost), so an expert-parallel group is contiguous ranks and one
    whole copy of the state; survivors keep whole groups and the ep degree."""
    from raymp.config.rules import survivors_keep_state

    lay = Layout(dp=4, pp=2, ep=2)
    assert [lay.ep_rank(r) for r in range(lay.world_size)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert (lay.expert_replicas, lay.state_replicas, lay.ranks_per_copy) == (2, 2, 4)
    assert lay.replica_of(5) == [4, 5, 6, 7] and lay.whole_replicas([0, 1, 2, 4, 5, 6, 7]) == [[4, 5, 6, 7]]
    assert lay.settings_keeping(1) == {"dp": 2} and not lay.dp_replica_holds_state
    assert lay.text() == "dp=4 (ep=2) pp=2 tp=1 zero=0" and lay.tag() == "dp4-ep2-pp2-tp1-zero0"
    assert Layout.from_record(lay.record()) == lay
    assert Layout.from_record({"dp": 2, "pp": 1, "tp": 1, "zero": 0}).ep == 1  # records from before ep
    assert lay.mesh_degrees != Layout(dp=4, pp=2).mesh_degrees
    assert lay.local_batch(16) == 4
    # One group of ep replicas: a loss leaves no whole copy, unless peer copies make one.
    one = Layout(dp=2, ep=2)
    assert not survivors_keep_state(one, one.state_replicas, 0) and survivors_keep_state(one, 1, 5)
    assert survivors_keep_state(lay, lay.state_replicas, 0) and survivors_keep_state(Layout(dp=1), 1, 0)


def test_the_planner_shards_routed_experts_over_ep_and_prices_a_collapsed_router():
    from raymp.models import model_args
    from raymp.planner import stage_params

    args = model_args(config_from_dict({"model": {"preset": "tiny-moe"}}).model, 256)
    experts = [args.routed_expert_params(i) for i in range(args.n_layers)]
    assert experts[0] == 0 and experts[1] == args.moe.n_experts * 3 * args.dim * args.moe.expert_ffn_dim
    layers = list(range(args.n_layers))
    assert stage_params(args, layers, True, True, 1) - stage_params(args, layers, True, True, 1, ep=2) \
        == sum(experts) / 2
    # 8 experts, top 2: at ep 2 a rank's 4 experts can take both copies of every token of 2 ranks.
    assert [args.moe.received_share(ep) for ep in (1, 2, 8)] == [1, 2, 4]


def test_a_restart_with_fewer_replicas_replans_ep_to_what_divides_them():
    """dp 4 x ep 4 that comes back with room for 2 or 3 replicas: ep 2 at dp 2 (a checkpoint
    reshards the experts), and at dp 3 no ep > 1 divides both: ep 1. Under HSDP ep must divide
    each group's new size."""
    from raymp.elastic import largest_valid_dp, with_dp

    assert Layout(dp=4, ep=4).settings_at_dp(2) == {"dp": 2, "ep": 2}
    assert Layout(dp=4, ep=4).settings_at_dp(3) == {"dp": 3, "ep": 1}
    assert Layout(dp=4).settings_at_dp(3) == {"dp": 3}
    # HSDP: ep within each group; 2 groups at dp 4 hold 2 ranks each, so ep 4 becomes 2
    assert Layout(dp=8, ep=4, zero=3, dp_replicate=2).settings_at_dp(4) == {"dp": 4, "ep": 2}
    cfg = config_from_dict({"model": {"preset": "tiny-moe"}, "parallel": {"dp": 4, "ep": 4},
                            "train": {"global_batch_size": 8, "seq_len": 32}, "tracking": {"enabled": False}})
    assert largest_valid_dp(cfg, 3) == 2  # a global batch of 8 does not split over 3
    assert (with_dp(cfg, 2).parallel.dp, with_dp(cfg, 2).parallel.ep) == (2, 2)
