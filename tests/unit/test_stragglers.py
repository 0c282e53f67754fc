"""Stragglers from the ranks' own times (raymp.driver.stragglers, raymp.runtime.thread_time):
which rank, against which peers, after how many steps, said once. A rank slowed for real runs in
integration/test_elastic.py."""

from __future__ import annotations

import time

from raymp.config import config_from_dict
from raymp.driver.stragglers import StragglerWatch, own_time_ratios
from raymp.runtime.thread_time import own_time_s


def _layout(**parallel):
    return config_from_dict({"parallel": {"zero": 0, "micro_batch_size": 1, **parallel},
                             "train": {"global_batch_size": 8, "seq_len": 32},
                             "model": {"preset": "tiny"}}).parallel.layout


def test_own_time_counts_the_threads_own_work_and_not_its_sleep():
    t0 = own_time_s()
    time.sleep(0.2)
    slept = own_time_s() - t0
    t0, end = own_time_s(), time.thread_time() + 0.1
    while time.thread_time() < end:
        pass
    worked = own_time_s() - t0
    assert slept < 0.05 and worked >= 0.1


def test_a_rank_is_compared_with_the_other_ranks_of_its_stage():
    """dp2 x pp2: stage 0 (ranks 0, 2) does twice stage 1's work; only rank 2 is slow for its stage."""
    ratios = own_time_ratios([2.0, 1.0, 6.0, 1.0], _layout(dp=2, pp=2))
    assert ratios == {0: 1 / 3, 1: 1.0, 2: 3.0, 3: 1.0}
    assert own_time_ratios([1.0], _layout(dp=1)) == {}  # no peer: nothing to compare


def test_a_straggler_is_reported_once_after_its_steps_in_a_row():
    said, watch, layout = [], StragglerWatch(2.0, 3, lambda line: said.append(line)), _layout(dp=2)
    history = []
    for step, own in enumerate([[1, 3], [1, 3], [1, 1], [1, 3], [1, 3], [1, 3], [1, 3]]):
        metrics = {"step": step}
        watch.after_step(own, layout, metrics, lambda rank: f" (node n{rank})")
        history.append(metrics)
    assert [m["straggler_ratio"] for m in history] == [3, 3, 1, 3, 3, 3, 3]
    assert watch.reported == [(5, 1)] and history[5]["straggler_rank"] == 1
    assert len(said) == 1 and said[0].startswith("straggler: rank 1 (node n1) took 3.0x")
    assert "elastic.straggler_factor=2" in said[0]


def test_a_layout_change_starts_the_count_again_and_zero_turns_it_off():
    watch = StragglerWatch(2.0, 2, lambda line: None)
    watch.after_step([1, 3], _layout(dp=2), {"step": 0})
    watch.after_step([1, 3, 1, 1], _layout(dp=4), {"step": 1})  # another layout: rank 1 counts from 1
    watch.after_step([1, 3, 1, 1], _layout(dp=4), {"step": 2}, launch=1)  # set up anew: from 1 again
    assert watch.reported == []
    off, metrics = StragglerWatch(0, 1, lambda line: None), {"step": 0}
    off.after_step([1, 9], _layout(dp=2), metrics)
    assert off.reported == [] and "straggler_ratio" not in metrics
