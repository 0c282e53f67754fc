"""elastic.keep_survivors (on by default where the layout allows it) on the session's Ray: a
rank's actor is killed mid-run (ray.kill) and the survivors go on from the failed step with the
state they hold in memory. Checked like a layout test (every step once, loss within 1e-5 of one
process, samples in the global order), plus: the survivors' processes are the same, no checkpoint
is read and no step is redone. system/test_fault_matrix_cluster.py loses whole nodes the same way."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.faults import (MOE_MODEL, ROOM_TIMEOUT_S, STEPS, Reference, check_against_reference,
                           kill_rank_after, matrix_cfg, wait_until)
from raymp import Trainer
from raymp.config import ConfigError, config_from_dict
from raymp.config.rules import keeps_survivors


@pytest.fixture(scope="module")
def ref(data_cache, tmp_path_factory):
    return Reference.of(matrix_cfg(tmp_path_factory.mktemp("ref"), data_cache))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("parallel,lost,kept_dp", [
    ({"dp": 2}, 1, 1),
    # The rendezvous rank is lost; dp 4 -> 3 does not split the global batch of 8: dp 2 goes on.
    ({"dp": 4}, 0, 2),
    # Whole replicas of pp, tp or cp ranks: replica 1 loses a rank (its other rank is let go at
    # once, so no peer waits on it), replica 0 goes on.
    ({"dp": 2, "pp": 2, "schedule": "1f1b"}, 3, 1),
    ({"dp": 2, "tp": 2}, 2, 1),
    ({"dp": 2, "cp": 2}, 3, 1),
    # HSDP: two groups of two ZeRO-3 shards; group 0 loses rank 0 (rank 1 is let go), group 1
    # holds the whole state and goes on as plain ZeRO-3 over its two shards.
    ({"dp": 4, "dp_replicate": 2, "zero": 3}, 0, 2),
], ids=["dp2", "dp4-rank0", "dp2xpp2", "dp2xtp2", "dp2xcp2", "hsdp2x2-zero3"])
def test_survivors_keep_their_state_and_redo_no_step(parallel, lost, kept_dp, ref, data_cache, tmp_path):
    """elastic.keep_survivors unset, as a user leaves it: every layout here leaves a whole copy of the
    state, so the survivors go on by default."""
    cfg = matrix_cfg(tmp_path, data_cache, parallel={"zero": 0, "micro_batch_size": 1, **parallel},
                     elastic={"keep_survivors": None, "grow_back": False})
    with Trainer(cfg, progress=False) as trainer:
        trainer.setup()
        pids = [n["pid"] for n in trainer.group.nodes]
        lost_copy = {pids[r] for r in trainer.config.parallel.layout.replica_of(lost)}
        kill_rank_after(trainer, 3, rank=lost)
        history = trainer.fit()
        (event,) = trainer.restarts
        layout = trainer.config.parallel.layout
    assert event["recovery"] == "survivors" and event["checkpoint"] is None  # nothing read from storage
    assert event["resumed_step"] == event["failed_step"]  # nothing redone
    assert (layout.dp, layout.cp, layout.pp, layout.tp) == (
        kept_dp,
        *(parallel.get(d, 1) for d in ("cp", "pp", "tp")),
    )
    assert layout.zero == parallel.get("zero", 0) and layout.dp_replicate == 1
    # The same processes go on, whole copies of the state (which: whichever gloo let end the step first).
    assert len(event["pids"]) == layout.world_size and set(event["pids"]) <= set(pids) - lost_copy
    check_against_reference(history, ref, range(STEPS))


@pytest.mark.timeout(300)
def test_a_survivor_stuck_in_its_failed_step_is_told_to_drop_it(ref, data_cache, tmp_path):
    """dp2: rank 1 is killed after step 3 while rank 0's step 4 would never end by itself (it has
    no collective to fail). The driver abandons it at once (Worker.abandon_step, in the actor's
    control thread) and rank 0 goes on alone with its state, the same process. Without that the
    run would stop after resources.collective_timeout_s with no survivor."""
    from helpers.ckpt_workers import EndlessStepWorker

    cfg = matrix_cfg(
        tmp_path,
        data_cache,
        parallel={"dp": 2, "zero": 0, "micro_batch_size": 1},
        elastic={"keep_survivors": True, "grow_back": False},
        resources={"collective_timeout_s": 120},
    )
    with Trainer(cfg, progress=False, worker_cls=EndlessStepWorker) as trainer:
        trainer.setup()
        pid = trainer.group.nodes[0]["pid"]
        trainer.group.call("arm_endless", 3, 0)  # steps count from 0: the fourth
        kill_rank_after(trainer, 3, rank=1)
        history = trainer.fit()
        (event,) = trainer.restarts
    assert event["recovery"] == "survivors" and event["pids"] == [pid]
    assert event["failed_step"] == event["resumed_step"] == 3
    check_against_reference(history, ref, range(STEPS))


def test_keep_survivors_is_refused_where_no_second_copy_of_the_state_exists(tmp_path, data_cache):
    for zero in (1, 2, 3):
        cfg = matrix_cfg(
            tmp_path, data_cache, parallel={"dp": 2, "zero": zero}, elastic={"keep_survivors": True}
        )
        with pytest.raises(
            (ConfigError, ValueError), match="elastic.keep_survivors needs a second whole copy"
        ):
            config_from_dict(cfg)
    hsdp = matrix_cfg(tmp_path, data_cache, parallel={"dp": 4, "dp_replicate": 2, "zero": 3},
                      elastic={"keep_survivors": True})
    assert config_from_dict(hsdp).parallel.layout.state_replicas == 2  # each HSDP group holds it all
    copied = matrix_cfg(tmp_path, data_cache, parallel={"dp": 2, "zero": 3},
                        elastic={"keep_survivors": True, "peer_copy_every": 1})
    assert config_from_dict(copied).elastic.keep_survivors  # the survivors reload the peer copy


@pytest.mark.timeout(300)
@pytest.mark.parametrize("parallel,lost", [
    ({"dp": 4}, 3),
    # HSDP 2x2 -> 1x2 -> 2x2: the group that joins takes its two shards from the other group's.
    ({"dp": 4, "dp_replicate": 2, "zero": 3}, 0),
    # Whole TP groups: the replica let go frees its own placement group, where the new one starts.
    ({"dp": 2, "tp": 2}, 2),
], ids=["dp4", "hsdp2x2-zero3", "dp2xtp2"])
def test_lost_replicas_join_back_from_live_peers(parallel, lost, ref, data_cache, tmp_path):
    """On one node, a killed rank's bundle stays placed: right after the survivors go on, the
    replicas they let go start again there and take their state from a survivor's memory."""
    cfg = matrix_cfg(tmp_path, data_cache, parallel={"zero": 0, "micro_batch_size": 1, **parallel},
                     elastic={"keep_survivors": True})
    with Trainer(cfg, progress=False) as trainer:
        trainer.setup()
        configured = trainer.config.parallel.layout
        pids = [n["pid"] for n in trainer.group.nodes]
        lost_copy = {pids[r] for r in configured.replica_of(lost)}
        kill_rank_after(trainer, 3, rank=lost, until_room=True)
        history = trainer.fit()
        survived, joined = trainer.restarts
        layout, pids_after = trainer.config.parallel.layout, [n["pid"] for n in trainer.group.nodes]
        keep_survivors = keeps_survivors(trainer.config)
    assert survived["recovery"] == "survivors" and joined["recovery"] == "live join"
    assert joined["checkpoint"] is None and joined["resumed_step"] == survived["resumed_step"]  # none redone
    assert layout.record() == configured.record() and keep_survivors  # the configured layout again
    # The survivors' processes go on as the first replicas; the joined ranks are new processes.
    kept = len(joined["pids"])
    assert pids_after[:kept] == joined["pids"] and set(joined["pids"]) <= set(pids) - lost_copy
    assert not set(pids_after[kept:]) & set(pids)
    check_against_reference(history, ref, range(STEPS))


@pytest.mark.timeout(300)
def test_a_warm_spare_takes_the_lost_ranks_place_with_dp_unchanged(ref, data_cache, tmp_path):
    """elastic.spares=1, dp2: a spare process is started beside the two ranks. Rank 1 is killed;
    in the same recovery rank 0 keeps its state and the spare (the same process, started before
    the loss) joins as rank 1 with rank 0's state: dp 2 throughout, no checkpoint read, no step
    redone, every step like one process; a new spare is started in its place."""
    cfg = matrix_cfg(tmp_path, data_cache, parallel={"zero": 0, "micro_batch_size": 1},
                     elastic={"keep_survivors": True, "spares": 1})
    with Trainer(cfg, progress=False) as trainer:
        trainer.setup()
        spares = trainer.group.spares
        wait_until(lambda: spares.ready() == 1, "the spare started (ROOM_TIMEOUT_S)", ROOM_TIMEOUT_S)
        (spare_pid,), rank0_pid = spares.pids(), trainer.group.nodes[0]["pid"]
        kill_rank_after(trainer, 3, rank=1)
        history = trainer.fit()
        (event,) = trainer.restarts
        pids_after, dp_after = [n["pid"] for n in trainer.group.nodes], trainer.config.parallel.dp
        spares_after = len(spares.groups)
    assert event["recovery"] == "survivors" and event["checkpoint"] is None
    assert event["resumed_step"] == event["failed_step"] and event["layout_after"]["dp"] == 2
    assert pids_after == event["pids"] == [rank0_pid, spare_pid] and dp_after == 2
    assert [m["dp"] for m in history] == [2] * STEPS
    assert spares_after == 1  # started anew
    check_against_reference(history, ref, range(STEPS))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dies", ["in its set-up", "receiving the state"])
def test_a_spare_lost_while_taking_a_lost_ranks_place_leaves_the_survivor_training(
        dies, ref, data_cache, tmp_path):
    """elastic.spares=1, dp2: rank 1 is killed and the spare taking its place dies in its set-up,
    or while rank 0 sends it the state. Rank 0 keeps the state it held and goes on alone (the same
    recovery, a second attempt); the spare started anew joins live when it is ready. No checkpoint
    read, no step redone."""
    from helpers.ckpt_workers import DiesJoiningOnceWorker, DiesReceivingOnceWorker

    cfg = matrix_cfg(tmp_path, data_cache, parallel={"zero": 0, "micro_batch_size": 1},
                     elastic={"keep_survivors": True, "spares": 1})
    worker_cls = DiesJoiningOnceWorker if dies == "in its set-up" else DiesReceivingOnceWorker
    with Trainer(cfg, progress=False, worker_cls=worker_cls) as trainer:
        trainer.setup()
        spares = trainer.group.spares
        wait_until(lambda: spares.ready() == 1, "the spare started (ROOM_TIMEOUT_S)", ROOM_TIMEOUT_S)
        (spare_pid,), rank0_pid = spares.pids(), trainer.group.nodes[0]["pid"]
        (Path(trainer.config.output_dir) / "die-joining").touch()  # for the first rank that joins
        kill_rank_after(trainer, 3, rank=1)
        history = trainer.fit()
        events, pids_after = trainer.restarts, [n["pid"] for n in trainer.group.nodes]
    survived, joined_later = events[0], events[1:]
    assert survived["recovery"] == "survivors" and survived["attempts"] == 2
    assert survived["pids"] == [rank0_pid] and survived["layout_after"]["dp"] == 1
    assert [e["recovery"] for e in joined_later] in ([], ["live join"])  # the new spare, once ready
    assert pids_after[0] == rank0_pid and spare_pid not in pids_after
    assert all(e["checkpoint"] is None for e in events) and survived["resumed_step"] == survived["failed_step"]
    check_against_reference(history, ref, range(STEPS))


@pytest.mark.timeout(300)
def test_spares_the_cluster_has_no_room_for_are_said_and_the_run_goes_on(data_cache, tmp_path, capfd):
    """A spare as large as each rank, on a Ray whose free CPUs hold the two ranks but not a
    third: one line on stderr says so (never a spare silently missing), and the run trains."""
    import ray
    from ray.util.placement_group import placement_group_table

    # What stays free once the tests before have let go (their placement groups are REMOVED at once,
    # their CPUs come back later): CPUs less those of the placement groups that live on (the shared
    # groups'). Counted from Ray's free CPUs now, a spare was placed as soon as the CPUs of the test
    # before came back, and no line was said. Two ranks wait for their room; a third never fits.
    held = sum(bundle.get("CPU", 0) for pg in placement_group_table().values()
               if pg["state"] != "REMOVED" for bundle in pg["bundles"].values())
    cpus = (ray.cluster_resources()["CPU"] - held) / 2.5
    cfg = matrix_cfg(tmp_path, data_cache, parallel={"zero": 0, "micro_batch_size": 1},
                     train={"steps": 2}, resources={"cpus_per_actor": cpus},
                     elastic={"keep_survivors": True, "spares": 1})
    with Trainer(cfg, progress=False) as trainer:
        history = trainer.fit()
    said = [line for line in capfd.readouterr().err.splitlines() if "elastic.spares" in line]
    assert len(said) == 1 and "1 of 1 spare ranks have no room" in said[0] and f"CPU={cpus:g}" in said[0]
    assert len(history) == 2


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dies", ["in its set-up", "receiving the state"])
def test_a_join_that_fails_leaves_the_survivors_training_and_is_tried_again(dies, ref, data_cache, tmp_path):
    """dp2: rank 1 is killed, rank 0 goes on alone; the rank started to join in its place dies in
    its set-up, or while rank 0 sends it the state. Rank 0 keeps the state it held (not the model
    it was rebuilding for the join), goes on, and the join is tried again at the next step and
    succeeds: no checkpoint read, no step redone, every step like one process."""
    from helpers.ckpt_workers import DiesJoiningOnceWorker, DiesReceivingOnceWorker

    cfg = matrix_cfg(tmp_path, data_cache, parallel={"zero": 0, "micro_batch_size": 1},
                     elastic={"keep_survivors": True})
    worker_cls = DiesJoiningOnceWorker if dies == "in its set-up" else DiesReceivingOnceWorker
    with Trainer(cfg, progress=False, worker_cls=worker_cls) as trainer:
        trainer.setup()
        pids = [n["pid"] for n in trainer.group.nodes]
        (Path(trainer.config.output_dir) / "die-joining").touch()  # for the first rank that joins
        kill_rank_after(trainer, 3, rank=1, until_room=True)
        history = trainer.fit()
        events, pids_after = trainer.restarts, [n["pid"] for n in trainer.group.nodes]
        marker_left = (Path(trainer.config.output_dir) / "die-joining").exists()
    assert not marker_left  # the first join's rank died
    assert [e["recovery"] for e in events] == ["survivors", "survivors", "live join"]
    assert all(e["checkpoint"] is None for e in events)
    assert pids_after[0] == pids[0] and pids_after[1] not in pids  # rank 0's process throughout
    assert [e["resumed_step"] for e in events[:2]] == [e["failed_step"] for e in events[:2]]
    check_against_reference(history, ref, range(STEPS))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("parallel, lost", [
    ({"dp": 2}, 1),
    ({"dp": 2, "pp": 2, "schedule": "1f1b"}, 3),
], ids=["dp2", "dp2xpp2"])
def test_a_rank_lost_after_its_step_was_taken_everywhere_costs_no_step(parallel, lost, ref, data_cache, tmp_path):
    """A rank takes step 3 whole (its commit vote passed, every rank stepped its optimizer) and
    dies before it reports. Every survivor holds step 3 applied and its report of it, and the vote
    gave each the lost rank's loss and samples: step 3 is recorded from them (the lost rank's
    report a stand-in), the survivors go on from step 4 with nothing read from storage and no step
    redone, and every step's loss and samples match one process."""
    from helpers.ckpt_workers import DiesAfterStepWorker

    cfg = matrix_cfg(tmp_path, data_cache, parallel={"zero": 0, "micro_batch_size": 1, **parallel},
                     elastic={"keep_survivors": None, "grow_back": False})  # the default
    with Trainer(cfg, progress=False, worker_cls=DiesAfterStepWorker) as trainer:
        trainer.setup()
        lost_replica = trainer.config.parallel.layout.replica_of(lost)
        trainer.group.call("arm_die_after", 3, lost)
        history = trainer.fit()
        (event,) = trainer.restarts
    assert event["recovery"] == "survivors" and event["failed_step"] == 3 and event["checkpoint"] is None
    assert event["resumed_step"] == 4 and [m["step"] for m in history] == list(range(STEPS))  # none redone
    assert set(history[3]["stand_in_ranks"]) <= set(lost_replica) and lost in history[3]["stand_in_ranks"]
    check_against_reference(history, ref, range(STEPS))


@pytest.mark.timeout(300)
def test_a_loss_that_takes_every_whole_copy_restores_from_the_checkpoint(ref, data_cache, tmp_path):
    """2x2 HSDP loses a rank of each group at once: no whole copy of the state is left in memory,
    so the run restarts from the newest committed checkpoint and redoes the steps since."""
    cfg = matrix_cfg(
        tmp_path,
        data_cache,
        parallel={"dp": 4, "dp_replicate": 2, "zero": 3, "micro_batch_size": 1},
        elastic={"keep_survivors": True},
    )
    with Trainer(cfg, progress=False) as trainer:
        trainer.setup()
        kill_rank_after(trainer, 3, rank=[0, 2], committed=True)
        history = trainer.fit()
        event = trainer.restarts[-1]
    assert event["recovery"] == "restart" and event["checkpoint"] is not None
    assert event["resumed_step"] <= event["failed_step"] and event["resumed_step"] > 0
    check_against_reference(history, ref, range(STEPS))


@pytest.fixture(scope="module")
def moe_ref(data_cache, tmp_path_factory):
    return Reference.of(matrix_cfg(tmp_path_factory.mktemp("moe_ref"), data_cache, model=MOE_MODEL))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("parallel,lost,recovery", [
    ({"dp": 2, "pp": 2, "schedule": "1f1b"}, 3, "survivors"),
    ({"dp": 4}, 2, "live join"),
    ({"dp": 4, "ep": 2}, 3, "survivors"),
    ({"dp": 4, "ep": 2}, 2, "live join"),
    ({"dp": 4, "dp_replicate": 2, "ep": 2, "zero": 3}, 3, "survivors"),
], ids=["dp2xpp2-survivors", "dp4-live-join", "dp4xep2-survivors", "dp4xep2-live-join", "hsdp2x2xep2-survivors"])
def test_an_moe_run_loses_a_rank_like_a_dense_one(parallel, lost, recovery, moe_ref, data_cache, tmp_path):
    """A mixture-of-experts run: the router biases (model state the bias update changes every
    step) and the routing counts of the step in flight must come through a loss exactly: every
    step once, each loss within 1e-5 of one process, the global order's samples. Under expert
    parallelism the lost rank's ep group goes with it (no whole copy of the state is left in
    it); the other group goes on, and a joined group takes its experts, shard by shard. Under
    HSDP with ep the lost rank's HSDP group goes, and the other group holds every expert."""
    cfg = matrix_cfg(tmp_path, data_cache, model=MOE_MODEL, parallel={"zero": 0, "micro_batch_size": 1, **parallel},
                     elastic={"keep_survivors": True, "grow_back": recovery == "live join"})
    with Trainer(cfg, progress=False) as trainer:
        trainer.setup()
        kill_rank_after(trainer, 3, rank=lost, until_room=recovery == "live join")
        history = trainer.fit()
        events = trainer.restarts
    assert [e["recovery"] for e in events][-1] == recovery
    assert all(e["checkpoint"] is None for e in events)
    check_against_reference(history, moe_ref, range(STEPS))
