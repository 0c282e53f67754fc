"""Bring your own model on the session's Ray: Hugging Face Llama, GPT-2, sliding-window and MoE
families and a plain nn.Module factory, under dp/ZeRO-3, pp and tp, against one process; loading
that never holds the whole model on a rank; training and export back to a from_pretrained directory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from raymp.checkpoint.export import export_hf_dir  # noqa: E402
from raymp.config import ConfigError, config_from_dict  # noqa: E402
from raymp.models import build_model, model_spec  # noqa: E402
from raymp.models.hf import HFSpec, export_hf, load_hf_config  # noqa: E402
from raymp.reference import train_single_process  # noqa: E402
from raymp.trainer import Trainer  # noqa: E402
from helpers.hf_cases import (  # noqa: E402
    FAMILIES, LLAMA, MOE_FAMILIES, SLIDING, WEIGHT_ATOL, hf_model, hf_run, tokens
)
from helpers.parity import assert_losses_match, check_parity  # noqa: E402

LAYOUTS = {
    "dp2-zero3": {"dp": 2, "zero": 3, "micro_batch_size": 2},
    "pp2": {"dp": 1, "pp": 2, "micro_batch_size": 1, "schedule": "1f1b"},
    "tp2": {"dp": 1, "tp": 2, "micro_batch_size": 2},
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_model_matches_single_process(family, layout, group2, tiny_cfg):
    """5 fp32 steps: losses within 1e-5 relative of the same transformers model trained in one
    process, and the final weights the same."""
    cfg = hf_run(tiny_cfg, {"preset": None, "hf_config": FAMILIES[family]}, LAYOUTS[layout])
    check_parity(cfg, group2, weight_atol=WEIGHT_ATOL)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sliding_window_mistral_matches_single_process(layout, group2, tiny_cfg):
    """Window 16 < seq_len 32: the masks hold under ZeRO-3, on every pipeline stage and under TP."""
    check_parity(hf_run(tiny_cfg, {"hf_config": SLIDING["mistral"]}, LAYOUTS[layout]), group2,
                 weight_atol=WEIGHT_ATOL)


def test_llama_with_sequence_parallelism_matches_single_process(group2, tiny_cfg):
    """Between layers each rank holds half of the sequence; rotary tables and masks are the
    whole sequence's."""
    check_parity(
        hf_run(tiny_cfg, {"hf_config": LLAMA}, {**LAYOUTS["tp2"], "sequence_parallel": True}),
        group2,
        weight_atol=WEIGHT_ATOL,
    )


def test_sliding_qwen2_pp2_tp2_sp_with_document_mask_matches_single_process(group4, tiny_cfg):
    """Everything at once on 4 actors: the last stage's ranks get sequence slices from the first
    stage and must still build masks (sliding window, documents) for the whole sequence."""
    parallel = {
        "dp": 1,
        "pp": 2,
        "tp": 2,
        "sequence_parallel": True,
        "micro_batch_size": 1,
        "schedule": "1f1b",
    }
    check_parity(
        hf_run(tiny_cfg, {"hf_config": SLIDING["qwen2"]}, parallel, data={"document_mask": True}),
        group4,
        weight_atol=WEIGHT_ATOL,
    )


def test_factory_module_under_dp_zero3_pp_and_tp(group2, tiny_cfg):
    """A module raymp has never seen: ZeRO-3 needs nothing of it, the pipeline its stageable
    shape, tensor parallelism the plan named in the config."""
    model = {
        "preset": None,
        "factory": "helpers.custom_model:build",
        "factory_tp_plan": "helpers.custom_model:tp_plan",
    }
    for name in ("dp2-zero3", "pp2", "tp2"):
        check_parity(hf_run(tiny_cfg, model, LAYOUTS[name]), group2, weight_atol=WEIGHT_ATOL)


def test_factory_module_without_the_stageable_shape_cannot_pipeline(tiny_cfg):
    cfg = hf_run(tiny_cfg, {"preset": None, "factory": "helpers.custom_model:build_flat"}, LAYOUTS["pp2"])
    with pytest.raises(ConfigError, match="stageable shape"):
        config_from_dict(cfg)


BIG_LLAMA = dict(model_type="llama", vocab_size=256, hidden_size=512, intermediate_size=1408,
                 num_hidden_layers=16, num_attention_heads=8, num_key_value_heads=4,
                 max_position_embeddings=128)


@pytest.fixture(scope="module")
def big_llama_dir(tmp_path_factory) -> tuple[Path, int]:
    """A 51M-parameter (205 MB fp32) Llama saved as a transformers directory."""
    spec = HFSpec(load_hf_config(None, BIG_LLAMA), None, seed=5)
    model = build_model(spec, 5)
    out = tmp_path_factory.mktemp("big_llama")
    export_hf({k: v.detach() for k, v in model.state_dict().items()}, spec.hf_config, out)
    full_bytes = sum(p.numel() * 4 for p in model.parameters())
    del model
    return out, full_bytes


def test_pp2_tp2_loading_holds_a_quarter_of_the_weights_per_rank(big_llama_dir, ray_local, tiny_cfg):
    """Fresh actors (no freed heap to reuse): each rank's peak memory growth while building and
    loading its part stays near a quarter of the full weights; all-in-one-rank loading (dp=4)
    grows by the whole, so the measurement can tell the two apart. The loaded model's first
    loss is the single-process one on the same weights."""
    from raymp.runtime.actor_group import ActorGroup

    model_dir, full = big_llama_dir
    model = {"preset": None, "hf": str(model_dir)}
    group = ActorGroup(4, "cpu", cpus_per_actor=1, placement_timeout_s=60, collective_timeout_s=120)
    try:
        cfg = hf_run(tiny_cfg, model, {"dp": 1, "pp": 2, "tp": 2, "micro_batch_size": 1}, steps=1)
        with Trainer(cfg, actor_group=group, progress=False).setup() as trainer:
            loads = [info.setup_peak_bytes for info in trainer.session.setup_info]
            loss = trainer.step()["loss"]
        for rank, grew in enumerate(loads):
            assert (
                grew <= 0.40 * full
            ), f"rank {rank} grew {grew / 2**20:.0f} MiB for {full / 2**20:.0f} MiB of weights"
        ref, _ = train_single_process(config_from_dict(cfg), steps=1)
        assert_losses_match([loss], ref, 1e-5)
        whole = hf_run(tiny_cfg, model, {"dp": 4, "micro_batch_size": 1}, steps=1)
        with Trainer(whole, actor_group=group, progress=False).setup() as trainer:
            whole_loads = [info.setup_peak_bytes for info in trainer.session.setup_info]
        print(f"load peak per rank, MiB of {full / 2**20:.0f}: pp2xtp2 {[round(x / 2**20) for x in loads]}, "
              f"dp4 {[round(x / 2**20) for x in whole_loads]}")
        assert min(whole_loads) >= 0.7 * full, whole_loads
    finally:
        group.shutdown()


@pytest.mark.parametrize("family", FAMILIES)
def test_train_pp2_tp2_export_and_reload_in_transformers(family, group4, tiny_cfg, tmp_path):
    """3 steps under pp=2 x tp=2, a checkpoint, `raymp checkpoint export --hf`: transformers'
    from_pretrained gives the trained model's logits."""
    cfg = hf_run(tiny_cfg, {"preset": None, "hf_config": FAMILIES[family]},
                 {"dp": 1, "pp": 2, "tp": 2, "micro_batch_size": 1}, steps=3,
                 checkpoint={"dir": str(tmp_path / "ckpt"), "every": 3, "async_save": False})
    with Trainer(cfg, actor_group=group4, progress=False) as trainer:
        trainer.fit()
        trained = trainer.state_dict()
    if family == "gpt2":  # the command line, given the run's checkpoint dir (takes the latest)
        from raymp.cli import main

        assert (
            main(["checkpoint", "export", str(tmp_path / "ckpt"), "--hf", "--out", str(tmp_path / "hf")]) == 0
        )
    else:
        assert export_hf_dir(str(tmp_path / "ckpt" / "step-00000003"), str(tmp_path / "hf"))["step"] == 3
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
    spec = model_spec(config_from_dict(cfg).model, 256, cfg["seed"])
    initial = build_model(spec, cfg["seed"]).state_dict()
    assert any(not torch.equal(trained[k], initial[k]) for k in initial), "the steps changed nothing"
    mine = build_model(spec, cfg["seed"])
    mine.load_state_dict(trained)
    with torch.no_grad():
        torch.testing.assert_close(hf_model(tmp_path / "hf")(tokens()).logits, mine.eval()(tokens()),
                                   rtol=0, atol=1e-5)


@pytest.mark.parametrize("family,layout", [
    ("mixtral", {"dp": 2, "zero": 3}), ("mixtral", {"dp": 1, "pp": 2}), ("qwen3_moe", {"dp": 1, "pp": 2}),
    # Expert parallelism on transformers' own experts modules (raymp.parallel.experts)
    ("mixtral", {"dp": 2, "ep": 2}), ("qwen3_moe", {"dp": 2, "ep": 2, "zero": 3}),
    ("qwen2_moe", {"dp": 2, "ep": 2, "zero": 1}),
    ("deepseek_v3", {"dp": 2, "ep": 2}), ("deepseek_v3", {"dp": 1, "pp": 2}),
])
def test_moe_family_trains_like_one_process(family, layout, group2, tiny_cfg):
    check_parity(
        hf_run(tiny_cfg, {"hf_config": MOE_FAMILIES[family]}, layout), group2, weight_atol=WEIGHT_ATOL
    )


def test_moe_family_under_ep2_and_pp2_trains_like_one_process(group4, tiny_cfg):
    """Mixtral's experts split over ep2 inside each of two pipeline stages (4 actors)."""
    layout = {"dp": 2, "ep": 2, "pp": 2, "micro_batch_size": 1, "schedule": "1f1b"}
    check_parity(hf_run(tiny_cfg, {"hf_config": MOE_FAMILIES["mixtral"]}, layout), group4,
                 weight_atol=WEIGHT_ATOL)


def test_moe_family_trained_under_ep2_exports_to_from_pretrained(group2, tiny_cfg, tmp_path):
    """A checkpoint whose experts are split over ep2 exports whole: transformers' from_pretrained
    gives the trained model's logits."""
    cfg = hf_run(tiny_cfg, {"hf_config": MOE_FAMILIES["qwen2_moe"]}, {"dp": 2, "ep": 2}, steps=3,
                 checkpoint={"dir": str(tmp_path / "ckpt"), "every": 3, "async_save": False})
    with Trainer(cfg, actor_group=group2, progress=False) as trainer:
        trainer.fit()
        trained = trainer.state_dict()
    assert export_hf_dir(str(tmp_path / "ckpt" / "step-00000003"), str(tmp_path / "hf"))["step"] == 3
    spec = model_spec(config_from_dict(cfg).model, 256, cfg["seed"])
    mine = build_model(spec, cfg["seed"])
    initial = {k: v.clone() for k, v in mine.state_dict().items()}
    experts = "layers.0.mlp.experts.down_proj"
    assert not torch.equal(trained[experts], initial[experts])
    mine.load_state_dict(trained)
    with torch.no_grad():
        torch.testing.assert_close(hf_model(tmp_path / "hf")(tokens()).logits, mine.eval()(tokens()),
                                   rtol=0, atol=1e-5)
