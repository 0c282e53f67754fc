"""Plain one-process training: no Ray, no process group, no wrappers. The ground truth that every
parallel layout is tested against (same seed, same global batch, same data order)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from raymp.config import RunConfig
from raymp.data import TrainOrder, load_dataset
from raymp.loss import lm_loss
from raymp.models.build import build_model, model_spec
from raymp.models.masks import document_eot, mask_kwargs
from raymp.models.moe import finish_routing, moe_blocks, reset_routing, set_aux_grad_scale
from raymp.optim import build_optimizer, build_scheduler
from raymp.parallel.pipeline import autocast_context


def train_single_process(cfg: RunConfig, steps: int | None = None, device: str | torch.device = "cpu",
                         step_done: Callable[[int], None] | None = None,
                         routing: list | None = None, skip_updates: frozenset[int] = frozenset(),
                         ) -> tuple[list[float], dict]:
    """Returns (loss per step, final state dict). Each step averages the loss over the whole
    global batch, processed in chunks of micro_batch_size (memory only; the math is the same).
    `device` and `step_done(step)` (called after each optimizer step) let the GPU check time
    this loop as its yardstick; `routing`, if given, gets each step's MoE routing
    (raymp.models.moe.finish_routing). The steps in `skip_updates` apply no update, as a
    distributed run passes over a non-finite step (raymp.driver.health): the LR schedule moves on."""
    data, order = dataset_and_order(cfg)
    device = torch.device(device)
    model = build_model(model_spec(cfg.model, data.vocab_size, cfg.seed), cfg.seed, device)
    optimizer = build_optimizer(model.parameters(), cfg.optimizer)
    scheduler = build_scheduler(optimizer, cfg.optimizer, cfg.train.steps)
    if cfg.precision == "fp8":
        raise ValueError("the single-process reference trains fp32 or bf16, not fp8 (float8 is applied to "
                         "distributed runs only); compare an fp8 run with a bf16 one")
    autocast_dtype = torch.bfloat16 if cfg.bf16 else None
    eot = document_eot(cfg, data)
    blocks = moe_blocks(model)
    losses = []
    for step in range(steps or cfg.train.steps):
        chunks = data.gather(order.batch(step)).reshape(
            -1, cfg.parallel.micro_batch_size, cfg.train.seq_len + 1
        )
        set_aux_grad_scale(blocks, 1 / len(chunks))
        total = 0.0
        for chunk in chunks:
            batch = torch.from_numpy(chunk.astype(np.int64)).to(device)
            with autocast_context(device, autocast_dtype):
                loss = lm_loss(model(batch[:, :-1], **mask_kwargs(batch[:, :-1], eot)), batch[:, 1:])
            (loss / len(chunks)).backward()
            total += loss.item()
        if cfg.optimizer.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.grad_clip)
        if step in skip_updates:
            reset_routing(blocks)
            step_routing = {}
        else:
            optimizer.step()
            step_routing = finish_routing(blocks)
        if routing is not None:
            routing.append(step_routing)
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total / len(chunks))
        if step_done is not None:
            step_done(step)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def single_process_gradients(cfg: RunConfig) -> dict[str, torch.Tensor]:
    """Gradient of the first step's loss (mean over its micro-batches) for every parameter, by
    name, before clipping or any update: what each parallel layout must reproduce exactly."""
    data, order = dataset_and_order(cfg)
    model = build_model(model_spec(cfg.model, data.vocab_size, cfg.seed), cfg.seed)
    chunks = data.gather(order.batch(0)).reshape(-1, cfg.parallel.micro_batch_size, cfg.train.seq_len + 1)
    set_aux_grad_scale(moe_blocks(model), 1 / len(chunks))
    for chunk in chunks:
        batch = torch.from_numpy(chunk.astype(np.int64))
        logits = model(batch[:, :-1], **mask_kwargs(batch[:, :-1], document_eot(cfg, data)))
        (lm_loss(logits, batch[:, 1:]) / len(chunks)).backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    if model_spec(cfg.model, data.vocab_size).tie_embeddings:
        grads["output.weight"] = grads["tok_embeddings.weight"]
    return grads


def dataset_and_order(cfg: RunConfig):
    """The same prepared dataset and global order a distributed run reads."""
    data = load_dataset(
        cfg.data, cfg.train.seq_len, log=lambda *_: None, cpu_wait_s=cfg.resources.placement_timeout_s
    )
    return data, TrainOrder(data.num_samples, cfg.data.val_fraction, cfg.seed, cfg.train.global_batch_size)


@torch.no_grad()
def single_process_val_loss(cfg: RunConfig, weights: dict[str, torch.Tensor]) -> float:
    """Mean loss of `weights` over the held-out batches a run validates on (the first
    train.eval_batches global batches of the validation split), micro-batch by micro-batch."""
    data, order = dataset_and_order(cfg)
    model = build_model(model_spec(cfg.model, data.vocab_size, cfg.seed), cfg.seed)
    model.load_state_dict(weights)
    g, mb = cfg.train.global_batch_size, cfg.parallel.micro_batch_size
    losses = []
    for i in range(cfg.train.eval_batches):
        tokens = data.gather(order.val_ids[i * g:(i + 1) * g]).astype(np.int64)
        for chunk in torch.from_numpy(tokens).split(mb):
            logits = model(chunk[:, :-1], **mask_kwargs(chunk[:, :-1], document_eot(cfg, data)))
            losses.append(lm_loss(logits, chunk[:, 1:]).item())
    return sum(losses) / len(losses)
