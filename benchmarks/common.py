"""What every peer comparison shares: one training definition (model, data, global batch, seed),
the exact global batches raymp would read, timing statistics, and the machine's description.

A peer trains the same thing as raymp only if it sees the same tokens in the same order from
the same initial weights; `global_batches` reads them through raymp's own order, and each
comparison checks the peers' losses against raymp's, so "same training" is measured, not assumed.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(REPO, ".raymp_cache")


def importable_benchmarks() -> None:
    """Ray workers (actors, Ray Train workers) start from the raylet's environment: put the
    repository on PYTHONPATH before Ray starts, so they can import `benchmarks.*` by name."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if REPO not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([REPO, *paths])
    if REPO not in sys.path:
        sys.path.insert(0, REPO)


def run_config(name: str, out_dir: str, *, preset: str = "small", steps: int = 8, global_batch: int = 16,
               seq_len: int = 128, dp: int = 1, pp: int = 1, zero: int = 0, micro_batch: int | None = None,
               cpus_per_actor: float = 0.5, device: str = "cpu", precision: str = "fp32", **sections) -> dict:
    """A raymp config dict for one benchmark run; peers derive their training from the same dict."""
    cfg = {
        "name": name, "seed": 7, "output_dir": out_dir, "precision": precision,
        "model": {"preset": preset},
        "parallel": {"dp": dp, "pp": pp, "zero": zero,
                     "micro_batch_size": micro_batch or global_batch // (dp * (2 * pp if pp > 1 else 1))},
        "train": {"steps": steps, "global_batch_size": global_batch, "seq_len": seq_len, "log_every": 1,
                  "eval_batches": 0},
        # A constant learning rate after one warm-up step, grad clipping as raymp's default.
        "optimizer": {"warmup_steps": 1},
        "data": {"source": "kjv", "tokenizer": "byte", "cache_dir": CACHE},
        "resources": {"cpus_per_actor": cpus_per_actor, "device": device},
        "tracking": {"enabled": False},
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def global_batches(cfg_dict: dict) -> tuple[list[np.ndarray], int]:
    """(the token windows of every step's global batch, in raymp's order; the vocabulary size)."""
    from raymp.config import config_from_dict
    from raymp.reference import dataset_and_order

    cfg = config_from_dict(cfg_dict)
    data, order = dataset_and_order(cfg)
    return [data.gather(order.batch(s)) for s in range(cfg.train.steps)], data.vocab_size


def steady(values: list[float], skip: int = 2) -> list[float]:
    """Drop the first steps (one-off allocation, graph warm-up, first collectives)."""
    return values[skip:] if len(values) > skip else values


def median(values) -> float:
    return statistics.median(values)


def window(step_times: list[float], skip: int = 2) -> dict:
    """A run's timed window (the steps after `skip` warm-up ones): the mean step, which every
    ratio is taken over (slow steps count, as they do in a run's wall time), the median and the
    95th percentile beside it, and the slow tail as p95 over the median."""
    values = steady(step_times, skip)
    p95 = float(np.percentile(values, 95))
    return {"mean": statistics.fmean(values), "median": statistics.median(values), "p95": p95,
            "tail": p95 / statistics.median(values)}


def spread(values) -> str:
    """The repetitions behind a median, for the reader to judge the noise."""
    return ", ".join(f"{v:.3g}" for v in values)


def machine() -> dict:
    import ray
    import torch

    import raymp

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem_gib, 1), "gpu": gpu,
            "python": platform.python_version(), "torch": torch.__version__, "ray": ray.__version__,
            "raymp": raymp.__version__, "os": platform.platform()}


# Dense bf16 peaks from the vendors' data sheets (TFLOP/s); --peak-tflops for anything else.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "L4": 121.0}


def peak_tflops_of(gpu_name: str) -> float:
    """The dense bf16 peak of a GPU by its name (torch.cuda.get_device_name); SystemExit with
    one line for a GPU not in the table."""
    for key, peak in PEAK_TFLOPS.items():
        if key in gpu_name:
            return peak
    raise SystemExit(f"no known bf16 peak for the GPU {gpu_name!r}; pass --peak-tflops")
