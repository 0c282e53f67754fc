"""The GPU check (benchmarks/gpu_check.py) needs CUDA to run; what it computes and writes does
not: its arguments, the peak lookup, MFU arithmetic and the BENCHMARKS.md section."""

from __future__ import annotations

import pytest

from benchmarks.common import peak_tflops_of
from benchmarks.gpu_check import (TITLE, TORCHTITAN, _merge, existing_section, guardrail, mfu, options,
                                  replace_section, resolve_gpus, section, the_runs)


def test_arguments_and_gpu_resolution():
    opts = options([])
    assert (opts.preset, opts.seq_len, opts.steps, opts.gpus) == ("llama-1b", 2048, 10, None)
    with pytest.raises(SystemExit):
        options(["--steps", "2"])  # fewer than the two warm-up steps plus one timed
    with pytest.raises(SystemExit, match="torch sees no CUDA device"):
        resolve_gpus(options([]), 0, None)
    opts = resolve_gpus(options(["--gpus", "16"]), 8, "NVIDIA H100 80GB HBM3")
    assert opts.gpus == 8 and opts.peak_tflops == 989.0  # no more GPUs than visible
    assert resolve_gpus(options(["--peak-tflops", "500"]), 1, "Unknown GPU").peak_tflops == 500
    with pytest.raises(SystemExit, match="pass --peak-tflops"):
        peak_tflops_of("Unknown GPU")


def test_mfu_arithmetic():
    # 6 PFLOP per step in 10 s on 2 GPUs of 1000 TFLOP/s peak: 300 TFLOP/s each = 30%.
    assert mfu(6e15, 10.0, 2, 1000.0) == pytest.approx(0.30)


def test_the_section_replaces_its_predecessor_only():
    row = {"run": "raymp dp=1", "gpus": 1, "tokens_per_s": 12345.6, "mfu": 0.412, "vs_plain": 0.97,
           "peak_gib": 30.25, "estimate_gib": 28.0, "first_loss": 10.5, "loss": 9.87654}
    fp8 = {**row, "run": "raymp fp8", "guard": guardrail([10.0, 9.0, 8.0], [10.0, 9.1, 8.1])}
    failed = {"run": TORCHTITAN, "error": "not run: no network"}
    text = section([row, fp8, failed], "setup line", ["a note"])
    assert (
        text.startswith(TITLE)
        and "| raymp dp=1 | 1 | 12,346 | 41.2% | 0.97x | 30.2 | 28.0 | 10.5000 | 9.8765 | - |" in text
    )
    assert "| raymp fp8 | 1 |" in text and "within 3%: last 3 steps 0.74% apart, worst step 1.23%" in text
    assert f"| {TORCHTITAN} | - | - | - | - | - | - | - | - | not run: no network |" in text
    assert text.endswith("- a note\n")
    doc = "# Benchmarks\n\n## 1. Data parallel\n\nrows\n"
    once = replace_section(doc, text)
    assert once.startswith(doc.rstrip("\n")) and once.endswith(text)
    again = replace_section(once + "\n## 2. Next\n\nmore\n", section([{**row, "mfu": 0.5}], "setup line"))
    assert again.count(TITLE) == 1 and "50.0%" in again and "41.2%" not in again and "## 2. Next" in again
    assert existing_section(again).startswith(TITLE) and "## 2. Next" not in existing_section(again)
    assert existing_section(doc) is None


def test_run_all_update_replaces_the_named_sections_in_place(tmp_path):
    from benchmarks.run_all import _options, _section_lines

    result = {
        "title": "2. Next",
        "setup": "new setup",
        "columns": ["a"],
        "rows": [[1]],
        "notes": [],
        "wall_s": 3,
    }
    doc = "# Benchmarks\n\n## 1. First\n\nrows\n\n## 2. Next\n\nold\n\n## 3. Last\n\nmore\n"
    new = replace_section(doc, "\n".join(_section_lines(result, "; regenerated")) + "\n", "## 2. Next")
    assert (
        "old" not in new
        and "new setup" in new
        and "_Section wall time: 3 s; regenerated._\n\n## 3. Last" in new
    )
    assert new.startswith("# Benchmarks\n\n## 1. First\n\nrows\n\n## 2. Next\n")
    with pytest.raises(SystemExit):  # nothing to update in place
        _options(["--only", "elastic", "--update", "--out", str(tmp_path / "missing.md")])


def test_fp8_guardrail_band():
    assert guardrail([5.0, 4.0, 3.0, 2.0], [5.0, 4.0, 3.0, 2.0]) == {
        "worst_step": 0.0,
        "end": 0.0,
        "within": True,
    }
    far = guardrail([5.0, 4.5, 4.0, 3.5], [5.0, 4.0, 3.0, 2.0])
    assert (
        not far["within"]
        and far["end"] == pytest.approx(3.0 / 9.0)
        and far["worst_step"] == pytest.approx(0.75)
    )


def test_runs_most_important_first_and_configs_that_validate(tmp_path):
    from benchmarks.common import run_config
    from raymp.config import config_from_dict

    opts = resolve_gpus(options([]), 1, "NVIDIA H100 80GB HBM3")
    runs = the_runs(opts)
    assert list(runs)[:4] == ["plain torch loop (1 process), bf16 eager", "raymp dp=1, bf16 compiled",
                              f"{TORCHTITAN}, bf16 compiled", "raymp dp=1, fp8 tensorwise compiled"]
    assert f"{TORCHTITAN}, fp8 rowwise compiled" in runs
    assert not any(name.startswith(TORCHTITAN) for name in the_runs(resolve_gpus(
        options(["--skip-torchtitan", "not installed"]), 1, "NVIDIA H100")))
    only = the_runs(resolve_gpus(options(["--only", "fp8", "bf16 compiled"]), 1, "NVIDIA H100"))
    assert list(only) == ["plain torch loop (1 process), bf16 eager", "raymp dp=1, bf16 compiled",
                          f"{TORCHTITAN}, bf16 compiled", "raymp dp=1, fp8 tensorwise compiled",
                          "raymp dp=1, fp8 rowwise compiled", f"{TORCHTITAN}, fp8 rowwise compiled"]
    assert not any("ZeRO-3" in name for name in runs)  # one GPU: no dp=N run
    assert any("ZeRO-3" in name for name in the_runs(resolve_gpus(options([]), 2, "NVIDIA H100")))
    for name, (gpus, _, changes) in runs.items():
        cfg = _merge(
            run_config(
                "x",
                str(tmp_path),
                preset="llama-1b",
                seq_len=2048,
                device="cuda",
                precision="bf16",
                global_batch=4,
                micro_batch=4,
            ),
            changes,
        )
        parsed = config_from_dict(cfg)  # every run's config passes raymp's own rules
        assert parsed.precision == ("fp8" if "fp8" in name else "bf16")
        assert parsed.train.compile is (
            False if "eager" in name and "raymp" in name else True if "raymp" in name else None
        )
    assert config_from_dict(_merge(run_config("x", str(tmp_path), device="cuda", precision="bf16"),
                                   runs["raymp dp=1, fp8 rowwise compiled"][2])).float8.recipe == "rowwise"


def test_torchtitan_log_lines_give_the_timed_row():
    from benchmarks.torchtitan_peer import parse_log, summarize

    lines = [
        f"[rank0]:[titan] 2026-11-27 01:00:0{s},000 - root - INFO - \x1b[31mstep: {s:2}  \x1b[32mloss: {12 - s:8.5f}  "
        f"grad_norm:  1.2345  memory: {30 + s:5.2f}GiB(38.00%)  tps: {40000 + 1000 * s:,}  tflops: 300.00  mfu: 30.00%"
        for s in range(1, 6)
    ]
    rows = parse_log("\n".join(["noise", *lines, "[rank0]: Training completed"]))
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and rows[2]["loss"] == 9.0 and rows[4]["tps"] == 45000
    row = summarize(rows, batch=4, seq_len=2048)
    assert (
        row["step_s"] == pytest.approx(4 * 2048 / 44000)
        and row["peak_gib"] == 35.0
        and row["losses"][0] == 11.0
    )
    with pytest.raises(RuntimeError, match="logged 2 training steps"):
        summarize(rows[:2], 4, 2048)


def test_a_failed_torchtitan_run_is_named_by_its_exception_line():
    from benchmarks.torchtitan_peer import failure_line

    log = ("Traceback (most recent call last):\n  File \"x.py\", line 1\n"
           "ImportError: cannot import name 'DataParallelMeshDims' from 'torch.distributed.fsdp'\n"
           "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
           "============================================================\n")
    assert failure_line(log).startswith("ImportError: cannot import name 'DataParallelMeshDims'")
    assert failure_line("just output\n====\n") == "===="


def test_torchtitan_gets_a_stand_in_only_for_a_torch_name_it_lacks(tmp_path, monkeypatch, capsys):
    import torch.distributed.fsdp as fsdp

    from benchmarks import torchtitan_peer

    (tmp_path / "peer_needs_new_torch.py").write_text(
        "from torch.distributed.fsdp import fully_shard, RaympCheckMissingName\n"
    )
    (tmp_path / "peer_needs_other.py").write_text("from raymp import RaympCheckMissingName\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert torchtitan_peer.import_with_stand_ins("peer_needs_new_torch") == [
            "torch.distributed.fsdp.RaympCheckMissingName"
        ]
        with pytest.raises(RuntimeError, match="used torch.distributed.fsdp.RaympCheckMissingName"):
            fsdp.RaympCheckMissingName(shard="dp_shard")
    finally:
        del fsdp.RaympCheckMissingName
    with pytest.raises(ImportError, match="from 'raymp'"):  # only torch's names get stand-ins
        torchtitan_peer.import_with_stand_ins("peer_needs_other")
    log = "step:  1 ...\n" + capsys.readouterr().out
    assert torchtitan_peer.stand_ins(log) == ["torch.distributed.fsdp.RaympCheckMissingName"]


def test_create_block_mask_takes_torchtitan_s_argument_only_where_torch_lacks_it(monkeypatch, capsys):
    import torch.nn.attention.flex_attention as flex

    from benchmarks import torchtitan_peer

    calls = []

    def old_create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device="cuda"):
        calls.append((B, Q_LEN, device))
        return "mask"

    monkeypatch.setattr(flex, "create_block_mask", old_create_block_mask)
    assert torchtitan_peer.accept_separate_full_blocks().startswith("create_block_mask(separate_full_blocks=True)")
    assert flex.create_block_mask(None, 2, None, 8, 8, device="cpu", separate_full_blocks=True) == "mask"
    assert calls == [(2, 8, "cpu")]
    with pytest.raises(RuntimeError, match="unseparated full blocks"):
        flex.create_block_mask(None, 2, None, 8, 8, separate_full_blocks=False)
    assert torchtitan_peer.stand_ins(capsys.readouterr().out)[0].startswith("create_block_mask(")

    def new_create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device="cuda", separate_full_blocks=True):
        return "mask"

    monkeypatch.setattr(flex, "create_block_mask", new_create_block_mask)
    assert torchtitan_peer.accept_separate_full_blocks() is None and flex.create_block_mask is new_create_block_mask
