"""Parity checks shared by the layout tests: a parallel run against the single-process run on the
same seed, global batch and data order (losses within LOSS_RTOL, weights within a stated atol)."""

from __future__ import annotations

import torch

from raymp.config import config_from_dict
from raymp.reference import train_single_process
from raymp.trainer import Trainer

LOSS_RTOL = 1e-5


def run_parallel(cfg_dict, group):
    with Trainer(cfg_dict, actor_group=group, progress=False) as trainer:
        history = trainer.fit()
        state = trainer.state_dict()
    return [m["loss"] for m in history], history, state


def assert_losses_match(losses, ref_losses, rtol):
    assert len(losses) == len(ref_losses)
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= rtol * abs(b), f"step {step}: parallel {a!r} vs single-process {b!r}"


def assert_weights_match(state, ref_state, atol):
    assert set(state) == set(ref_state)
    for name, ref in ref_state.items():
        torch.testing.assert_close(
            state[name].float(), ref.float(), rtol=0, atol=atol, msg=lambda m: f"{name}: {m}"
        )


def check_parity(cfg, group, weight_atol=2e-5, reference: dict | None = None):
    """5 fp32 steps: losses within LOSS_RTOL of the single-process run (of `reference` where
    given, else of cfg), final weights within weight_atol, and the run learned something.
    Returns the parallel run's history."""
    losses, history, state = run_parallel(cfg, group)
    ref_losses, ref_state = train_single_process(config_from_dict(reference or cfg))
    assert_losses_match(losses, ref_losses, LOSS_RTOL)
    assert_weights_match(state, ref_state, atol=weight_atol)
    assert losses[-1] < losses[0]
    return history
