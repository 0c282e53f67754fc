"""The built-in model: shapes, determinism, causality, tied weights and preset sizes."""

from __future__ import annotations

import pytest
import torch

from raymp.config import config_from_dict
from raymp.models import PRESETS, ModelArgs, Transformer, build_model, model_args

ARGS = ModelArgs(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176, max_seq_len=64)


def test_forward_shape_and_same_seed_same_weights():
    a, b = build_model(ARGS, seed=3), build_model(ARGS, seed=3)
    tokens = torch.randint(0, 256, (2, 16))
    assert a(tokens).shape == (2, 16, 256)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    c = build_model(ARGS, seed=4)
    assert not torch.equal(a.layers["0"].attention.wq.weight, c.layers["0"].attention.wq.weight)


def test_causal_future_tokens_do_not_change_past_logits():
    model = build_model(ARGS, seed=0)
    x = torch.randint(0, 256, (1, 20))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 256
    torch.testing.assert_close(model(x)[0, :10], model(y)[0, :10])
    assert not torch.allclose(model(x)[0, 10:], model(y)[0, 10:])


def test_tied_and_untied_embeddings():
    tied = build_model(ARGS, seed=0)
    assert tied.output.weight is tied.tok_embeddings.weight
    untied = build_model(ModelArgs(**{**ARGS.__dict__, "tie_embeddings": False}), seed=0)
    assert untied.num_params() == tied.num_params() + 256 * 64


def test_pruned_model_runs_as_a_middle_stage():
    """Pipeline stages delete what they do not own; the model code tolerates it."""
    model = build_model(ARGS, seed=0)
    model.tok_embeddings, model.norm, model.output = None, None, None
    h = torch.randn(2, 8, 64)
    assert model(h).shape == (2, 8, 64)


@pytest.mark.parametrize("preset,billions", [("llama-1b", 1.24), ("llama-8b", 8.03), ("llama-70b", 70.55)])
def test_llama_presets_have_published_sizes(preset, billions):
    cfg = config_from_dict({"model": {"preset": preset, "max_seq_len": 8192}, "train": {"seq_len": 128}})
    with torch.device("meta"):
        model = Transformer(model_args(cfg.model, vocab_size=128256))
    assert model.num_params() / 1e9 == pytest.approx(billions, rel=0.01)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_parameter_arithmetic_matches_the_built_model(preset):
    """ModelArgs.num_params (used by the planner and the driver) counts what the module holds."""
    args = model_args(config_from_dict({"model": {"preset": preset}}).model, 256)
    with torch.device("meta"):
        assert args.num_params == Transformer(args).num_params()
