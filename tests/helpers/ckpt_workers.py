"""Workers that fail on purpose, for checkpoint and failure-detection tests (shipped to Ray's
worker processes with the helpers package)."""

from __future__ import annotations

import os
import threading
import time

import ray

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

    def train_step(self, step: int, save=None):
        hang_step, rank, seconds = getattr(self, "_hang", (None, None, 0))
        if step == hang_step and self.rank == rank:
            time.sleep(seconds)
        return super().train_step(step, save)


class FailingStorageWorker(Worker):
    """From step `step`'s checkpoint on, rank `rank`'s storage is full: each write leaves half a
    file and fails with ENOSPC, as a full disk does. fill_disk_from(None, None) empties it."""

    def fill_disk_from(self, step, rank) -> None:
        import errno
        from pathlib import Path

        if not hasattr(self, "_plain_writer"):
            self._plain_writer = self.checkpointer.writer_factory
        make_writer = self._plain_writer
        if step is None or self.rank != rank:
            self.checkpointer.writer_factory = make_writer
            return

        def writer_factory(path: str):
            writer = make_writer(path)
            if int(path.rstrip("/").rsplit("-", 1)[-1]) >= step:
                def write_then_fill_up(plan, planner):
                    Path(path, f"__{self.rank}_0.distcp").write_bytes(b"\0" * 4096)
                    raise OSError(errno.ENOSPC, "No space left on device")

                writer.write_data = write_then_fill_up
            return writer

        self.checkpointer.writer_factory = writer_factory


class SlowStorageWorker(Worker):
    """From step `step`'s checkpoint on, every write takes `seconds` longer."""

    def slow_writes_from(self, step: int, seconds: float) -> None:
        make_writer = self.checkpointer.writer_factory

        def writer_factory(path: str):
            writer = make_writer(path)
            if int(path.rstrip("/").rsplit("-", 1)[-1]) >= step:
                write_data = writer.write_data

                def slow_write(plan, planner):
                    time.sleep(seconds)
                    return write_data(plan, planner)

                writer.write_data = slow_write
            return writer

        self.checkpointer.writer_factory = writer_factory


class NeverJoinsWorker(Worker):
    """Never joins the process group, as an actor stuck starting up would not."""

    def init_distributed(self, *args) -> None:
        time.sleep(300)


class SlowSetupWorker(Worker):
    """Builds its model part far slower than resources.setup_timeout_s allows."""

    def setup(self, *args) -> dict:
        time.sleep(300)
        return {}


class EndlessStepWorker(Worker):
    """Rank `rank`'s first try of step `step` never ends by itself: it goes on through activation
    after activation (the points where a real step checks StepAbandon) until the driver abandons
    it. A survivor's step stuck like this is what abandon_step must end, not a timeout."""

    def arm_endless(self, step: int, rank: int) -> None:
        self._endless = (step, rank)

    def _train_step(self, step: int, save):
        if (step, self.rank) == getattr(self, "_endless", None):
            self._endless = None  # the retry runs normally
            while True:
                self.step_runner.meter.on_activation()
                time.sleep(0.01)
        return super()._train_step(step, save)


class DiesAfterStepWorker(Worker):
    """Rank `rank` takes step `step` whole (its collectives done, its optimizer stepped) and its
    process ends before it reports: a node lost between a step's last collective and its reply."""

    def arm_die_after(self, step: int, rank: int) -> None:
        self._die_after = (step, rank)

    def train_step(self, step: int, save=None):
        report = super().train_step(step, save)
        if (step, self.rank) == getattr(self, "_die_after", None):
            os._exit(1)
        return report


class HoldsBackPeerCopyWorker(Worker):
    """Rank 1 never hands its part of the peer copy of step 3 over (the call waits for ever, on
    the actor's "copies" thread, beside the steps), as a rank lost before its part reached the
    object store leaves that copy."""

    @ray.method(num_returns=2, concurrency_group="copies")
    def finish_peer_copy(self, step: int):
        if self.rank == 1 and step == 3:
            threading.Event().wait()
        return super().finish_peer_copy(step)


class NonFiniteGradientWorker(Worker):
    """Rank `rank` turns one of its gradients to NaN after the backward of the armed steps, as
    an overflow would: the global gradient norm is then NaN on every rank."""

    def arm_nonfinite(self, steps: list[int], rank: int, once: bool = False) -> None:
        """`once`: each armed step is poisoned the first time it runs only (a transient fault)."""
        self._poisoned_steps = set(steps) if self.rank == rank else set()
        self._poison_once = once

    def _train_step(self, step: int, save):
        if step not in getattr(self, "_poisoned_steps", ()):
            return super()._train_step(step, save)
        if self._poison_once:
            self._poisoned_steps.discard(step)
        step_runner = self.step_runner
        forward_backward = step_runner.forward_backward

        def poisoned(tokens):
            out = forward_backward(tokens)
            grad = next(p.grad for p in self.engine.optimizer_params() if p.grad is not None)
            grad.mul_(float("nan"))
            return out

        step_runner.forward_backward = poisoned
        try:
            return super()._train_step(step, save)
        finally:
            del step_runner.forward_backward


class SlowRankWorker(Worker):
    """Rank `rank` does its forward and backward, then `factor` times their CPU time again in a busy
    loop, every step: a rank slowed by its own work, by the same ratio on any machine."""

    def arm_slow(self, rank: int, factor: float) -> None:
        if self.rank != rank:
            return
        run = self.step_runner.forward_backward

        def slowed(tokens):
            start = time.thread_time()
            out = run(tokens)
            end = time.thread_time() + factor * (time.thread_time() - start)
            while time.thread_time() < end:
                pass
            return out

        self.step_runner.forward_backward = slowed


class DiesJoiningOnceWorker(Worker):
    """A rank started to join a running group (its actor's first set-up once
    <output_dir>/die-joining exists) ends its process in that set-up, once: the marker goes
    with it. The ranks already there may have built their new model by then, with their kept
    state not yet put back in it."""

    def setup(self, cfg, *args, **kwargs):
        marker = os.path.join(cfg.output_dir, "die-joining")
        if not getattr(self, "_set_up_before", False) and os.path.exists(marker):
            os.remove(marker)
            os._exit(1)
        self._set_up_before = True
        return super().setup(cfg, *args, **kwargs)


class DiesReceivingOnceWorker(Worker):
    """A rank started to join a running group ends its process as its state is about to come
    (restore_kept with a rank to receive from) once <output_dir>/die-joining exists, once: the
    survivor sending it the state is then inside its send."""

    def setup(self, cfg, *args, **kwargs):
        self._marker = os.path.join(cfg.output_dir, "die-joining")
        return super().setup(cfg, *args, **kwargs)

    def restore_kept(self, send_to=(), receive_from=None, description=None):
        if receive_from is not None and os.path.exists(self._marker):
            os.remove(self._marker)
            os._exit(1)
        return super().restore_kept(send_to, receive_from, description)
