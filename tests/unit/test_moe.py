"""The MoE block on its own: grouped GEMM and the loop give the same numbers, the balance loss's
injected gradient is the gradient of the loss it stands for and does not depend on how a batch is
split, routing is counted once under activation checkpointing, the bias moves towards balance, the
presets' parameter counts are arithmetic, and what is not built is refused."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from raymp.config import ConfigError, config_from_dict
from raymp.models import build_model, model_args, model_spec
from raymp.models import moe as moe_mod
from raymp.models.moe import (MoEArgs, MoEFeedForward, finish_routing, imbalance, moe_blocks, reset_routing,
                              set_aux_grad_scale)


def _model(**moe):
    cfg = config_from_dict({"model": {"preset": "tiny-moe", "moe": moe}})
    return build_model(model_spec(cfg.model, 256, 3), 3)


def _grads(model, tokens, micro: int = 1):
    model.zero_grad(set_to_none=True)
    set_aux_grad_scale(moe_blocks(model), 1 / micro)
    for chunk in tokens.chunk(micro):
        logits = model(chunk[:, :-1])
        (torch.nn.functional.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten()) / micro).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


TOKENS = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(0))


def test_grouped_gemm_and_loop_are_the_same_numbers(monkeypatch):
    model = _model()
    grouped = _grads(model, TOKENS)
    monkeypatch.setattr(moe_mod, "uses_grouped_mm", lambda x: False)
    loop = _grads(model, TOKENS)
    for name, g in grouped.items():
        torch.testing.assert_close(loop[name], g, rtol=0, atol=1e-7, msg=name)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_injected_balance_gradient_is_the_balance_loss_gradient(score, monkeypatch):
    model = _model(score=score, aux_loss_coef=0.5)
    injected = _grads(model, TOKENS)
    seen = []

    def record(out, aux):
        seen.append(aux)
        return out

    monkeypatch.setattr(moe_mod._AddAuxGradient, "apply", record)
    model.zero_grad(set_to_none=True)
    logits = model(TOKENS[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), TOKENS[:, 1:].flatten())
    (loss + sum(seen)).backward()
    assert seen and all(float(a.detach()) > 0 for a in seen)
    for name, p in model.named_parameters():
        torch.testing.assert_close(injected[name], p.grad, rtol=1e-5, atol=1e-8, msg=name)
    gate = [n for n in injected if n.endswith("router.gate.weight")][0]
    without = _grads(_model(score=score, aux_loss_coef=0.0), TOKENS)
    assert not torch.allclose(without[gate], injected[gate])  # the loss reaches the router


def test_balance_gradient_does_not_depend_on_micro_batches():
    model = _model(aux_loss_coef=0.5)
    whole, split = _grads(model, TOKENS, micro=1), _grads(model, TOKENS, micro=4)
    for name, g in whole.items():
        torch.testing.assert_close(split[name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_routing_is_counted_once_under_activation_checkpointing():
    model = _model()
    block = next(iter(moe_blocks(model).values()))
    reset_routing(moe_blocks(model))
    h = torch.randn(2, 16, 64, requires_grad=True)
    checkpoint(block, h, use_reentrant=False).sum().backward()
    assert block.routing.counts.sum() == 2 * 16 * block.args.top_k
    assert len(block.routing.aux_losses) == 1


def test_no_counting_without_gradients():
    model = _model()
    reset_routing(moe_blocks(model))
    with torch.no_grad():
        model(TOKENS[:, :-1])
    assert all(b.routing.counts is None for b in moe_blocks(model).values())


def test_bias_moves_towards_balance_and_routing_resets():
    args = MoEArgs(n_experts=4, top_k=1, expert_ffn_dim=8, bias_update_rate=0.1)
    block = MoEFeedForward(8, args)
    block.router.expert_bias.zero_()
    block.routing.add(torch.tensor([5, 1, 1, 1]), torch.tensor(0.0))
    routing = finish_routing({"b": block})
    assert routing["b"]["tokens_per_expert"] == [5, 1, 1, 1]
    assert block.router.expert_bias.tolist() == pytest.approx([-0.1, 0.1, 0.1, 0.1])
    assert block.routing.counts is None
    assert imbalance([5, 1, 1, 1]) == 2.5


def test_bias_changes_which_expert_is_chosen_not_its_weight():
    args = MoEArgs(n_experts=4, top_k=1, expert_ffn_dim=8, normalize_topk=False)
    block = MoEFeedForward(8, args)
    torch.nn.init.normal_(block.router.gate.weight)
    x = torch.randn(5, 8)
    chosen, weights, scores = block.router(x)
    block.router.expert_bias.fill_(0)
    block.router.expert_bias[3] = 10.0
    chosen_b, weights_b, scores_b = block.router(x)
    assert chosen_b.flatten().tolist() == [3] * 5
    torch.testing.assert_close(weights_b, scores.gather(-1, chosen_b))


@pytest.mark.parametrize("preset", ["tiny-moe", "small-moe"])
def test_parameter_arithmetic_matches_the_built_model(preset):
    cfg = config_from_dict({"model": {"preset": preset}})
    args = model_args(cfg.model, 256)
    with torch.device("meta"):
        model = build_model(model_spec(cfg.model, 256), 0, "meta")
    assert args.num_params == model.num_params()
    per_expert = 3 * args.dim * args.moe.expert_ffn_dim
    moe_layers = args.n_layers - args.moe.dense_layers
    assert (
        args.num_params - args.active_params
        == moe_layers * (args.moe.n_experts - args.moe.top_k) * per_expert
    )


def test_published_moe_shapes():
    sizes = {p: model_args(config_from_dict({"model": {"preset": p}}).model, 256)
             for p in ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3")}
    assert sizes["mixtral-8x7b"].num_params / 1e9 == pytest.approx(46.7, abs=0.1)
    assert sizes["mixtral-8x7b"].active_params / 1e9 == pytest.approx(12.9, abs=0.1)
    assert sizes["deepseek-v3"].num_params / 1e9 == pytest.approx(671, rel=0.01)


@pytest.mark.parametrize("settings,field", [
    ({"model": {"preset": "tiny-moe", "moe": {"top_k": 9}}}, "model.moe.top_k"),
    ({"model": {"preset": "tiny-moe", "moe": {"dense_layers": 4}}}, "model.moe.dense_layers"),
    ({"model": {"preset": "tiny-moe"}, "parallel": {"cp": 2}}, "model.moe.aux_loss_coef=0 (the router bias"),
    ({"model": {"preset": "tiny-moe", "moe": {"aux_loss_coef": 0}},
      "parallel": {"dp": 4, "ep": 2, "cp": 2, "dp_replicate": 2, "zero": 3}},
     "parallel.ep with parallel.cp > 1 under HSDP (parallel.dp_replicate > 1) is not supported"),
    ({"model": {"preset": "tiny-moe"}, "precision": "fp8", "resources": {"device": "cuda"}}, "model.moe"),
    ({"model": {"hf_config": {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 256},
                "moe": {"n_experts": 4}}, "tracking": {"enabled": False}}, "model.moe"),
    ({"model": {"factory": "helpers.custom_model:build", "moe": {"n_experts": 4}}}, "model.moe"),
    ({"model": {"preset": "tiny"}, "parallel": {"dp": 2, "ep": 2}}, "parallel.ep=1, or pick an MoE model"),
    ({"model": {"preset": "tiny-moe"}, "parallel": {"dp": 3, "ep": 3}}, "model.moe.n_experts (8)"),
    ({"model": {"preset": "tiny-moe"}, "parallel": {"dp": 2, "ep": 4}}, "must divide parallel.dp (2)"),
    ({"model": {"preset": "tiny-moe"}, "parallel": {"dp": 4, "ep": 4, "zero": 3, "dp_replicate": 2}},
     "each HSDP group's ranks (parallel.dp / parallel.dp_replicate = 2)"),
    ({"model": {"hf_config": {"model_type": "mixtral", "hidden_size": 64, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
                              "vocab_size": 256, "num_local_experts": 4, "num_experts_per_tok": 2}},
      "parallel": {"dp": 8, "ep": 8}, "tracking": {"enabled": False}},
     "parallel.ep (8) must divide num_local_experts in model.hf_config (4)"),
])
def test_moe_refusals_name_the_field(settings, field):
    with pytest.raises((ConfigError, ValueError)) as err:
        config_from_dict(settings)
    assert field in str(err.value)


def test_step_metrics_merge_each_stages_routing_and_log_the_moe_columns():
    from dataclasses import replace

    from raymp.driver.metrics import moe_metrics
    from raymp.metric_names import PER_STEP
    from raymp.layout import Layout
    from raymp.runtime.report import RankReport

    layout = Layout(dp=2, pp=2)
    stage = {0: {"layers.1.feed_forward": {"tokens_per_expert": [4, 4, 4, 4], "aux_loss": 0.01}},
             1: {"layers.2.feed_forward": {"tokens_per_expert": [10, 2, 2, 2], "aux_loss": 0.03}}}
    reports = [RankReport(rank=r, loss=None, grad_norm=0, lr=0, compute_s=0, data_wait_s=0, peak_mem_bytes=0,
                          param_bytes=0, grad_bytes=0, optim_bytes=0, routing=stage[layout.coords(r)["pp"]])
               for r in range(layout.world_size)]
    m = moe_metrics(reports, layout)
    assert set(m["routing"]) == {"layers.1.feed_forward", "layers.2.feed_forward"}
    assert m["moe_imbalance_max"] == 2.5 and m["moe_dropped_tokens"] == 0
    assert m["moe_aux_loss"] == pytest.approx(0.04)
    assert {"moe_aux_loss", "moe_imbalance_max", "moe_dropped_tokens", "moe_all_to_all_s"} <= set(PER_STEP)
    assert "moe_all_to_all_s" not in m  # no expert parallelism: nothing timed
    timed = [replace(r, expert_exchange_s=0.1 * r.rank) for r in reports]
    assert moe_metrics(timed, layout)["moe_all_to_all_s"] == pytest.approx(0.3)
    assert (
        moe_metrics(
            [
                RankReport(
                    rank=0,
                    loss=1.0,
                    grad_norm=0,
                    lr=0,
                    compute_s=0,
                    data_wait_s=0,
                    peak_mem_bytes=0,
                    param_bytes=0,
                    grad_bytes=0,
                    optim_bytes=0,
                )
            ],
            Layout(),
        )
        == {}
    )


def test_an_expert_parallel_rank_that_receives_no_rows_still_gives_its_experts_zero_gradients():
    """A collapsed router can send one ep rank's experts nothing; their gradients must still
    exist (zeros) for the all-reduce over the ranks holding the same experts, and the empty rows
    must get a gradient too: the all-to-all that brought them runs its backward only then."""
    from raymp.models.moe import swiglu_experts
    from raymp.parallel.experts import run_local_experts

    weights = [torch.randn(4, 8, 16, requires_grad=True), torch.randn(4, 8, 16, requires_grad=True),
               torch.randn(4, 16, 8, requires_grad=True)]
    rows = torch.randn(0, 8, requires_grad=True)
    out = run_local_experts(rows, torch.zeros(4, dtype=torch.long),
                            lambda x, n: swiglu_experts(x, n, *weights))
    out.sum().backward()
    assert out.shape == (0, 8)
    assert all(w.grad is not None and not w.grad.any() for w in weights)
    assert rows.grad is not None and rows.grad.shape == (0, 8)


@pytest.mark.timeout(120)
def test_the_expert_exchange_is_differentiable_and_timed_both_ways():
    """The all-to-all of routed rows: its backward sends the gradients back by the reverse
    splits, and the block's clock counts both directions, read once (ExchangeClock)."""
    import os

    import torch.distributed as dist

    from helpers.ports import free_port
    from raymp.parallel.experts import ExchangeClock, _Exchange

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        clock = ExchangeClock(timed=True)
        x = torch.arange(12.0).view(6, 2).requires_grad_()
        out = _Exchange.apply(x, [6], [6], dist.group.WORLD, clock)
        forward = clock.seconds
        (out * 3).sum().backward()
        assert torch.equal(out, x) and torch.equal(x.grad, torch.full((6, 2), 3.0))
        assert 0 < forward < clock.seconds
        assert clock.take() > 0 and clock.seconds == 0
        assert ExchangeClock(timed=False).seconds == 0
    finally:
        dist.destroy_process_group()


# torch.compile's first import (torch._dynamo) defines TorchScript methods torch deprecates.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_compile_leaves_the_routed_feed_forward_eager_and_compiles_the_rest():
    """apply_compile on an MoE model: a dense block whole; in an MoE block its attention and norms,
    never the routed feed-forward (data-dependent token counts). Nothing is traced here: a module's
    compile() only marks it, and the first call would compile."""
    from raymp.parallel.compile import apply_compile

    cfg = config_from_dict({"model": {"preset": "tiny-moe", "moe": {"dense_layers": 1}}})
    spec = model_spec(cfg.model, 256)
    model = build_model(spec, 0)
    apply_compile(model, spec.block_names(model), tensor_parallel=False)
    compiled = {name for name, m in model.named_modules() if getattr(m, "_compiled_call_impl", None)}
    assert "layers.0" in compiled  # the dense block
    moe_names = [name for name, m in model.named_modules() if isinstance(m, MoEFeedForward)]
    assert moe_names and not any(n.startswith(tuple(moe_names)) for n in compiled)
    for block in moe_names:
        parent = block.rsplit(".", 1)[0]
        assert parent not in compiled
        assert {f"{parent}.attention", f"{parent}.attention_norm", f"{parent}.ffn_norm"} <= compiled
