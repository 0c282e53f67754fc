"""The rank side of fault tolerance (raymp.runtime.rank_recovery.RankRecovery), without process
groups: the failure path's order (a host copy of the state, then the model and the checkpoint
writers let go, then the groups left), what passes through it untouched, where a set-up's state
comes from, and the vote it answers for. The paths with live groups are in
tests/integration/test_survivors.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from raymp.runtime import kept_state
from raymp.runtime.rank_recovery import RankRecovery, StateParts

pytestmark = pytest.mark.unit


@pytest.fixture
def recovery(monkeypatch):
    """A RankRecovery whose copies are labelled by the parts they were made of, and whose world
    logs what left it."""
    log = []
    def host_state(*parts):
        log.append(("copy", parts[0]))
        return {"of": parts[0], "scheduler": '{"last_epoch": 4}'}

    monkeypatch.setattr(kept_state, "host_state", host_state)
    monkeypatch.setattr(kept_state, "load_host_state",
                        lambda copy, *parts: log.append(("put back", copy["of"])))
    r = RankRecovery()
    monkeypatch.setattr(r.world, "leave", lambda broken: log.append(("left", broken)))
    r.log = log
    return r


def _lost_peer():
    raise RuntimeError("step failed") from dist.DistError("Connection closed by peer [10.0.0.2]:4242")


def test_a_peer_lost_in_a_step_keeps_that_state_then_lets_the_groups_go(recovery):
    recovery.keep(StateParts("a join's set-up", None, None))  # a copy from before: stale now
    with pytest.raises(dist.DistError, match="RuntimeError: step failed"):
        recovery.run_step(_lost_peer, lambda: StateParts("the failed step's model", None, None),
                          lambda: recovery.log.append(("released",)))
    assert recovery.log == [("copy", "a join's set-up"), ("copy", "the failed step's model"), ("released",),
                            ("left", True)]
    recovery.world.broken = True  # as WorldMembership.leave(broken=True) leaves it
    ran = []
    with pytest.raises(dist.DistError, match="left its process group"):
        recovery.run_step(lambda: ran.append(1), lambda: None, lambda: None)
    assert not ran, "no step may run on a world this rank left"
    recovery.restore(StateParts("the new layout's model", None, None), (), None, None)
    assert recovery.log[-1] == ("put back", "the failed step's model")


def test_an_error_that_is_not_a_lost_peer_passes_and_the_rank_stays_in_its_world(recovery):
    def bug():
        raise ValueError("shape mismatch")

    with pytest.raises(ValueError, match="shape mismatch"):
        recovery.run_step(bug, lambda: StateParts("model", None, None),
                          lambda: recovery.log.append("released"))
    assert recovery.log == [] and not recovery.world.broken
    assert recovery.run_step(lambda: "report", lambda: None, lambda: None) == "report"


def test_a_setup_from_memory_keeps_the_copy_and_makes_no_initial_values(recovery):
    assert recovery.keep(StateParts("survivor", None, None)) == 4
    assert recovery.begin_setup(from_memory=True) is False
    assert recovery.kept.copy is not None
    assert recovery.begin_setup(from_memory=False) is True
    assert recovery.kept.copy is None, "a set-up not from memory must never find a stale copy"


def test_the_vote_answers_only_for_its_own_step(recovery):
    recovery.rank, recovery.world_size = 1, 2
    ballot = recovery.ballot(7, 2.5, np.array([3, 4]), ids_per_rank=2)
    # rank 0's row, as the all-reduce's sum brings it in
    ballot.rows[0] = torch.tensor([1.0, 2.25, 2, 7, 1, 2], dtype=torch.float64)
    recovery.counted(ballot)
    record = recovery.step_record(7)
    assert record.losses == [2.25, 2.5] and [list(ids) for ids in record.sample_ids] == [[1, 2], [3, 4]]
    assert recovery.step_record(6) is None and recovery.step_record(8) is None
