"""A rank's side of a peer copy (elastic.peer_copy_every): its part of a checkpoint as bytes in
memory, taken in the background, and a load from every rank's parts.

The parts are the files torch DCP writes (each rank's data file, and the coordinator's metadata),
written to a node-local scratch directory and read back, so a peer copy loads into any layout
exactly as a checkpoint on storage does (RankCheckpointer.load reshards): the one loading path
stays the one that is tested under every layout. Ray's object store carries and keeps the bytes
(raymp.elastic.peer_copies); nothing goes to the run's storage.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from pathlib import Path

import numpy as np

from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from raymp.checkpoint.rank_state import save_in_background, save_state
from raymp.checkpoint.raw_storage import RawFileWriter
from raymp.checkpoint.restore import COLLECTIVE_KNOB


class PeerCopyWriter:
    """This rank's peer copies in flight. start() stages the state in host memory and returns
    (training goes on at once); DCP writes it to a scratch directory in a background thread;
    finish(), queued at once on the actor's "copies" thread, hands the files over as arrays when
    the write is done, while the next step runs. Every DCP call on the checkpoint group (a copy,
    a checkpoint save or load) waits first for the copy's write: their collectives must not
    interleave. Each wait is bounded by the checkpoint group's collective timeout (timeout_s),
    whose knob its error names."""

    def __init__(self, checkpointer, timeout_s: float):
        self.checkpointer, self.timeout_s = checkpointer, timeout_s
        self._lock = threading.Lock()  # start() runs on the actor's main thread, finish() on "copies"
        self._writes: dict[int, tuple[str, Future]] = {}  # step -> (scratch directory, its write)

    def start(self, step_runner, engine, scheduler) -> int:
        """Start a copy of the state now; returns the optimizer steps it holds."""
        self.wait_written()
        step = scheduler.last_epoch
        sd = save_state(step_runner, engine, scheduler, self.checkpointer.rank)
        scratch = tempfile.mkdtemp(prefix="raymp-peer-copy-")
        try:
            # Scratch read back soon: no fsync (it cost more than the write).
            future = save_in_background(
                sd,
                RawFileWriter(scratch, sync_files=False),
                self.checkpointer.group,
                AsyncCheckpointerType.THREAD,
            )
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        with self._lock:
            self._writes[step] = (scratch, future)
        return step

    def finish(self, step: int) -> tuple[int, dict[str, np.ndarray]]:
        """(steps held, file name -> bytes as a uint8 array: Ray moves arrays in and out of its
        object store without a pickle copy) once the copy of `step` is written."""
        with self._lock:
            scratch, future = self._writes.get(step) or (None, None)
        if future is None:
            raise RuntimeError(
                f"no peer copy of step {step} is in flight on this rank (its process group was re-formed)"
            )
        try:
            if not futures_wait([future], timeout=self.timeout_s).done:
                raise self._still_writing(step)
            future.result()  # the write's error, if it failed
            return step, {
                f.name: np.fromfile(f, dtype=np.uint8) for f in Path(scratch).iterdir() if f.is_file()
            }
        finally:
            with self._lock:
                self._writes.pop(step, None)
            shutil.rmtree(scratch, ignore_errors=True)

    def wait_written(self) -> None:
        """Until every copy's write has ended, at most timeout_s (a failed one is finish()'s to report)."""
        with self._lock:
            writes = dict(self._writes)
        late = futures_wait([future for _, future in writes.values()], timeout=self.timeout_s).not_done
        if late:
            raise self._still_writing(next(step for step, (_, f) in writes.items() if f in late))

    def discard(self) -> None:
        """Forget the copies in flight: the group they are written on is gone, so their writes
        fail; each scratch directory goes once its write has ended."""
        with self._lock:
            writes, self._writes = list(self._writes.values()), {}
        for scratch, future in writes:
            future.add_done_callback(lambda _, scratch=scratch: shutil.rmtree(scratch, ignore_errors=True))

    def _still_writing(self, step: int) -> TimeoutError:
        return TimeoutError(f"the peer copy of step {step} was still writing after {self.timeout_s:g}s "
                            f"({COLLECTIVE_KNOB})")


def load_from_bytes(checkpointer, parts, step_runner, engine, scheduler) -> dict:
    """Fill this rank's freshly set-up state from every rank's parts (PeerCopyWriter.finish)."""
    with tempfile.TemporaryDirectory(prefix="raymp-peer-load-") as path:
        for part in parts:
            for name, data in part.items():
                data.tofile(Path(path, name))
        return checkpointer.load(path, step_runner, engine, scheduler)
