"""The benchmarks compare raymp with peers that must train the same thing. The no-Ray peer
(raymp's rank code in torchrun-style spawned processes) is checked here against the single-process
reference; the benchmark itself is not part of the suite (benchmarks/run_all.py)."""

from __future__ import annotations

import importlib

import pytest

from raymp.config import config_from_dict
from raymp.reference import train_single_process

from benchmarks.common import global_batches
from benchmarks.peers_plain import run_plain


@pytest.mark.parametrize("module", ["run_all", "sections", "elastic", "scale", "driver_overhead", "long_context",
                                    "planner_check", "peers_ray_train",
                                    "peers_plain"])
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
