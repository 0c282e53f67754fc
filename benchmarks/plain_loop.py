"""The peers' per-rank training loop, written the way torch's own DDP and FSDP2 tutorials write
it: build the model, wrap it (DistributedDataParallel, or fully_shard per decoder block then the
root), AdamW, and per step forward, loss, backward, clip, step, zero_grad. From raymp's model and
optimizer builders, so a comparison is about the runtime, not the model code. The Ray Train peer
(TorchTrainer) and the plain-process peer (spawned interpreters, a TCP rendezvous) both run it."""

from __future__ import annotations

import contextlib

import numpy as np


def model_and_optimizer(cfg_dict: dict, vocab_size: int, mode: str, device):
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from raymp.config import config_from_dict
    from raymp.models import build_model, model_spec
    from raymp.optim import build_optimizer, build_scheduler

    cfg = config_from_dict(cfg_dict)
    spec = model_spec(cfg.model, vocab_size, cfg.seed)
    model = build_model(spec, cfg.seed, device)
    if cfg.train.compile:  # each block, in place (torch's nn.Module.compile), before DDP/FSDP
        for name in spec.block_names(model):
            model.get_submodule(name).compile()
    bf16 = cfg.precision == "bf16"
    if mode == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        kwargs = (
            {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
            if bf16
            else {}
        )
        for name in spec.block_names(model):
            fully_shard(model.get_submodule(name), **kwargs)
        fully_shard(model, **kwargs)
    else:
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = build_optimizer(model.parameters(), cfg.optimizer)
    scheduler = build_scheduler(optimizer, cfg.optimizer, cfg.train.steps)
    # bf16 under DDP: autocast over fp32 weights, as raymp does at ZeRO 0/1.
    autocast = bf16 and mode == "ddp"
    return cfg, model, optimizer, scheduler, autocast


def train_step(model, optimizer, scheduler, tokens: np.ndarray, cfg, device, autocast: bool) -> float:
    import torch
    import torch.distributed as dist

    from raymp.loss import lm_loss

    batch = torch.from_numpy(tokens.astype(np.int64)).to(device)
    micro = batch.split(cfg.parallel.micro_batch_size)
    total = torch.zeros((), device=device)
    for i, mb in enumerate(micro):
        sync = i == len(micro) - 1
        ctx = model.no_sync() if (not sync and hasattr(model, "no_sync")) else contextlib.nullcontext()
        if hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(sync)
        with ctx, torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = lm_loss(model(mb[:, :-1]), mb[:, 1:])
        (loss / len(micro)).backward()
        total += loss.detach()
    if cfg.optimizer.grad_clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.grad_clip)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    total /= len(micro)
    dist.all_reduce(total, op=dist.ReduceOp.AVG)
    return float(total)
