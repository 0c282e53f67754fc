"""StepCalls without actors: which step is queued on the ranks when (one step ahead, never across
a save that cannot ride on a step's call or a peer copy), the save order a call carries, and what
a lost rank leaves for the elastic controller."""

from __future__ import annotations

import pytest

from raymp.config import config_from_dict
from raymp.driver.step_calls import StepCalls
from raymp.runtime.rank_calls import WorkerLostError


class _Group:
    """Records what is queued and collected; a step's refs are (step, rank)."""

    def __init__(self, lose_at: int | None = None):
        self.events: list[tuple] = []
        self.lose_at = lose_at

    def submit(self, method: str, step: int, order) -> list:
        self.events.append(("queue", step, order))
        return [(step, 0), (step, 1)]

    def collect(self, refs: list, timeout_s, knob: str) -> list:
        step = refs[0][0]
        self.events.append(("collect", step))
        if step == self.lose_at:
            raise WorkerLostError("rank 1 died", 1, "died", None)
        return [f"report {step}.{rank}" for _, rank in refs]


class _Saves:
    """A save is due after every `every` steps; it rides on a step's call unless `blocked`."""

    def __init__(self, every: int, blocked: bool = False):
        self.every, self.blocked = every, blocked

    def due(self, steps_done: int, total: int) -> bool:
        return steps_done % self.every == 0

    def order(self, steps_done: int, total: int):
        return f"save {steps_done}" if self.due(steps_done, total) and not self.blocked else None


class _PeerCopies:
    def __init__(self, every: int = 0):
        self.every = every

    def due(self, steps_done: int) -> bool:
        return bool(self.every) and steps_done % self.every == 0


def _run(steps, group, saves, copies=None):
    cfg = config_from_dict({"train": {"steps": 20}})
    calls = StepCalls(cfg)
    for step in steps:
        reports, seconds = calls.run(group, cfg, saves, copies or _PeerCopies(), step, next_may_start=True)
        assert reports == [f"report {step}.0", f"report {step}.1"] and seconds >= 0
    return calls


def test_each_step_is_queued_before_the_previous_one_is_collected_and_carries_its_save():
    group = _Group()
    calls = _run(range(4), group, _Saves(every=2))
    assert group.events == [
        ("queue", 0, None), ("queue", 1, "save 2"), ("collect", 0),
        ("queue", 2, None), ("collect", 1),
        ("queue", 3, "save 4"), ("collect", 2),
        ("queue", 4, None), ("collect", 3),
    ]
    assert calls.queued_early == [1, 2, 3, 4] and calls.queued()


def test_a_save_that_cannot_ride_and_a_peer_copy_stop_the_look_ahead():
    group = _Group()
    _run(range(3), group, _Saves(every=2, blocked=True))
    # The save after step 1 is its own call between steps 1 and 2: step 2 is not queued early.
    assert group.events[:5] == [("queue", 0, None), ("queue", 1, None), ("collect", 0),
                                ("collect", 1), ("queue", 2, None)]
    group = _Group()
    _run(range(3), group, _Saves(every=100), _PeerCopies(every=2))
    assert ("queue", 2, None) == group.events[4] and group.events[3] == ("collect", 1)


def test_a_lost_rank_keeps_the_failed_step_and_drops_the_queued_one():
    group = _Group(lose_at=2)
    cfg = config_from_dict({"train": {"steps": 20}})
    calls = StepCalls(cfg)
    for step in range(2):
        calls.run(group, cfg, _Saves(every=100), _PeerCopies(), step, next_may_start=True)
    with pytest.raises(WorkerLostError, match="step 2: rank 1 died") as lost:
        calls.run(group, cfg, _Saves(every=100), _PeerCopies(), 2, next_may_start=True)
    assert (lost.value.rank, lost.value.step) == (1, 2)
    assert calls.failed.step == 2 and not calls.queued()
    assert calls.failed._unread == [(2, 0), (2, 1), (3, 0), (3, 1)]  # read once their calls end
