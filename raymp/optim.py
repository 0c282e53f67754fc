"""AdamW and its learning-rate schedule: linear warmup, then cosine decay to min_lr_ratio * lr."""

from __future__ import annotations

import math

import torch
from torch import nn


def param_groups(params: list[nn.Parameter], weight_decay: float) -> list[dict]:
    """Decay matrices, not norms/biases (1-D): the usual transformer recipe."""
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def adamw_kwargs(opt_cfg) -> dict:
    """fused=None, not False, when off: torch then picks its multi-tensor (foreach) loop."""
    return dict(lr=opt_cfg.lr, betas=(opt_cfg.beta1, opt_cfg.beta2), eps=opt_cfg.eps,
                fused=True if opt_cfg.fused else None)


def build_optimizer(params, opt_cfg) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups(list(params), opt_cfg.weight_decay), **adamw_kwargs(opt_cfg))


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Multiplier of the base lr for optimizer step `step` (0-based)."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def warmup_note(opt_cfg, total_steps: int) -> str | None:
    """What a run shorter than its warm-up does, said once at its start (a smoke run with a few
    steps is meant to run, not to be refused); None for a run that leaves warm-up."""
    w = opt_cfg.warmup_steps
    if w < total_steps:
        return None
    return (
        f"note: optimizer.warmup_steps ({w}) is not below train.steps ({total_steps}): the whole "
        "run warms up, its last step at "
        f"{lr_factor(total_steps - 1, w, total_steps, opt_cfg.min_lr_ratio):.0%} of optimizer.lr"
    )


def build_scheduler(optimizer, opt_cfg, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: lr_factor(s, opt_cfg.warmup_steps, total_steps, opt_cfg.min_lr_ratio),
    )
