"""The commit vote's ballots and what the driver builds from them for a step whose reports are
not all in (raymp.runtime.commit_vote, raymp.driver.metrics.with_stand_ins). The vote among
ranks (on the gradient norm's all-reduce), and a rank lost after it, run in
integration/test_survivors.py."""

from __future__ import annotations

import numpy as np
import pytest

from raymp.config import config_from_dict
from raymp.driver.metrics import with_stand_ins
from raymp.runtime.commit_vote import Ballot, StepRecord
from raymp.runtime.report import RankReport


def test_the_summed_ballots_give_every_ranks_loss_and_samples_exactly():
    """Three ranks' ballots summed as the all-reduce does: each rank's row back as it was."""
    ids = [np.array([2**40 + 3, 7, 0]), None, np.array([5])]
    losses = [3.25 + 1e-12, None, float("nan")]  # a NaN loss is not taken for "no loss"
    ballots = [Ballot(4, losses[r], ids[r], 4, r, 3) for r in range(3)]
    summed = sum(b.tensor for b in ballots)
    ballots[1].tensor.copy_(summed)
    record = ballots[1].record()
    assert record.step == 4 and record.losses[:2] == losses[:2] and np.isnan(record.losses[2])
    assert (record.sample_ids[0] == ids[0]).all() and record.sample_ids[0].dtype == np.int64
    assert record.sample_ids[1] is None and record.sample_ids[2].tolist() == [5]
    with pytest.raises(ValueError, match="room for 2"):
        Ballot(4, 1.0, ids[0], 2, 0, 3)


def test_ballots_of_different_steps_are_refused():
    a, b = Ballot(4, 1.0, None, 1, 0, 2), Ballot(5, 1.0, None, 1, 1, 2)
    a.tensor.add_(b.tensor)
    with pytest.raises(RuntimeError, match="ballots of steps"):
        a.record()


def _report(rank: int, loss, ids) -> RankReport:
    return RankReport(rank=rank, loss=loss, grad_norm=1.0, lr=0.1, compute_s=0.5 + rank, data_wait_s=0.0,
                      peak_mem_bytes=10, param_bytes=1, grad_bytes=1, optim_bytes=1, sample_ids=ids)


def test_a_lost_ranks_report_stands_in_from_a_peer_of_the_same_part_with_what_it_voted():
    """dp2 x pp2: rank 3 (replica 1, last stage) is lost after the vote: its stand-in copies rank
    1 (the last stage of replica 0) but has rank 3's own loss; the samples of replica 1 come from
    rank 2's report, the first stage."""
    layout = config_from_dict({"parallel": {"dp": 2, "pp": 2, "zero": 0, "micro_batch_size": 1},
                               "train": {"global_batch_size": 8, "seq_len": 32},
                               "model": {"preset": "tiny"}}).parallel.layout
    reports = {0: _report(0, None, np.arange(4)), 1: _report(1, 2.0, None), 2: _report(2, None, np.arange(4, 8))}
    record = StepRecord(3, [None, 2.0, None, 4.0], [np.arange(4), None, np.arange(4, 8), None])
    full = with_stand_ins(reports, record, layout)
    assert [r.rank for r in full] == [0, 1, 2, 3] and [r.stand_in for r in full] == [False] * 3 + [True]
    assert full[3].loss == 4.0 and full[3].compute_s == reports[1].compute_s and full[3].sample_ids is None
