"""The no-Ray peers, launched the way `torchrun` launches a script: one fresh interpreter per rank,
a TCP rendezvous, each rank looping over its steps by itself. Two of them:
- run_plain_dp: torch's own DDP or FSDP2 loop (benchmarks.plain_loop): the plain-loop peer;
- run_plain: raymp's own per-rank code (`raymp.runtime.worker.Worker`, a plain class): no driver,
  no actors, no remote calls, no Ray Data, so what is left of a raymp step beyond it is
  orchestration overhead."""

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

        self.batches = [replica_slice(b, len(b) // dp, replica) for b in batches]

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
    return _spawn(_rank_main, world, (cfg, vocab_size, batches, threads))


def _plain_dp_main(rank: int, world: int, port: int, cfg_dict: dict, vocab_size: int, batches, mode: str,
                   threads: int, results) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.plain_loop import model_and_optimizer, train_step

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    device = torch.device("cpu")
    cfg, model, optimizer, scheduler, autocast = model_and_optimizer(cfg_dict, vocab_size, mode, device)
    ends, losses = [], []
    for tokens in batches:
        losses.append(
            train_step(
                model, optimizer, scheduler, np.array_split(tokens, world)[rank], cfg, device, autocast
            )
        )
        ends.append(time.time())
    results.put((rank, ends, losses))
    dist.destroy_process_group()


def run_plain_dp(cfg_dict: dict, batches: list[np.ndarray], vocab_size: int, mode: str, world: int,
                 threads: int = 1) -> dict:
    """torch's DDP ("ddp") or FSDP2 ("fsdp2") loop in `world` spawned processes on CPU (gloo): the
    step times rank 0 saw and the losses."""
    return _spawn(_plain_dp_main, world, (cfg_dict, vocab_size, batches, mode, threads))


def _spawn(target, world: int, args: tuple) -> dict:
    """`target(rank, world, port, *args, results)` in `world` spawned interpreters, each putting
    (rank, step ends, losses, *more) on `results`; the slowest rank's step ends, the per-step losses
    (mean over the ranks that report one), the wall time and each rank's `more` (by rank)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    start = time.time()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, results)) for r in range(world)]
    for proc in procs:
        proc.start()
    gathered = sorted(results.get(timeout=1800) for _ in procs)
    for proc in procs:
        proc.join()
        if proc.exitcode:
            raise RuntimeError(f"a plain-process rank exited with {proc.exitcode}")
    ends = np.array([g[1] for g in gathered]).max(axis=0)
    steps = len(ends)
    per_step = [[loss for g in gathered if (loss := g[2][s]) is not None] for s in range(steps)]
    return {"step_times": list(np.diff(ends)), "losses": [float(np.mean(v)) for v in per_step],
            "fit_s": time.time() - start, "more": [g[3:] for g in gathered]}
