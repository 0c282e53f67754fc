"""elastic.peer_copy_every: each rank's part of the state kept in Ray's object store twice (its
node and another); a restart loads it instead of a checkpoint from storage. Here on the session's
Ray (a killed rank; its part outlives it in the object store); system/test_fault_matrix_cluster.py
loses a node, so the copy on the other node is the one that is loaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray

from helpers.faults import (COPY_TIMEOUT_S, ROOM_TIMEOUT_S, STEPS, Reference, check_against_reference,
                           kill_rank_after, matrix_cfg, wait_until)
from helpers.ckpt_workers import HoldsBackPeerCopyWorker
from raymp import Trainer


@pytest.fixture(scope="module")
def ref(data_cache, tmp_path_factory):
    return Reference.of(matrix_cfg(tmp_path_factory.mktemp("ref"), data_cache))


@pytest.mark.timeout(300)
def test_a_restart_loads_the_peer_copy_and_reads_no_checkpoint(ref, data_cache, tmp_path):
    """No checkpoint on storage before the end (checkpoint.every past the run): without the peer
    copy the restart would start over; with it, it resumes at the copy's step (a pipeline layout
    reloads one in the survivors test below)."""
    cfg = matrix_cfg(tmp_path, data_cache, parallel={"micro_batch_size": 1, "dp": 2, "zero": 3},
                     checkpoint={"every": 100}, elastic={"peer_copy_every": 2})
    with Trainer(cfg, progress=False) as trainer:
        trainer.setup()
        kill_rank_after(trainer, 5, rank=1, copied=True)
        history = trainer.fit()
        (event,) = trainer.restarts
        on_disk = [c.step for c in trainer.checkpoints.store.committed()]
    assert event["recovery"] == "restart" and event["resumed_step"] >= 4
    assert event["checkpoint"] == "peer memory"
    assert on_disk == [STEPS]  # the run's final save only: nothing was there to read
    check_against_reference(history, ref, range(STEPS))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("parallel,lost,kept,spares", [
    ({"dp": 2, "zero": 3}, 1, [0], 0),
    # A pipeline replica broken in part: rank 3 (dp 1, stage 1) is lost, ranks 0 and 1 go on as
    # the one replica, rank 2 is let go.
    ({"dp": 2, "pp": 2, "zero": 1, "schedule": "1f1b"}, 3, [0, 1], 0),
    # The same with a warm spare: ranks 0-2 go on and the spare takes rank 3's place, dp 2 kept.
    ({"dp": 2, "pp": 2, "zero": 1, "schedule": "1f1b"}, 3, [0, 1, 2], 1),
], ids=["dp2-zero3", "dp2xpp2-zero1", "dp2xpp2-zero1-spare"])
def test_survivors_without_a_whole_copy_reload_the_peer_copy_in_their_own_processes(
        parallel, lost, kept, spares, ref, data_cache, tmp_path):
    """keep_survivors where one rank alone holds part of the state: the survivors cannot go on
    with what they hold, but with a copy every step they reload the copy of the failed step's
    start, in the same processes: nothing redone, nothing read from storage; a new process only
    where a warm spare (started before the loss) takes a lost rank's place."""
    cfg = matrix_cfg(tmp_path, data_cache, parallel={"micro_batch_size": 1, **parallel},
                     checkpoint={"every": 100},
                     elastic={"peer_copy_every": 1, "keep_survivors": True, "spares": spares})
    with Trainer(cfg, progress=False) as trainer:
        trainer.setup()
        pids = [n["pid"] for n in trainer.group.nodes]
        victim, spare_pids = trainer.group.workers[lost], []
        if spares:
            wait_until(lambda: trainer.group.spares.ready() == spares, "the spare started (ROOM_TIMEOUT_S)",
                       ROOM_TIMEOUT_S)
            spare_pids = trainer.group.spares.pids()

        def kill_after_step_3(name, info):  # on the training thread: the copy of step 3 is started
            if name == "step" and info["done"] == 3 and not trainer.restarts:
                newest = trainer.session.peer_copies.kept[-1]  # handed over beside step 4
                assert newest.step == 3 and newest.handed_over(COPY_TIMEOUT_S)
                ray.kill(victim)

        trainer.on_event = kill_after_step_3
        history = trainer.fit()
        (event,) = trainer.restarts
        layout = trainer.config.parallel.layout
    assert event["recovery"] == "survivors reloaded" and event["checkpoint"] == "peer memory"
    assert event["resumed_step"] == event["failed_step"]
    assert event["pids"] == [pids[r] for r in kept] + spare_pids
    assert layout.dp == (2 if spares else 1)
    check_against_reference(history, ref, range(STEPS))


@pytest.mark.timeout(300)
def test_a_spare_lost_in_the_survivors_reload_restarts_from_the_peer_copy(ref, data_cache, tmp_path):
    """dp2 x pp2 ZeRO-1, elastic.spares=1: rank 3 is killed and the spare taking its place in the
    survivors' reload dies in its set-up. The survivors hold no whole copy (they were reloading
    it), so the second attempt restarts the run from the same peer copy: nothing read from
    storage, no step redone, dp 2 kept, every step like one process."""
    from helpers.ckpt_workers import DiesJoiningOnceWorker

    cfg = matrix_cfg(tmp_path, data_cache,
                     parallel={"micro_batch_size": 1, "dp": 2, "pp": 2, "zero": 1, "schedule": "1f1b"},
                     checkpoint={"every": 100},
                     elastic={"peer_copy_every": 1, "keep_survivors": True, "spares": 1})
    with Trainer(cfg, progress=False, worker_cls=DiesJoiningOnceWorker) as trainer:
        trainer.setup()
        victim = trainer.group.workers[3]
        wait_until(lambda: trainer.group.spares.ready() == 1, "the spare started (ROOM_TIMEOUT_S)",
                   ROOM_TIMEOUT_S)

        def kill_after_step_3(name, info):  # on the training thread: the copy of step 3 is started
            if name == "step" and info["done"] == 3 and not trainer.restarts:
                assert trainer.session.peer_copies.kept[-1].handed_over(COPY_TIMEOUT_S)
                (Path(trainer.config.output_dir) / "die-joining").touch()  # for the spare's set-up
                ray.kill(victim)

        trainer.on_event = kill_after_step_3
        history = trainer.fit()
        (event,) = trainer.restarts
        failures = trainer.elastic.failures
        on_disk = [c.step for c in trainer.checkpoints.store.committed()]
    assert event["recovery"] == "restart" and event["checkpoint"] == "peer memory"
    assert event["attempts"] == 2 and "while reloading survivors" in failures[1]["message"]
    assert event["resumed_step"] == event["failed_step"] and event["layout_after"]["dp"] == 2
    assert on_disk == [STEPS]
    check_against_reference(history, ref, range(STEPS))


@pytest.mark.timeout(300)
def test_a_copy_a_lost_rank_never_handed_over_is_passed_over_for_the_one_before(ref, data_cache, tmp_path):
    """A copy reaches the object store while the next step runs: rank 1 is lost before it has
    handed its part of the copy of step 3 over, so the survivor reloads the copy of step 2 (one
    step redone, still nothing read from storage) and the run matches the reference."""
    cfg = matrix_cfg(tmp_path, data_cache, parallel={"micro_batch_size": 1, "dp": 2, "zero": 3},
                     checkpoint={"every": 100}, elastic={"peer_copy_every": 1, "keep_survivors": True})
    with Trainer(cfg, progress=False, worker_cls=HoldsBackPeerCopyWorker) as trainer:
        trainer.setup()
        pids = [n["pid"] for n in trainer.group.nodes]
        kill_rank_after(trainer, 3, rank=1)
        history = trainer.fit()
        (event,) = trainer.restarts
        on_disk = [c.step for c in trainer.checkpoints.store.committed()]
    assert event["recovery"] == "survivors reloaded" and event["checkpoint"] == "peer memory"
    assert (event["failed_step"], event["resumed_step"]) == (3, 2)
    assert event["pids"] == pids[:1] and on_disk == [STEPS]
    check_against_reference(history, ref, range(STEPS))
