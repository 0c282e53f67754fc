"""Training health: a step whose gradients are not finite (a NaN turned in on one rank after its
backward, as an overflow would) is caught on the step it happens under dp2 and pp2. With
train.on_nonfinite=skip the update is not applied and the run matches one process that skips
the same batch at every step (loss within 1e-5, samples the global order's); with 'restore' the
run goes back to its newest checkpoint, and a transient fault leaves it equal to one process that
never saw one; with 'stop', or past train.nonfinite_limit, or the same step again after a
restore, the run stops with one line and no checkpoint after the last good state is committed.
A checkpoint of non-finite state is never committed."""

from __future__ import annotations

import pytest

from helpers.faults import STEPS, Reference, check_against_reference, matrix_cfg
from raymp import Trainer
from raymp.checkpoint.store import CheckpointStore
from raymp.driver.health import NonFiniteError
from raymp.runtime.actor_group import ActorGroup

POISONED = 3  # the step whose gradients turn NaN

PP2 = {"dp": 1, "pp": 2, "zero": 1, "micro_batch_size": 2}


@pytest.fixture(scope="module")
def poisoning_group(ray_local):
    from helpers.ckpt_workers import NonFiniteGradientWorker

    group = ActorGroup(2, "cpu", placement_timeout_s=120, collective_timeout_s=120,
                       worker_cls=NonFiniteGradientWorker)
    yield group
    group.shutdown()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("parallel,rank", [({}, 1), (PP2, 0)], ids=["dp2", "pp2"])
def test_a_nonfinite_step_is_skipped_and_the_run_matches_one_process_skipping_it(
        parallel, rank, poisoning_group, data_cache, tmp_path, capsys):
    cfg = matrix_cfg(tmp_path, data_cache, parallel=parallel)
    ref = Reference.of(cfg, skip_updates=frozenset({POISONED}))
    poisoning_group.call("arm_nonfinite", [POISONED], rank)
    with Trainer(cfg, actor_group=poisoning_group, progress=False) as t:
        history = t.fit()
    check_against_reference(history, ref, range(STEPS))
    assert [m["update_skipped"] for m in history] == [int(s == POISONED) for s in range(STEPS)]
    err = capsys.readouterr().err  # said with the progress display off
    assert f"step {POISONED}: the gradient norm is nan" in err and "not applied" in err, err
    # Every checkpoint committed (2, 4, 6, 8) verifies and holds the skipping run's state.
    assert [c.step for c in CheckpointStore(cfg["checkpoint"]["dir"]).committed()] == [2, 4, 6, 8]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "train,poisoned,match",
    [
        ({"on_nonfinite": "stop"}, [POISONED], "train.on_nonfinite=stop"),
        (
            {"nonfinite_limit": 2},
            [POISONED, POISONED + 1],
            r"2 non-finite steps in a row \(train.nonfinite_limit=2\)",
        ),
    ],
    ids=["stop", "limit"],
)
def test_a_run_told_to_stop_on_nonfinite_steps_stops_with_its_last_good_state(
        train, poisoned, match, poisoning_group, data_cache, tmp_path):
    cfg = matrix_cfg(tmp_path, data_cache, train=train)
    poisoning_group.call("arm_nonfinite", poisoned, 1)
    with Trainer(cfg, actor_group=poisoning_group, progress=False) as t:  # closing commits the save in flight
        with pytest.raises(NonFiniteError, match=match):
            t.fit()
    last = poisoned[-1]
    assert [m["step"] for m in t.history] == list(range(last + 1))
    # No save starts after the step that stopped the run (one started before it may be committed).
    committed = [c.step for c in CheckpointStore(cfg["checkpoint"]["dir"]).committed()]
    assert committed[0] == 2 and all(step <= last for step in committed), committed


@pytest.mark.timeout(300)
@pytest.mark.parametrize("parallel,rank", [({}, 1), (PP2, 0)], ids=["dp2", "pp2"])
def test_restore_goes_back_to_the_newest_checkpoint_and_a_transient_fault_leaves_no_trace(
        parallel, rank, poisoning_group, data_cache, tmp_path, capsys):
    """train.on_nonfinite=restore, a NaN once at step 5: the run goes back to its checkpoint of
    step 4 and redoes steps 4 and 5; every step once, equal to one process that never saw it."""
    cfg = matrix_cfg(tmp_path, data_cache, parallel=parallel, train={"on_nonfinite": "restore"})
    ref = Reference.of(cfg)
    poisoning_group.call("arm_nonfinite", [5], rank, True)
    with Trainer(cfg, actor_group=poisoning_group, progress=False) as t:
        history = t.fit()
        restarts = t.restarts
    check_against_reference(history, ref, range(STEPS))
    assert [m["update_skipped"] for m in history] == [0] * STEPS
    (event,) = restarts
    assert event["reason"] == "nonfinite" and event["failed_step"] == 5 and event["resumed_step"] == 4
    assert "the run goes back to its newest checkpoint" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_restore_stops_when_the_same_step_is_nonfinite_again(poisoning_group, data_cache, tmp_path):
    cfg = matrix_cfg(tmp_path, data_cache, train={"on_nonfinite": "restore"})
    poisoning_group.call("arm_nonfinite", [5], 1)  # every time: not transient
    with Trainer(cfg, actor_group=poisoning_group, progress=False) as t:
        with pytest.raises(
            NonFiniteError, match="again after going back to a checkpoint for it: no transient fault"
        ):
            t.fit()
    assert len(t.restarts) == 1 and [m["step"] for m in t.history] == [0, 1, 2, 3, 4, 5]
