"""The benchmarks compare raymp with peers that must train the same thing. The no-Ray peer
(raymp's rank code in torchrun-style spawned processes) is checked here against the single-process
reference; the benchmark itself is not part of the suite (benchmarks/run_all.py)."""

from __future__ import annotations

import importlib

import pytest

from raymp.config import config_from_dict
from raymp.reference import train_single_process

from benchmarks.common import global_batches
from benchmarks.peers_plain import run_plain, run_plain_dp


@pytest.mark.parametrize(
    "module",
    [
        "run_all",
        "sections",
        "elastic",
        "scale",
        "driver_overhead",
        "long_context",
        "planner_check",
        "peers_ray_train",
        "peers_plain",
        "plain_loop",
        "rank_step",
        "save_stall",
    ],
)
def test_benchmark_modules_import(module):
    importlib.import_module(f"benchmarks.{module}")


def test_plain_process_peer_trains_like_the_single_process_run(tiny_cfg):
    cfg = tiny_cfg(parallel={"dp": 1, "pp": 2, "schedule": "1f1b", "micro_batch_size": 2},
                   train={"steps": 3})
    batches, vocab = global_batches(cfg)
    plain = run_plain(cfg, batches, vocab)
    reference, _ = train_single_process(config_from_dict(cfg))
    assert len(plain["losses"]) == len(reference) == 3
    for a, b in zip(plain["losses"], reference):
        assert abs(a - b) <= 1e-5 * abs(b)
    assert len(plain["step_times"]) == 2 and all(t > 0 for t in plain["step_times"])


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_plain_torch_peer_trains_like_the_single_process_run(tiny_cfg, mode):
    """The plain-loop peer (torch's DDP / FSDP2 tutorial loop in spawned processes) at dp=2."""
    cfg = tiny_cfg(parallel={"dp": 2, "zero": 3 if mode == "fsdp2" else 0}, train={"steps": 3})
    batches, vocab = global_batches(cfg)
    plain = run_plain_dp(cfg, batches, vocab, mode, 2)
    reference, _ = train_single_process(config_from_dict(cfg))
    for a, b in zip(plain["losses"], reference, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b)


def test_scale_says_in_numbers_what_zero3_cannot_shard():
    """Issue 22: the scale section explains a gain below 7x with per-rank numbers (the arithmetic,
    on the sizes BENCHMARKS.md measured: 19.6M on 1 actor at 506 MiB, 107.6M on 8 at 501 MiB)."""
    from benchmarks.scale import _params, shape, unsharded_note

    one = {"params": _params(shape(448, 8)), "peak_over_base": 506 * 2**20, "dim": 448, "layers": 8}
    eight = {"params": _params(shape(896, 12)), "peak_over_base": 501 * 2**20, "dim": 896, "layers": 12}
    note = unsharded_note(one, eight, 512)
    assert "model state 299 MiB, the rest 207 MiB" in note  # 16 bytes per parameter on one actor
    assert "sharded state 205 MiB, one gathered block and its gradient 68 MiB, the rest 228 MiB" in note
    assert "262 + 87 + 228 = 577 MiB per rank against the 512 MiB cap" in note


def test_in_run_save_cost_prices_the_intervals_of_each_save():
    """A save every 5 steps that adds 0.25 s to the interval after it, or to its own step's
    (riding on the step's call), on 1 s steps: 0.25 s lost per save, 5% a step, whatever the
    run's other intervals do by a little."""
    from benchmarks.recovery import in_run_cost

    for lands in (0, 1):  # the save after step 4 costs in step 4's interval, or in step 5's
        done, t = [], 0.0
        for step in range(24):
            t += 1.0 + (0.25 if step > 1 and (step - lands) % 5 == 4 else 0.0) + (0.01 if step % 2 else -0.01)
            done.append({"finished_at": t})
        cost = in_run_cost(done, 5)
        assert cost["fraction"] == pytest.approx(0.05, abs=0.004), lands
        assert cost["stall_s"] == pytest.approx(0.25, abs=0.02), lands
