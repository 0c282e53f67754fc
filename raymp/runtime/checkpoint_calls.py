"""A rank's checkpoint calls: saving and loading its part on storage, and its side of a peer copy
(elastic.peer_copy_every). A base of raymp.runtime.worker.Worker, which owns the state they act on
(declared below)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import ray

from raymp.checkpoint.coordinator import SaveOrder
from raymp.checkpoint.in_memory import PeerCopyWriter, load_from_bytes
from raymp.checkpoint.integrity import verify_files
from raymp.checkpoint.rank_state import RankCheckpointer

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler

    from raymp.parallel.zero import DataParallelEngine
    from raymp.runtime.steps import LocalStep, PipelineStep


class CheckpointCalls:
    """The Ray calls that act on a rank's checkpoints. What they act on is the Worker's:"""

    checkpointer: RankCheckpointer  # this world's (Worker.init_distributed)
    peer_copy: PeerCopyWriter  # beside the checkpointer, on its group
    step_runner: LocalStep | PipelineStep  # this set-up's (Worker.setup)
    engine: DataParallelEngine
    scheduler: LRScheduler

    def save_checkpoint(self, path: str, step: int, async_save: bool) -> dict:
        """Start writing this rank's part of step's checkpoint (see raymp.checkpoint)."""
        self.peer_copy.wait_written()
        return self.checkpointer.save(path, step, self.step_runner, self.engine, self.scheduler,
                                      async_save)

    def checkpoint_after_step(
        self, order: SaveOrder | None, applied: bool
    ) -> tuple[dict | None, dict | None]:
        """At the end of a step's call: the outcome of a save finished since the last step, and
        the start of the save the call carries (`order`), if its update was `applied`. A
        non-finite step starts none: train.on_nonfinite decides on the driver first whether the
        run goes on from that state (and skip saves it then, by its own call)."""
        if order is None or not applied:
            return self.checkpointer.poll(), None
        self.peer_copy.wait_written()
        finished = self.checkpointer.wait()  # none in flight: the driver orders a save only then
        return finished, self.checkpointer.save(order.path, order.steps_done, self.step_runner, self.engine,
                                                self.scheduler, order.async_save)

    def wait_checkpoint(self, timeout_s: float | None = None) -> dict | None:
        """Finish the save in flight (RankCheckpointer.wait)."""
        return self.checkpointer.wait(timeout_s)

    def verify_checkpoint(self, path: str, files: dict[str, str]) -> list[str]:
        """Problems with this rank's share of a checkpoint's files (verified before a load)."""
        return verify_files(path, files)

    def load_checkpoint(self, path: str) -> dict:
        """Load a checkpoint written under any layout into this rank's freshly set-up state."""
        self.peer_copy.wait_written()
        return self.checkpointer.load(path, self.step_runner, self.engine, self.scheduler)

    def start_peer_copy(self) -> int:
        """Stage this rank's part of a checkpoint for a peer copy and write it in the background
        (PeerCopyWriter); returns the optimizer steps it holds."""
        return self.peer_copy.start(self.step_runner, self.engine, self.scheduler)

    @ray.method(num_returns=2, concurrency_group="copies")
    def finish_peer_copy(self, step: int) -> tuple[int, dict[str, np.ndarray]]:
        """Beside the next step: the steps held, and this rank's part of the copy of `step` as
        bytes, once written. The driver keeps them in Ray's object store (elastic.peer_copy_every)."""
        return self.peer_copy.finish(step)

    def load_peer_copy(self, *parts: dict[str, np.ndarray]) -> dict:
        """Load every rank's finish_peer_copy() parts (written under any layout) into this rank."""
        self.peer_copy.wait_written()
        return load_from_bytes(self.checkpointer, parts, self.step_runner, self.engine, self.scheduler)
