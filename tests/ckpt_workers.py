"""Workers that fail on purpose, for checkpoint and failure-detection tests. Importable by Ray's
worker processes (conftest puts tests/ on their PYTHONPATH)."""

from __future__ import annotations

import os
import time

from raymp.runtime.worker import Worker


class CrashDuringSaveWorker(Worker):
    """Rank `rank` dies (os._exit, as a lost node would take it) in the middle of writing step
    `step`'s checkpoint: after its own shard file is on storage, before DCP's index and raymp's
    commit marker are written."""

    def arm_crash(self, step: int, rank: int) -> None:
        if self.rank != rank:
            return
        make_writer = self.checkpointer.writer_factory

        def writer_factory(path: str):
            writer = make_writer(path)
            if path.rstrip("/").endswith(f"step-{step:08d}"):
                write_data = writer.write_data

                def write_then_die(plan, planner):
                    write_data(plan, planner).wait()
                    os._exit(1)

                writer.write_data = write_then_die
            return writer

        self.checkpointer.writer_factory = writer_factory


class HangingWorker(Worker):
    """Rank `rank` stops answering in step `step` (sleeps), as a wedged process would."""

    def arm_hang(self, step: int, rank: int, seconds: float) -> None:
        self._hang = (step, rank, seconds)

    def train_step(self, step: int) -> dict:
        hang_step, rank, seconds = getattr(self, "_hang", (None, None, 0))
        if step == hang_step and self.rank == rank:
            time.sleep(seconds)
        return super().train_step(step)
