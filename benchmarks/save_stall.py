"""15. Where an async save's stall in the step loop comes from: the checkpoint cost table's
"async every 5" row (dp=2 ZeRO-2 `small`, a save every 5 steps, one actor group), run as shipped
(raymp's writer: each tensor's raw bytes, hashed as they are written, raymp.checkpoint.raw_storage),
with the raw writer's file read back to be hashed (as another writer's files are), with DCP's own
writer (torch.save per tensor), with DCP's writer into a stream that drops the bytes (its
serialization alone), and with the host copy only (nothing written), each by a worker subclass
(raymp's code unchanged). Each variant's stall is priced as in the cost table
(benchmarks.recovery.in_run_cost), and beside it what the step after a save took on the ranks
beyond the run's median step
(`compute_s`: the step call's wall time; `own_s`: the training thread on a CPU or waiting for one).

    python -m benchmarks.run_all --only save_stall --update
"""

from __future__ import annotations

import contextlib
import io
import shutil
import statistics
import tempfile
import time
from concurrent.futures import Future

from benchmarks.common import median, spread
from benchmarks.recovery import config, in_run_cost
from raymp.runtime.worker import Worker

EVERY = 5


class _Dropped(io.RawIOBase):
    """A writable stream that keeps nothing but its position (DCP asks for it)."""

    def __init__(self):
        self.position = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        size = memoryview(data).nbytes
        self.position += size
        return size

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = 0) -> int:
        self.position = offset if whence == 0 else self.position + offset
        return self.position


class TimedWorker(Worker):
    """raymp's worker, plus each step's CPU time in the training thread (time.thread_time: on a
    CPU only, where own_s adds the time runnable and waiting for one)."""

    def _train_step(self, step, save):
        start = time.thread_time()
        report = super()._train_step(step, save)
        self.__dict__.setdefault("_cpu_s", {})[step] = time.thread_time() - start
        return report

    def step_cpu_s(self) -> dict[int, float]:
        return self.__dict__.get("_cpu_s", {})


class ReadBackWorker(TimedWorker):
    """raymp's raw writer, but the rank reads its file back to hash it (integrity.rank_files told
    nothing of the writer's digests)."""

    def init_distributed(self, *args, **kwargs) -> None:
        super().init_distributed(*args, **kwargs)
        from raymp.checkpoint import rank_state

        rank_files = rank_state.rank_files
        rank_state.rank_files = lambda path, rank, hashed=None: rank_files(path, rank)


class TorchSaveWorker(TimedWorker):
    """DCP's own FileSystemWriter, which serializes every tensor with torch.save (raymp's before
    raw_storage)."""

    def init_distributed(self, *args, **kwargs) -> None:
        super().init_distributed(*args, **kwargs)
        from torch.distributed.checkpoint import FileSystemWriter

        self.checkpointer.writer_factory = FileSystemWriter


class SerializeOnlyWorker(TimedWorker):
    """DCP's own FileSystemWriter, but each rank's data file is an empty file and its bytes go to
    a stream that drops them (DCP's index and raymp's hashing run as they do)."""

    def init_distributed(self, *args, **kwargs) -> None:
        super().init_distributed(*args, **kwargs)
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint.filesystem import FileSystem

        class DroppingFileSystem(FileSystem):
            @contextlib.contextmanager
            def create_stream(self, path, mode):
                if not str(path).endswith(".distcp"):
                    with super().create_stream(path, mode) as stream:
                        yield stream
                    return
                open(path, "wb").close()
                yield _Dropped()

        def writer(path: str):
            made = FileSystemWriter(path)
            made.fs = DroppingFileSystem()
            return made

        self.checkpointer.writer_factory = writer


class CopyOnlyWorker(TimedWorker):
    """The save's host copy is made on the step's call as shipped; nothing is written (the save
    reports done at once, with no files)."""

    def init_distributed(self, *args, **kwargs) -> None:
        super().init_distributed(*args, **kwargs)
        checkpointer = self.checkpointer

        def write(sd, path, step, async_save) -> None:
            done: Future = Future()
            done.set_result({})
            checkpointer.pending = (step, done)

        checkpointer.write = write


VARIANTS = {
    "as shipped (raw tensor bytes hashed as written, in DCP's thread)": TimedWorker,
    "raw tensor bytes, the file read back to be hashed": ReadBackWorker,
    "DCP's own writer (torch.save per tensor)": TorchSaveWorker,
    "DCP's own writer, the bytes dropped": SerializeOnlyWorker,
    "host copy only, nothing written": CopyOnlyWorker,
}


def _after_save(per_step: dict[int, float]) -> float:
    """The step after each save, beyond the run's median step (steps 0 and 1, warm-up, left out)."""
    per_step = {i: v for i, v in per_step.items() if i >= 2}
    after = [i for i in per_step if i % EVERY == 0]  # the save rides on step i-1's call
    base = statistics.median(v for i, v in per_step.items() if i not in after)
    return statistics.median(per_step[i] - base for i in after)


def _slowest(history: list[dict], key: str) -> dict[int, float]:
    """Step index -> the slowest rank's `key` (a RankReport field)."""
    return {i: max(r[key] for r in m["per_rank"]) for i, m in enumerate(history)}


def measure(opts) -> dict:
    import ray

    from raymp.runtime.actor_group import ActorGroup
    from raymp.trainer import Trainer

    steps = 3 * opts.steps
    root = tempfile.mkdtemp(prefix="raymp-bench-save-stall-")
    runs: dict[str, list] = {name: [] for name in VARIANTS}
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        for rep in range(opts.reps):
            for name, worker in VARIANTS.items():
                group = ActorGroup(2, "cpu", cpus_per_actor=1.5, placement_timeout_s=120, worker_cls=worker)
                directory = f"{root}/{rep}-{worker.__name__}"
                cfg = config(root, "small", steps, checkpoint={"every": EVERY, "async_save": True,
                                                               "dir": directory, "keep_last": 1})
                try:
                    with Trainer(cfg, actor_group=group, progress=False) as trainer:
                        history = trainer.fit()
                    cpu = [{int(k): v for k, v in r.items()} for r in group.call("step_cpu_s")]
                finally:
                    group.shutdown()
                shutil.rmtree(directory, ignore_errors=True)
                cost = in_run_cost(history, EVERY)
                runs[name].append({"stall_s": cost["stall_s"], "fraction": cost["fraction"],
                                   "compute_s": _after_save(_slowest(history, "compute_s")),
                                   "own_s": _after_save(_slowest(history, "own_s")),
                                   "cpu_s": _after_save({i: max(r[i] for r in cpu) for i in cpu[0]}),
                                   "losses": [m["loss"] for m in history],
                                   "commits": sum("checkpoint_committed" in m for m in history)})
    finally:
        ray.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    rows = []
    for name, rs in runs.items():
        stall = [1e3 * r["stall_s"] for r in rs]
        rows.append([name, f"{median(stall):.0f}", spread(stall),
                     f"{100 * median([r['fraction'] for r in rs]):+.1f}%",
                     f"{1e3 * median([r['compute_s'] for r in rs]):+.0f}",
                     f"{1e3 * median([r['own_s'] for r in rs]):+.0f}",
                     f"{1e3 * median([r['cpu_s'] for r in rs]):+.0f}",
                     str(rs[0]["commits"]), f"{rs[0]['losses'][-1]:.4f}"])
    return {
        "title": "15. Where an async save's stall in the step loop comes from",
        "setup": (f"dp=2 ZeRO-2, model `small`, {steps} steps, an async save every {EVERY} steps, on one "
                  f"2-actor group (1.5 CPUs each) of a local Ray; {opts.reps} interleaved rounds. The "
                  "variants change the writer or take parts of the save out with a worker subclass; "
                  "raymp's code is the same."),
        "columns": ["save", "loop stall per save (ms, median)", "per round", "in-run cost per step",
                    "step after a save: call (ms)", "step after a save: own time (ms)",
                    "step after a save: CPU (ms)", "commits",
                    "last loss"],
        "rows": rows,
        "raw": runs,
        "notes": [
            "\"loop stall per save\" and \"in-run cost\" are the checkpoint cost table's (section 5). "
            "\"step after a save\" is the median over the run's saves of the slowest rank's value on "
            "the step after the save's, minus the run's median step; \"own time\" is the training "
            "thread's time on a CPU plus its time runnable and waiting for one (raymp.runtime.thread_time), "
            "so call time beyond it is time the thread was blocked.",
            "\"CPU\" is the training thread's time on a CPU alone (time.thread_time, read by a worker "
            "subclass around each step); own time beyond it is time runnable, waiting for a core.",
            "The loop's stall per save swings by a few hundred ms between rounds of the same code (a "
            "median baseline under a few saves per run on a shared machine); the step-after columns are "
            "the steadier measure of what a save costs the loop (docs/design.md, decisions).",
            "DCP's own writer serializes every tensor with torch.save in its thread, holding the "
            "rank's GIL; raymp's writes each tensor's bytes with one call that lets go of it "
            "(raymp.checkpoint.raw_storage).",
            "The two variants that write less still commit their checkpoints (\"commits\"): with "
            "empty data files, or with none listed. No run loads them; they price the write, and the "
            "same losses show the training was the same.",
        ],
    }
