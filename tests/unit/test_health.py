"""The run-health rules without actors: what NonFinitePolicy does after each kind of step under
each train.on_nonfinite, and the automatic step deadline (StepDeadline) from measured steps."""

from __future__ import annotations

import math

import pytest

from raymp.config import config_from_dict
from raymp.driver.health import NonFiniteError, NonFinitePolicy, StepDeadline


def _policy(**train):
    said = []
    cfg = config_from_dict({"train": train, "checkpoint": {"every": 2}})  # restore needs checkpoints
    return NonFinitePolicy(cfg.train, said.append), said


def _step(step: int, finite: bool = True) -> dict:
    return {"step": step, "grad_norm": 1.0 if finite else math.nan, "loss": 2.0 if finite else math.nan}


def test_skip_passes_batches_over_until_the_limit_in_a_row():
    policy, said = _policy(nonfinite_limit=2)
    steps = [_step(0), _step(1, False), _step(2), _step(3, False)]
    assert [policy.after_step(m) for m in steps] == [False] * 4
    assert [m["update_skipped"] for m in steps] == [0, 1, 0, 1] and policy.skipped == [1, 3]
    assert len(said) == 2 and "step 1: the gradient norm is nan" in said[0] and "passed over" in said[0]
    with pytest.raises(NonFiniteError, match=r"2 non-finite steps in a row \(train.nonfinite_limit=2\)"):
        policy.after_step(_step(4, False))


def test_stop_stops_at_the_first():
    policy, said = _policy(on_nonfinite="stop")
    assert policy.after_step(_step(0)) is False
    with pytest.raises(NonFiniteError, match="step 1: .* the run stops \\(train.on_nonfinite=stop"):
        policy.after_step(_step(1, False))


def test_restore_asks_once_per_step_then_stops():
    policy, said = _policy(on_nonfinite="restore")
    assert policy.after_step(_step(5, False)) is True and "goes back to its newest checkpoint" in said[0]
    assert policy.after_step(_step(4)) is False and policy.after_step(_step(6, False)) is True
    with pytest.raises(NonFiniteError, match="again after going back to a checkpoint for it"):
        policy.after_step(_step(5, False))


def test_the_automatic_deadline_skips_the_first_step_and_follows_the_slowest():
    deadline = StepDeadline(config_from_dict({}).elastic)  # the shipped defaults: x10, at least 60 s
    assert deadline.limit()[0] is None
    deadline.observe(500.0)  # a launch's first step (compiling) sets nothing
    assert deadline.limit()[0] is None
    deadline.observe(2.0)
    assert deadline.limit()[0] == 60  # the floor
    deadline.observe(9.0)
    seconds, knob = deadline.limit()
    assert seconds == 90 and "elastic.hang_factor=10" in knob and "elastic.hang_floor_s=60" in knob
    # A step whose call also writes a blocking checkpoint gets checkpoint.write_timeout_s more.
    seconds, knob = deadline.limit(600.0)
    assert seconds == 690 and "checkpoint.write_timeout_s=600" in knob and "elastic.hang_factor" in knob
    deadline.new_launch()
    assert deadline.limit()[0] is None and deadline.limit(600.0)[0] is None
    fixed = StepDeadline(config_from_dict({"elastic": {"step_timeout_s": 5}}).elastic)
    assert fixed.limit() == (5, "elastic.step_timeout_s")
    assert fixed.limit(30.0)[0] == 35
    off = StepDeadline(config_from_dict({"elastic": {"hang_factor": 0}}).elastic)
    off.observe(1.0), off.observe(1.0)
    assert off.limit()[0] is None
