"""A rank's step does measurement work only on the steps that report it (train.memory_every):
counted calls, not time. One in-process Worker on a one-rank gloo group, no Ray."""

from __future__ import annotations


import numpy as np
import pytest

from raymp.config import config_from_dict
from raymp.parallel.pipeline import ActivationMeter
from raymp.parallel.zero import DataParallelEngine
from raymp.runtime.report import measures_memory
from raymp.runtime.worker import Worker
from helpers.ports import free_port


class _Batches:
    """Stands in for the data stream: fixed random tokens for every step."""

    def __init__(self, steps: int, rows: int, seq_len: int):
        rng = np.random.default_rng(0)
        self.batches = [rng.integers(0, 256, (rows, seq_len + 1)) for _ in range(steps)]

    def next(self, step: int):
        return np.arange(len(self.batches[step])), self.batches[step], 0.0

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def worker():
    w = Worker(1)
    w.init_distributed(0, 1, "127.0.0.1", free_port(), "gloo", 60)
    yield w
    w.shutdown()


def _config(tmp_path, steps: int, memory_every: int):
    return config_from_dict({
        "name": "rank-step", "output_dir": str(tmp_path), "model": {"preset": "tiny"},
        "parallel": {"dp": 1, "micro_batch_size": 2},
        "train": {"steps": steps, "global_batch_size": 4, "seq_len": 32, "memory_every": memory_every},
        "optimizer": {"warmup_steps": 1}, "tracking": {"enabled": False}, "resources": {"device": "cpu"},
    })


@pytest.mark.parametrize("every, measured", [(0, {0, 5}), (2, {0, 1, 3, 5}), (1, set(range(6)))])
def test_measurement_runs_only_on_the_steps_that_report_it(worker, tmp_path, monkeypatch, every, measured):
    calls = {"counting": [], "state_bytes": []}
    step_now = [None]

    def counted(name, original):
        def wrapper(self, *args, **kwargs):
            calls[name].append(step_now[0])
            return original(self, *args, **kwargs)
        return wrapper

    monkeypatch.setattr(ActivationMeter, "_counting", counted("counting", ActivationMeter._counting))
    monkeypatch.setattr(
        DataParallelEngine, "state_bytes", counted("state_bytes", DataParallelEngine.state_bytes)
    )
    worker.setup(_config(tmp_path, 6, every), 256)
    worker.stream = _Batches(6, 4, 32)
    reports = []
    for step in range(6):
        step_now[0] = step
        reports.append(worker.train_step(step))
    # Two micro-batches: the model's forward and the loss's each open counting hooks once per micro-batch.
    assert set(calls["counting"]) == measured and len(calls["counting"]) == 4 * len(measured)
    assert calls["state_bytes"] == sorted(measured)
    for step, report in enumerate(reports):
        taken = max(s for s in measured if s <= step)
        assert report.memory_step == taken
        assert report.activation_peak_bytes > 0 and report.param_bytes > 0


def test_the_memory_rule():
    assert [s for s in range(10) if measures_memory(s, s == 0, 10, 4)] == [0, 3, 7, 9]
    assert [s for s in range(10) if measures_memory(s, False, 10, 0)] == [9]


def test_the_gradient_norm_is_exact_at_float32_speed():
    """A 3e7-element gradient: CPU's float32 norm kernel, whole, is far off (it sums one square
    after another); the engine's norm, from 64 Ki-element views, is within 1e-6 of float64."""
    import torch

    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.zeros(30_000_000)), torch.nn.Parameter(torch.zeros(3, 5))]
    for w in weights:
        w.grad = torch.randn(w.shape) * 1e-3 + 1e-4
    exact = float(torch.sqrt(sum(w.grad.double().square().sum() for w in weights)))
    whole = float(torch.linalg.vector_norm(weights[0].grad))  # the big one alone is already off
    assert abs(whole - float(weights[0].grad.double().norm())) / whole > 1e-4

    engine = DataParallelEngine()
    engine.optimizer = torch.optim.SGD(weights, lr=0.1)
    engine.device = torch.device("cpu")
    before = [w.grad.clone() for w in weights]
    norm = engine.clip_grad_norm(None, copies=1)
    assert abs(norm - exact) / exact < 1e-6
    assert all(torch.equal(w.grad, b) for w, b in zip(weights, before))  # no clip asked for
    assert abs(engine.clip_grad_norm(norm / 2, copies=1) - exact) / exact < 1e-6
    assert (
        abs(float(torch.sqrt(sum(w.grad.double().square().sum() for w in weights))) - norm / 2) / norm < 1e-5
    )
