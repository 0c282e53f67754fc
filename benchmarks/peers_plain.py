"""The no-Ray peer: raymp's own per-rank training code (`raymp.runtime.worker.Worker`, a plain
class) launched the way `torchrun` launches a script: one fresh interpreter per rank, a TCP
rendezvous, and each rank looping over its steps by itself. No driver, no actors, no remote
calls, no Ray Data: what is left of a raymp step time beyond this is orchestration overhead."""

from __future__ import annotations

import multiprocessing
import socket
import time

import numpy as np


class FixedBatches:
    """Stands in for the Ray Data stream: this replica's share of each step's global batch,
    sliced exactly as raymp's streams slice it."""

    def __init__(self, batches: list[np.ndarray], dp: int, replica: int):
        from raymp.data.order import replica_slice

        self.batches = [replica_slice(b, dp, replica) for b in batches]

    def next(self, step: int):
        return None, self.batches[step], 0.0

    def close(self) -> None:
        pass


def _rank_main(rank: int, world: int, port: int, cfg, vocab_size: int, batches, threads: int,
               results) -> None:
    from raymp.runtime.worker import Worker

    worker = Worker(threads)
    worker.init_distributed(rank, world, "127.0.0.1", port, "gloo", 300)
    worker.setup(cfg, vocab_size)
    if worker.coords["pp"] == 0:
        worker.stream = FixedBatches(batches, cfg.parallel.dp, worker.coords["dp"])
    ends, losses = [], []
    for step in range(len(batches)):
        out = worker.train_step(step)
        ends.append(time.time())
        losses.append(out.loss)
    results.put((rank, ends, losses))
    worker.shutdown()


def run_plain(cfg_dict: dict, batches: list[np.ndarray], vocab_size: int, threads: int = 1) -> dict:
    """Spawn dp*pp*tp processes, train, return the step times (slowest rank) and mean loss."""
    p = cfg_dict["parallel"]
    world = p["dp"] * p["pp"] * p.get("tp", 1)
    from raymp.config import config_from_dict
    from raymp.driver.launch import with_stage_split

    cfg = with_stage_split(config_from_dict(cfg_dict), vocab_size)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    start = time.time()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, cfg, vocab_size, batches, threads, results))
             for r in range(world)]
    for proc in procs:
        proc.start()
    gathered = [results.get(timeout=1800) for _ in procs]
    for proc in procs:
        proc.join()
        if proc.exitcode:
            raise RuntimeError(f"a plain-process rank exited with {proc.exitcode}")
    ends = np.array([e for _, e, _ in sorted(gathered)]).max(axis=0)
    per_step = [[loss for _, _, losses in gathered if (loss := losses[s]) is not None] for s in range(len(batches))]
    return {"step_times": list(np.diff(ends)), "losses": [float(np.mean(v)) for v in per_step],
            "fit_s": time.time() - start}
