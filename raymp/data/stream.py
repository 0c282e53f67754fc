"""One Ray Data stream per data-parallel replica, pulled by that replica's first pipeline stage.

Ray Data has no mid-epoch resume and `streaming_split` hands blocks to whichever consumer asks
first, so neither gives "step s reads exactly these samples on this replica". Each replica's
stream is therefore its own small dataset: the step numbers it will run, mapped (in Ray Data
tasks, ahead of the step, with preserve_order) to the sample ids the global order assigns it and
their tokens. A stream can start at any step and any position, so a restart with another dp
picks up exactly where the last run stopped.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import numpy as np

from raymp.data.order import DataPosition, TrainOrder, replica_slice

STEPS_PER_TASK = 4


@dataclass(frozen=True)
class StreamSpec:
    root: str  # prepared dataset
    num_samples: int
    val_fraction: float
    seed: int
    global_batch: int
    dp: int
    replica: int
    start: DataPosition  # the stream's first step reads from here

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.dp


@functools.lru_cache(maxsize=4)
def _order(num_samples: int, val_fraction: float, seed: int, global_batch: int) -> TrainOrder:
    return TrainOrder(num_samples, val_fraction, seed, global_batch)


def _replica_rows(batch: dict, spec: StreamSpec) -> dict:
    """Ray Data task: for each step offset k in the batch, replica `spec.replica`'s samples of
    step start.step + k, one row per sample."""
    from raymp.data.packed import open_packed

    order = _order(spec.num_samples, spec.val_fraction, spec.seed, spec.global_batch)
    steps, ids = [], []
    for k in batch["id"]:
        step = spec.start.step + int(k)
        consumed = spec.start.consumed + int(k) * spec.global_batch
        ids.append(replica_slice(order.sample_ids(consumed, spec.global_batch), spec.dp, spec.replica))
        steps.append(np.full(spec.local_batch, step, dtype=np.int64))
    ids = np.concatenate(ids)
    return {"step": np.concatenate(steps), "sample_id": ids, "tokens": _packed(spec.root).gather(ids)}


@functools.lru_cache(maxsize=4)
def _packed(root: str):
    from raymp.data.packed import open_packed

    return open_packed(root)


def replica_dataset(spec: StreamSpec, steps: int, cpus: float):
    """The lazy Ray Dataset of `steps` steps of one replica's samples, in step order."""
    import ray

    ordered_context()
    ds = ray.data.range(steps, override_num_blocks=max(1, min(steps // STEPS_PER_TASK, 200)))
    return ds.map_batches(_replica_rows, batch_size=STEPS_PER_TASK, fn_kwargs={"spec": spec}, num_cpus=cpus)


def ordered_context():
    """Ray Data settings raymp needs in every process that builds or runs a dataset: blocks in
    order (a Dataset keeps the context it was created under), and no progress bars of its own."""
    import ray

    import logging

    # Ray Data logs each execution's start/finish (and that its bars are off) from every actor;
    # raymp reports data wait itself.
    logging.getLogger("ray.data").setLevel(logging.ERROR)
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    return ctx


class ReplicaStream:
    """The first stage's end of a stream: next(step) gives that step's (sample ids, tokens) and
    the seconds the step waited for them (0 when prefetching kept up)."""

    def __init__(self, dataset, local_batch: int, first_step: int, prefetch_batches: int):
        ordered_context()
        dataset.context.execution_options.preserve_order = True
        self.expected_step = first_step
        self._batches = iter(dataset.iter_batches(
            batch_size=local_batch, batch_format="numpy", prefetch_batches=prefetch_batches,
        ))
        # Pull the first batch now, during set-up: starting the stream (Ray Data's executor and
        # its first tasks) takes seconds that are not the steady-state data wait.
        t0 = time.perf_counter()
        self._first = next(self._batches, None)
        self.start_s = time.perf_counter() - t0

    def next(self, step: int) -> tuple[np.ndarray, np.ndarray, float]:
        if step != self.expected_step:
            raise RuntimeError(f"data stream is at step {self.expected_step}, asked for step {step}")
        t0 = time.perf_counter()
        if self._first is not None:
            batch, self._first = self._first, None
        else:
            batch = next(self._batches)
        wait = time.perf_counter() - t0
        # A wrong order would train on the wrong samples silently: check every batch.
        if not (batch["step"] == step).all():
            raise RuntimeError(f"data stream out of order: step {step} got rows of steps "
                               f"{sorted(set(batch['step'].tolist()))}")
        self.expected_step += 1
        return batch["sample_id"], batch["tokens"], wait
