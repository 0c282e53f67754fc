"""The Ray actor that owns one device: joins the process group, builds its shard of the model,
and runs one whole training step per driver call (all micro-batches, backward, optimizer)."""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import time
from datetime import timedelta

import numpy as np


class Worker:
    """Plain class; the runtime wraps it with ray.remote so tests can also use it in-process."""

    def __init__(self, num_threads: int):
        os.environ["OMP_NUM_THREADS"] = str(num_threads)
        import torch

        # Each actor gets its share of cores; torch's default (all cores per process) makes
        # co-located actors fight and steps run ~20x slower (DESIGN.md).
        torch.set_num_threads(num_threads)
        self.num_threads = num_threads
        self.rank = None
        self.engine = None
        self._meshes = {}

    # -- placement and rendezvous ---------------------------------------------------------

    def node_info(self) -> dict:
        import ray

        ctx = ray.get_runtime_context()
        return {
            "node_id": ctx.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "threads": self.num_threads,
        }

    def rendezvous_address(self) -> tuple[str, int]:
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def init_distributed(self, rank: int, world_size: int, addr: str, port: int, backend: str,
                         timeout_s: float) -> None:
        import torch
        import torch.distributed as dist

        self.rank, self.world_size, self.backend = rank, world_size, backend
        if backend == "nccl":
            self.device = torch.device("cuda", 0)  # Ray sets CUDA_VISIBLE_DEVICES per actor
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        # An explicit timeout: a rank whose peer died must fail, not hang forever (DESIGN.md).
        dist.init_process_group(
            backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )

    def _mesh(self, dims):
        key = (dims.dp, dims.pp, dims.tp)
        if key not in self._meshes:
            self._meshes[key] = dims.build_mesh(self.device.type)
        return self._meshes[key]

    # -- model set-up -----------------------------------------------------------------------

    def setup(self, cfg_dict: dict, samples: np.ndarray, vocab_size: int) -> dict:
        """Build model + optimizer for this rank from the resolved config. Re-callable: a reused
        actor group can train another config without restarting processes."""
        import torch

        from raymp.config import RunConfig
        from raymp.models import build_model, model_args
        from raymp.optim import build_scheduler
        from raymp.parallel.checkpointing import apply_activation_checkpointing
        from raymp.parallel.mesh import ParallelDims
        from raymp.parallel.zero import apply_data_parallel

        self.engine = None
        cfg = RunConfig.model_validate(cfg_dict)
        self.cfg = cfg
        self.samples = samples
        p = cfg.parallel
        dims = ParallelDims(p.dp, p.pp, p.tp)
        self.coords = dims.coords(self.rank)
        mesh = self._mesh(dims)

        model = build_model(model_args(cfg.model, vocab_size), cfg.seed, self.device)
        block_names = [f"layers.{k}" for k in model.layers]
        if p.activation_checkpointing:
            apply_activation_checkpointing(model, block_names)
        bf16 = cfg.precision == "bf16"
        self.engine = apply_data_parallel(
            model, mesh["dp"], cfg.optimizer, p.zero, self.device,
            torch.bfloat16 if bf16 else None, block_names,
        )
        # Under ZeRO 0/1 bf16 runs through autocast (fp32 master weights); FSDP2 casts itself.
        self._autocast = bf16 and p.zero < 2
        self.scheduler = build_scheduler(self.engine.optimizer, cfg.optimizer, cfg.train.steps)
        self.step_index = 0
        return {"rank": self.rank, "coords": self.coords, "num_params": model.num_params()}

    # -- the step ---------------------------------------------------------------------------

    def _autocast_ctx(self):
        import torch

        if self._autocast:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def train_step(self, sample_ids: np.ndarray) -> dict:
        """One optimizer step over this replica's share of the global batch."""
        import torch

        from raymp.loss import lm_loss

        t0 = time.perf_counter()
        micro = np.asarray(sample_ids).reshape(-1, self.cfg.parallel.micro_batch_size)
        n = len(micro)
        loss_sum = torch.zeros((), device=self.device)
        for i, ids in enumerate(micro):
            batch = torch.from_numpy(self.samples[ids].astype(np.int64)).to(self.device)
            inputs, labels = batch[:, :-1], batch[:, 1:]
            with self.engine.no_sync(i == n - 1):
                with self._autocast_ctx():
                    loss = lm_loss(self.engine.model(inputs), labels)
                (loss / n).backward()
            loss_sum += loss.detach()
        grad_norm = self.engine.clip_grad_norm(self.cfg.optimizer.grad_clip)
        self.engine.optimizer.step()
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        state = self.engine.state_bytes()
        self.engine.optimizer.zero_grad(set_to_none=True)
        self.engine.after_optimizer_step()
        self.step_index += 1
        return {
            "rank": self.rank,
            "loss": float(loss_sum) / n,
            "grad_norm": grad_norm,
            "lr": lr,
            "compute_s": time.perf_counter() - t0,
            "peak_mem_bytes": self._peak_memory(),
            **state,
        }

    def _peak_memory(self) -> int:
        import torch

        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB

    # -- inspection -------------------------------------------------------------------------

    def full_state_dict(self) -> dict | None:
        """Full (unsharded) model weights on CPU; every rank must call it, rank 0 returns them."""
        sd = self.engine.full_state_dict()
        return sd if self.rank == 0 else None

    def shutdown(self) -> None:
        import torch.distributed as dist

        self.engine = None
        if dist.is_initialized():
            dist.destroy_process_group()
