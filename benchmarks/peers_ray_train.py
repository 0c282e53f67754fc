"""The Ray Train peer: the same model, data, seed and optimizer as a raymp run, trained by Ray
Train's `TorchTrainer` with torch's own DDP or FSDP2 (one FSDP unit per decoder block, as
raymp's ZeRO-3 and torchtitan do). Written the way a Ray Train user would write it, from raymp's
model and optimizer builders, so the comparison is about the runtime, not the model code."""

from __future__ import annotations

import json
import os
import tempfile
import time

import numpy as np

from benchmarks.plain_loop import model_and_optimizer, train_step


def _device():
    import torch

    import ray.train.torch

    return ray.train.torch.get_device() if torch.cuda.is_available() else torch.device("cpu")


def dp_loop(config: dict) -> None:
    """One Ray Train worker: its replica's share of every global batch, timed per step."""
    import torch

    import ray.train

    torch.set_num_threads(config["threads"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = _device()
    cfg, model, optimizer, scheduler, autocast = model_and_optimizer(
        config["cfg"], config["vocab_size"], config["mode"], device)
    ends, losses = [], []
    for tokens in config["batches"]:
        local = np.array_split(tokens, world)[rank]
        losses.append(train_step(model, optimizer, scheduler, local, cfg, device, autocast))
        if device.type == "cuda":
            torch.cuda.synchronize()
        ends.append(time.time())
    if rank == 0:
        # Ray Train v2 keeps reported metrics only with a checkpoint: hand them over in a file.
        _log(config["log"], {"ends": ends, "losses": losses})


def run_dp(cfg_dict: dict, batches: list[np.ndarray], vocab_size: int, mode: str, workers: int,
           cpus_per_worker: float, storage: str, use_gpu: bool = False) -> dict:
    """Train with TorchTrainer; returns the step times and losses rank 0 saw, and the wall time
    of the whole fit (worker start-up included)."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    threads = max(1, int(cpus_per_worker))
    start = time.time()
    log = os.path.join(storage, f"peer-{mode}-{time.time_ns()}.jsonl")
    os.makedirs(storage, exist_ok=True)
    trainer = TorchTrainer(
        dp_loop,
        train_loop_config={"cfg": cfg_dict, "vocab_size": vocab_size, "mode": mode, "batches": batches,
                           "threads": threads, "log": log},
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=use_gpu,
                                     resources_per_worker={"CPU": cpus_per_worker}),
        run_config=RunConfig(name=f"peer-{mode}-{int(start)}", storage_path=storage),
    )
    trainer.fit()
    with open(log) as f:
        record = json.loads(f.readline())
    ends = record["ends"]
    return {"step_times": [b - a for a, b in zip(ends, ends[1:])], "losses": record["losses"],
            "fit_s": time.time() - start}


# -- the recovery peer ----------------------------------------------------------------------------


def recovery_loop(config: dict) -> None:
    """DDP training that checkpoints every k steps through ray.train.report and, when Ray Train
    restarts it after a failure, resumes from the latest checkpoint. Rank 0 appends
    (step, wall time) to a log after each step, and where each attempt started, which the
    benchmark reads from outside."""
    import torch

    import ray.train

    torch.set_num_threads(config["threads"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = _device()
    cfg, model, optimizer, scheduler, autocast = model_and_optimizer(
        config["cfg"], config["vocab_size"], "ddp", device)
    start, read = 0, 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            read = os.path.getsize(os.path.join(d, "state.pt"))  # each rank loads the whole file
            state = torch.load(os.path.join(d, "state.pt"), weights_only=False)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start = state["step"]
    if rank == 0:  # every attempt, so a restart with no checkpoint registered shows too
        _log(config["log"], {"event": "started", "step": start, "at": time.time(), "read_bytes": read})
    every = config["every"]
    for step in range(start, len(config["batches"])):
        local = np.array_split(config["batches"][step], world)[rank]
        loss = train_step(model, optimizer, scheduler, local, cfg, device, autocast)
        if rank == 0:
            _log(config["log"], {"event": "step", "step": step + 1, "loss": loss, "at": time.time(),
                                 "node": ray.get_runtime_context().get_node_id()})
        if (step + 1) % every == 0:
            with tempfile.TemporaryDirectory() as d:
                if rank == 0:
                    torch.save(
                        {
                            "model": model.module.state_dict(),
                            "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict(),
                            "step": step + 1,
                        },
                        os.path.join(d, "state.pt"),
                    )
                ray.train.report({"step": step + 1},
                                 checkpoint=ray.train.Checkpoint.from_directory(d) if rank == 0 else None)


def _log(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
