"""The planner: ZeRO formulas, the seed's 7B example, step-time prices, plans for 70B and 175B,
calibration, and `raymp plan`."""

from __future__ import annotations

import pytest

from raymp.config import ConfigError, config_from_dict
from raymp.layout import Layout
from raymp.models import model_args
from raymp.planner import estimate, explain, plan, zero_model_states
from raymp.step_time import Cluster, calibrate_cost_factors, cluster_from_config, step_flops, step_seconds
from helpers.cli import raymp
from helpers.cli import ROOT

GB = 1e9


@pytest.mark.parametrize("n", [2, 8, 64])
def test_zero_formulas_with_mixed_precision_adam(n):
    psi = 1e9
    totals = [zero_model_states(psi, stage, n)["total"] for stage in range(4)]
    assert totals == pytest.approx([16 * psi, 4 * psi + 12 * psi / n, 2 * psi + 14 * psi / n, 16 * psi / n])


def test_seed_7b_example_per_gpu_on_8_gpus():
    """The seed: 7B fp32 -> weights 28 GB, gradients 28 GB, Adam 56 GB, activations 10 GB."""
    psi, n = 7e9, 8
    fp32 = dict(param_bytes=4, grad_bytes=4, optimizer_bytes=8)
    s0 = zero_model_states(psi, 0, n, **fp32)
    assert (s0["params"], s0["grads"], s0["optimizer"]) == (28 * GB, 28 * GB, 56 * GB)
    assert zero_model_states(psi, 1, n, **fp32)["optimizer"] == 7 * GB  # "56 GB / 8 GPUs = 7 GB"
    s2 = zero_model_states(psi, 2, n, **fp32)
    assert s2["grads"] + s2["optimizer"] == 10.5 * GB  # "84 GB / 8 = 10.5 GB"
    activations_per_gpu = 10 * GB / n  # data parallel splits the batch, and so its activations
    total = zero_model_states(psi, 3, n, **fp32)["total"] + activations_per_gpu
    assert total == pytest.approx(122 * GB / n) and round(total / GB) == 15  # "122 GB / 8 = 15 GB"


def _args(preset, vocab=256):
    return model_args(config_from_dict({"model": {"preset": preset}}).model, vocab)


def test_llama_70b_on_64_gpus_of_80_gb_has_a_fitting_plan():
    cluster = Cluster(nodes=8, gpus_per_node=8, gpu_memory_gb=80)
    result = plan(_args("llama-70b", 128256), cluster, global_batch=512, seq_len=4096)
    best = result.best
    assert best is not None and best.fits and best.peak_bytes <= 0.9 * 80 * GB
    lay = best.layout
    assert lay.dp * lay.pp * lay.tp == 64 and lay.tp <= 8
    # Plain data parallelism cannot hold 70B: 16 bytes x 70B / 64 at best still leaves no room.
    assert not any(
        c.fits for c in result.candidates if c.layout.pp == 1 and c.layout.tp == 1 and c.layout.zero < 3
    )


@pytest.mark.unit
def test_step_time_prices_pipeline_transfers_and_message_latency():
    """Issue 22: the step-time model ignored pipeline activation transfers, so `parallel: auto`
    chose the deepest pipeline for a small model (pp=8 tp=2 for `small` on 2 x 8 devices)."""
    cluster = Cluster(nodes=2, gpus_per_node=8, gpu_memory_gb=80)
    args = _args("small", 256)
    shallow, deep = (step_seconds(args, Layout(dp=16 // pp, pp=pp, tp=1, zero=1 if pp < 16 else 0,
                                               micro_batch_size=1), cluster, 64, 128) for pp in (2, 8))
    assert shallow["pp_comm_s"] > 0 and deep["pp_comm_s"] > 2 * shallow["pp_comm_s"]
    best = plan(args, cluster, global_batch=16, seq_len=128).best.layout
    assert best.pp < 8 and best.dp > 1, best


def test_context_parallel_divides_activations_and_prices_its_all_to_alls():
    cluster = Cluster(nodes=1, gpus_per_node=8, gpu_memory_gb=80)
    args = _args("llama-8b", 128256)
    whole, split = (Layout(dp=8 // cp, zero=3, cp=cp, activation_checkpointing=True) for cp in (1, 4))
    a, b = (estimate(args, lay, 8, 32768, True)[0] for lay in (whole, split))
    assert b.activation_bytes == pytest.approx(a.activation_bytes / 4)
    # ZeRO-3 shards over dp x cp = 8 either way:
    assert b.model_state_bytes == pytest.approx(a.model_state_bytes)
    t_whole, t_split = (step_seconds(args, lay, cluster, 8, 32768) for lay in (whole, split))
    assert t_whole["cp_comm_s"] == 0 < t_split["cp_comm_s"]


def test_hsdp_shards_inside_the_node_and_is_proposed_across_nodes():
    cluster = Cluster(nodes=2, gpus_per_node=8, gpu_memory_gb=80)
    args = _args("llama-8b", 128256)
    fsdp, hsdp = (Layout(dp=16, zero=3, dp_replicate=r) for r in (1, 2))
    a, b = (estimate(args, lay, 32, 4096, True)[0] for lay in (fsdp, hsdp))
    assert b.model_state_bytes == pytest.approx(2 * a.model_state_bytes)  # shards over 8, not 16
    # Its gathers and reduce-scatters stay inside a node; only sharded gradients cross nodes.
    t_fsdp, t_hsdp = (step_seconds(args, lay, cluster, 32, 4096)["dp_comm_s"] for lay in (fsdp, hsdp))
    assert t_hsdp < t_fsdp
    judged = plan(args, cluster, 32, 4096).candidates
    assert any(c.layout.dp_replicate == 2 for c in judged)


def test_expert_parallelism_shards_experts_prices_its_all_to_alls_and_is_proposed():
    """Qwen3-30B-A3B on 8 GPUs of 80 GB: with ep each rank holds its share of the 128 experts'
    state (sharded again by ZeRO over the ranks holding the same), and the planner proposes it."""
    args = _args("qwen3-30b-a3b", 151936)
    cluster = Cluster(nodes=1, gpus_per_node=8, gpu_memory_gb=80)
    experts = sum(args.routed_expert_params(i) for i in range(args.n_layers))
    plain, ep = (estimate(args, Layout(dp=8, zero=3, ep=e), 64, 4096, True)[0] for e in (1, 8))
    # ZeRO-3 over 8 ranks shards everything 8 ways either way; ep 8 moves experts, not memory.
    assert ep.params_bytes == pytest.approx(plain.params_bytes)
    zero0 = [estimate(args, Layout(dp=8, ep=e), 64, 4096, True)[0] for e in (1, 8)]
    assert zero0[0].params_bytes - zero0[1].params_bytes == pytest.approx(4 * experts * 7 / 8)
    t = step_seconds(args, Layout(dp=8, zero=2, ep=8), cluster, 64, 4096)
    assert t["ep_comm_s"] > 0 == step_seconds(args, Layout(dp=8, zero=2), cluster, 64, 4096)["ep_comm_s"]
    feasible = plan(args, cluster, 64, 4096).feasible
    assert any(c.layout.ep > 1 for c in feasible[:3])


def test_tensor_parallelism_leaves_moe_feed_forwards_whole():
    """TP splits attention, dense MLPs and the vocabulary; every tp rank runs an MoE feed-forward
    whole (raymp.models.llama_tp), so the planner keeps its parameters on each rank and prices
    its compute once per tp rank."""
    args = _args("qwen3-30b-a3b", 151936)
    whole = sum(args.tp_whole_params(i) for i in range(args.n_layers))
    assert whole > 0.9 * args.num_params
    one, two = (estimate(args, Layout(tp=tp), 8, 4096, True)[0] for tp in (1, 2))
    split = 1 - whole / args.num_params  # the share tp 2 halves (the norms' few weights aside)
    assert 1 - two.params_bytes / one.params_bytes == pytest.approx(split / 2, rel=0.01)
    cluster = Cluster(nodes=1, gpus_per_node=8, gpu_memory_gb=80)
    moe_share = 6 * 8 * 4096 * args.n_layers * args.moe.layer_params(args.dim)[1] / step_flops(args, 8, 4096)
    for a, speedup in ((_args("small"), 2.0), (args, 2 / (1 + moe_share))):
        t1, t2 = (step_seconds(a, Layout(tp=tp), cluster, 8, 4096)["compute_s"] for tp in (1, 2))
        assert t1 / t2 == pytest.approx(speedup)


def test_gpt3_175b_plan_explains_the_seed_layout():
    cluster = Cluster(nodes=8, gpus_per_node=8, gpu_memory_gb=80)
    args = _args("gpt3-175b", 50304)
    result = plan(args, cluster, global_batch=256, seq_len=2048)
    assert result.best is not None and result.best.fits
    seed = Layout(dp=8, pp=4, tp=2, zero=2, micro_batch_size=1)
    text = explain(args, seed, cluster, 256, 2048, True, result)
    assert "dp=8 pp=4 tp=2 zero=2" in text and "does NOT fit" in text
    assert "zero=3, activation_checkpointing=True" in text and "(fits)" in text
    # The seed layout's model states alone exceed an 80 GB GPU, as the ZeRO-2 formula says too.
    per_rank = estimate(args, seed, 256, 2048, True)
    assert max(r.model_state_bytes + r.buffer_bytes for r in per_rank) > 80 * GB
    psi_rank = 174.6e9 / (4 * 2)
    assert zero_model_states(psi_rank, 2, 8)["total"] > 80 * GB


def test_plan_command():
    out = raymp("plan", "--model", "llama-70b", "--nodes", "8", "--gpus-per-node", "8",
                "--gpu-memory-gb", "80", "--global-batch", "512", "--seq-len", "4096",
                "--compare", "dp=64,zero=3")
    assert out.returncode == 0, out.stderr
    assert "70.55B parameters on 8 x 8 devices of 80 GB" in out.stdout
    assert "layouts fit. Best first:" in out.stdout and "Compared layout dp=64 pp=1 tp=1 zero=3" in out.stdout


@pytest.mark.parametrize("compare,expected", [
    ("dp=8,zreo=3", "unknown key 'zreo'"), ("dp=8,sp=maybe", "sp=maybe is not true/false"),
    ("dp=eight", "dp=eight is not a whole number"), ("dp=8,zero", "'zero' is not key=value"),
])
def test_plan_compare_refuses_what_it_does_not_know(compare, expected):
    out = raymp("plan", "--model", "tiny", "--compare", compare)
    assert out.returncode == 2 and out.stdout == "", out.stdout
    assert len(out.stderr.strip().splitlines()) == 1 and f"--compare {compare!r}: {expected}" in out.stderr


def test_plan_compare_reads_yes_and_1_as_true():
    out = raymp("plan", "--model", "tiny", "--compare", "tp=2,sp=1,ac=yes")
    assert out.returncode == 0, out.stderr
    assert "Compared layout dp=1 pp=1 tp=2 zero=0 mbs=1 +AC +SP" in out.stdout, out.stdout


def test_plan_compare_takes_expert_parallelism():
    out = raymp("plan", "--model", "qwen3-30b-a3b", "--nodes", "1", "--gpus-per-node", "8", "--gpu-memory-gb",
                "80", "--global-batch", "64", "--seq-len", "4096", "--compare", "dp=8,ep=8,zero=2,ac=1")
    assert out.returncode == 0, out.stderr
    assert "Compared layout dp=8 (ep=8) pp=1 tp=1 zero=2" in out.stdout, out.stdout


def test_plan_compare_takes_hsdp_and_its_rules():
    """dp_replicate is compared like the other keys, and the HSDP rules judge it (ep inside a group)."""
    cluster = ("--model", "qwen3-30b-a3b", "--nodes", "2", "--gpus-per-node", "8", "--gpu-memory-gb", "80",
               "--global-batch", "64", "--seq-len", "4096")
    out = raymp("plan", *cluster, "--compare", "dp=16,dp_replicate=2,ep=8,zero=3,ac=1")
    assert out.returncode == 0, out.stderr
    assert "Compared layout dp=16 (2x8 HSDP) (ep=8)" in out.stdout, out.stdout
    out = raymp("plan", *cluster, "--compare", "dp=16,dp_replicate=4,ep=8,zero=3")
    assert out.returncode == 0, out.stderr
    assert "cannot run: parallel.ep (8) must divide each HSDP group's ranks" in out.stdout, out.stdout


def test_plan_of_a_config_explains_its_own_layout_first():
    out = raymp("plan", "configs/tiny-pipeline.yaml")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[1].startswith("This config's layout dp=2 pp=2 tp=1 zero=2"), out.stdout
    assert any("layouts fit. Best first:" in line for line in lines[2:]), out.stdout
    assert "Compared layout" not in out.stdout, out.stdout  # no --compare: nothing else is compared


def test_plan_of_a_hugging_face_config_at_another_seq_len():
    """model.max_seq_len is the Hugging Face config's max_position_embeddings: never written."""
    out = raymp("plan", "configs/tiny-hf-llama.yaml", "--seq-len", "64")
    assert out.returncode == 0, out.stderr
    assert "global batch 16 x 64 tokens" in out.stdout, out.stdout
    assert "This config's layout dp=" in out.stdout, out.stdout


CALIBRATION_LAYOUTS = [
    Layout(dp=2),
    Layout(dp=2, zero=3),
    Layout(dp=2, zero=1, activation_checkpointing=True),
    Layout(pp=2, micro_batch_size=2),
    Layout(tp=2),
    Layout(tp=2, sequence_parallel=True),
    Layout(cp=2),
]


def test_cost_factors_scale_only_their_mechanisms_price():
    args = _args("small", 256)
    plain = Cluster(nodes=1, gpus_per_node=2)
    scaled = Cluster(nodes=1, gpus_per_node=2, cost_factors={"tp": 3.0, "fsdp": 0.0})
    a, b = (step_seconds(args, Layout(tp=2), c, 16, 128) for c in (plain, scaled))
    assert b["tp_comm_s"] == pytest.approx(3 * a["tp_comm_s"]) and b["compute_s"] == a["compute_s"]
    sp = step_seconds(args, Layout(tp=2, sequence_parallel=True), scaled, 16, 128)
    assert sp["tp_comm_s"] == pytest.approx(a["tp_comm_s"])  # "sp" has no factor: as priced
    assert step_seconds(args, Layout(dp=2, zero=3), scaled, 16, 128)["dp_comm_s"] == 0


def test_calibration_recovers_each_mechanisms_factor_from_measured_steps():
    """Measured steps made from known factors give those factors back: cp's from the one layout
    that uses it, after ddp's (cp2 also reduces gradients), each mechanism's error its own."""
    args = _args("small", 256)
    priced = Cluster(nodes=1, gpus_per_node=2)
    truth = {"ddp": 4.0, "fsdp": 9.0, "tp": 8.0, "sp": 13.0, "cp": 5.0, "pp": 20.0}
    true_cluster = Cluster(nodes=1, gpus_per_node=2, cost_factors=truth)
    samples = [
        (
            lay,
            step_seconds(args, lay, priced, 8, 128),
            step_seconds(args, lay, true_cluster, 8, 128)["step_s"],
        )
        for lay in CALIBRATION_LAYOUTS
    ]
    assert calibrate_cost_factors(samples) == pytest.approx(truth)
    # A mechanism that cost less than its compute estimate left over is free, not negative.
    cheap = [(lay, est, est["compute_s"] * 0.9) for lay, est, _ in samples[:1]]
    assert calibrate_cost_factors(cheap) == {"ddp": 0.0}


def test_a_configs_cost_factors_reach_the_planner_and_bad_ones_are_named():
    cfg = config_from_dict({"cluster": {"nodes": 1, "gpus_per_node": 2, "cost_factors": {"tp": 8}}})
    assert cluster_from_config(cfg.cluster).cost_factors == {"tp": 8.0}
    with pytest.raises(ConfigError, match=r"cluster\.cost_factors.*unknown mechanism zero3.*ddp, fsdp"):
        config_from_dict({"cluster": {"cost_factors": {"zero3": 2}}})
    with pytest.raises(ConfigError, match=r"cluster\.cost_factors.*tp is below 0"):
        config_from_dict({"cluster": {"cost_factors": {"tp": -1}}})


def test_the_readme_plan_examples_are_what_raymp_plan_prints():
    """README's planner examples are generated (scripts/plan_examples.py --write): current, and
    the same figures as the command they quote."""
    import re
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "plan_examples.py"), "--check"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    quoted = re.search(r"Llama 70B .*?: (\d+ of \d+ layouts fit)", (ROOT / "README.md").read_text()).group(1)
    cli = raymp(
        "plan",
        "--model",
        "llama-70b",
        "--nodes",
        "8",
        "--gpus-per-node",
        "8",
        "--gpu-memory-gb",
        "80",
        "--global-batch",
        "512",
        "--seq-len",
        "4096",
        "--top",
        "1",
    )
    assert f"{quoted}. Best first:" in cli.stdout, cli.stdout


def test_a_saved_calibration_prices_the_next_plan_of_the_same_cluster(tmp_path, capsys):
    """What a layout search measured (raymp.calibration) prices the plans made for the config
    after it: `raymp plan` says so, and `parallel: auto` ranks by it. Not for another shape of
    cluster, not over the config's own cost_factors, not from a file it cannot read."""
    import yaml

    from raymp.calibration import CALIBRATION_FILE, Calibration, planning_cluster, save_calibration
    from raymp.cli import main
    from raymp.config import config_from_dict
    from raymp.step_time import cluster_from_config

    def cfg(**cluster):
        return {"model": {"preset": "tiny"}, "train": {"global_batch_size": 8, "seq_len": 32},
                "cluster": {"nodes": 1, "gpus_per_node": 4, "gpu_memory_gb": 4, **cluster},
                "output_dir": str(tmp_path), "parallel": "auto"}

    before = config_from_dict(cfg()).parallel.layout
    cluster = config_from_dict(cfg()).cluster
    assert planning_cluster(cluster, str(tmp_path)) == (cluster_from_config(cluster), None)
    save_calibration(str(tmp_path), Calibration(1, 4, 0.01, {"ddp": 1e6, "fsdp": 1e6}, "now", ["dp=4"]))
    priced, note = planning_cluster(cluster, str(tmp_path))
    assert priced.gpu_tflops == 0.01 and priced.achievable_mfu == 1.0
    assert priced.cost_factors == {"ddp": 1e6, "fsdp": 1e6} and "priced as measured on this cluster" in note
    # Data parallelism priced a million times its bytes: auto now picks a layout without it.
    assert before.dp == 4 and config_from_dict(cfg()).parallel.layout.dp == 1
    assert planning_cluster(config_from_dict(cfg(gpus_per_node=8)).cluster, str(tmp_path))[1] is None
    assert planning_cluster(config_from_dict(cfg(cost_factors={"tp": 2.0})).cluster, str(tmp_path))[1] is None
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in cfg().items() if k != "parallel"}))
    assert main(["plan", str(path)]) == 0
    assert "priced as measured on this cluster" in capsys.readouterr().out
    (tmp_path / CALIBRATION_FILE).write_text("{not json")
    assert planning_cluster(cluster, str(tmp_path))[1] is None
