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
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np
import ray

from raymp.data.order import DataPosition, TrainOrder, replica_slice
from raymp.data.packed import open_packed
from raymp.data.ray_context import on_node, ordered_context

STEPS_PER_TASK = 4
WINDOW_STEPS = 32


@dataclass(frozen=True)
class StreamSpec:
    root: str  # prepared dataset
    num_samples: int
    seq_len: int
    val_fraction: float
    seed: int
    global_batch: int
    local_batch: int  # rows per replica per step: Layout.local_batch
    replica: int
    start: DataPosition  # the stream's first step reads from here
    node_id: str | None = None  # run the stream's tasks there (the shards are on its local disk)


@functools.lru_cache(maxsize=4)
def _order(num_samples: int, val_fraction: float, seed: int, global_batch: int) -> TrainOrder:
    return TrainOrder(num_samples, val_fraction, seed, global_batch)


def _replica_rows(batch: dict, spec: StreamSpec) -> dict:
    """Ray Data task: for each step offset k in the batch, replica `spec.replica`'s samples of
    step start.step + k, one row per sample."""
    order = _order(spec.num_samples, spec.val_fraction, spec.seed, spec.global_batch)
    steps, ids = [], []
    for k in batch["id"]:
        step = spec.start.step + int(k)
        ids.append(replica_slice(order.batch(step, spec.start), spec.local_batch, spec.replica))
        steps.append(np.full(spec.local_batch, step, dtype=np.int64))
    ids = np.concatenate(ids)
    return {"step": np.concatenate(steps), "sample_id": ids, "tokens": _packed(spec.root).gather(ids)}


@functools.lru_cache(maxsize=4)
def _packed(root: str):
    return open_packed(root)


def replica_dataset(spec: StreamSpec, first: int, steps: int, cpus: float):
    """The lazy Ray Dataset of one replica's samples for steps start.step + [first, first + steps),
    in step order, one task at a time."""
    ordered_context()
    ds = ray.data.from_items([{"id": k} for k in range(first, first + steps)],
                             override_num_blocks=-(-steps // STEPS_PER_TASK))
    return ds.map_batches(_replica_rows, batch_size=STEPS_PER_TASK, fn_kwargs={"spec": spec},
                          num_cpus=cpus, compute=ray.data.TaskPoolStrategy(size=1),
                          **on_node(spec.node_id))


class ReplicaStream:
    """The first stage's end of a stream: next(step) gives that step's (sample ids, tokens) and
    the seconds the step waited for them (0 when prefetching kept up).

    The run's steps are read as a chain of small Ray Datasets of WINDOW_STEPS steps each, drained
    by a background thread into a queue of `prefetch_batches` steps. One dataset for the whole run
    would not do: Ray Data runs ahead until its object-store budget (GBs) is full, and on a
    busy node that work, and its executor's bookkeeping for thousands of blocks, steals the
    training's cores (measured here: 170 ms steps became 1.5 s with a 100,000-step stream).
    A window bounds the run-ahead to WINDOW_STEPS steps; the queue bounds what is held here."""

    def __init__(self, spec: StreamSpec, steps: int, cpus: float, prefetch_batches: int):
        ordered_context()
        self.spec, self.steps, self.cpus = spec, steps, cpus
        self.expected_step = spec.start.step
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, prefetch_batches))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, name="raymp-data-stream", daemon=True)
        self._thread.start()
        self._first = None

    def wait_first(self) -> None:
        """Wait for the first batch, during set-up: starting the stream (Ray Data's executor and
        its first task) takes seconds that are not the steady-state data wait. A survivor's
        new stream starts while it sets up (Launcher.launch), so that wait overlaps set-up."""
        if self._first is None and self.expected_step == self.spec.start.step:
            self._first = self._take()

    def _fill(self) -> None:
        try:
            for first in range(0, self.steps, WINDOW_STEPS):
                dataset = replica_dataset(self.spec, first, min(WINDOW_STEPS, self.steps - first), self.cpus)
                for batch in dataset.iter_batches(batch_size=self.spec.local_batch, batch_format="numpy",
                                                  prefetch_batches=1):
                    while not self._stop.is_set():
                        try:
                            self._queue.put(batch, timeout=0.5)
                            break
                        except queue.Full:
                            continue
                    if self._stop.is_set():
                        return
        except BaseException as exc:  # handed to the consumer, which raises it in the step
            self._queue.put(exc)

    def _take(self):
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise RuntimeError(f"the data stream of replica {self.spec.replica} failed: {item}") from item
        return item

    def next(self, step: int) -> tuple[np.ndarray, np.ndarray, float]:
        if step != self.expected_step:
            raise RuntimeError(f"data stream is at step {self.expected_step}, asked for step {step}")
        if step >= self.spec.start.step + self.steps:
            raise RuntimeError(f"data stream ended at step {step}: it was opened for {self.steps} steps")
        t0 = time.perf_counter()
        if self._first is not None:
            batch, self._first = self._first, None
        else:
            batch = self._take()
        wait = time.perf_counter() - t0
        # A wrong order would train on the wrong samples silently: check every batch.
        if not (batch["step"] == step).all():
            raise RuntimeError(f"data stream out of order: step {step} got rows of steps "
                               f"{sorted(set(batch['step'].tolist()))}")
        self.expected_step += 1
        return batch["sample_id"], batch["tokens"], wait

    def close(self) -> None:
        self._stop.set()
