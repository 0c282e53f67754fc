"""The fault matrix on a simulated multi-node cluster: nodes lost mid-run, mid-write, mid-restart,
twice; grow-back; no room left; a killed driver. Each scenario's steps are checked like a layout
test's (loss within 1e-5 of one process, samples in the global order) and each ends within its
bound (fault_cluster_probe.BOUND_S), or the probe records it as hung."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers.fault_cluster_probe import BOUND_S, SCENARIOS
from helpers.faults import MOE_MODEL, STEPS, Reference, check_against_reference, matrix_cfg
from helpers.cli import ROOT

TESTS = ROOT / "tests"  # the probe runs as a module of tests/helpers

# The probe runs in the first test's set-up (~7 min alone, more on a busy machine): its bound is
# the probe's own, per scenario, not pytest's default for one test.
pytestmark = pytest.mark.timeout(BOUND_S * len(SCENARIOS) + 60)


@pytest.fixture(scope="module")
def results(data_cache, tmp_path_factory):
    out = tmp_path_factory.mktemp("faults") / "results.jsonl"
    env = {**os.environ, "RAY_ADDRESS": ""}
    proc = subprocess.run([sys.executable, "-m", "helpers.fault_cluster_probe", data_cache, str(out)], cwd=TESTS,
                          capture_output=True, text=True,
                          timeout=BOUND_S * len(SCENARIOS), env=env, stdin=subprocess.DEVNULL)
    found = {}
    if out.exists():
        found = {r["name"]: r for r in map(json.loads, out.read_text().splitlines())}
    found["_probe"] = {"returncode": proc.returncode, "stderr": proc.stderr[-3000:]}
    return found


@pytest.fixture(scope="module")
def refs(data_cache, tmp_path_factory):
    """One-process references, by the config shape a scenario trains."""
    root = tmp_path_factory.mktemp("refs")
    cache: dict = {}

    def of(**sections) -> Reference:
        key = json.dumps(sections, sort_keys=True)
        if key not in cache:
            cache[key] = Reference.of(matrix_cfg(root, data_cache, **sections))
        return cache[key]

    return of


def result_of(results, name: str) -> dict:
    r = results.get(name)
    assert r is not None, f"the probe never reached this scenario: {results['_probe']}"
    assert not r.get("hung"), r["error"]
    assert r["elapsed_s"] < BOUND_S
    return r


def finished(results, name: str, ref: Reference, steps=range(STEPS)) -> dict:
    r = result_of(results, name)
    assert r["error"] is None, r["error"]
    check_against_reference(r["history"], ref, steps)
    return r


def restart_layouts(r: dict) -> list[tuple[str, int, int]]:
    return [(e["reason"], e["layout_before"]["dp"], e["layout_after"]["dp"]) for e in r["restarts"]]


@pytest.mark.parametrize("zero", [0, 2, 3])  # ZeRO-1: the dp2 x pp2 scenario
def test_node_loss_shrinks_at_once_and_matches_one_process(results, refs, zero):
    r = finished(results, f"node loss mid-run, dp2 -> dp1, zero {zero}", refs())
    (event,) = r["restarts"]
    assert restart_layouts(r) == [("failure", 2, 1)]
    assert event["resumed_step"] == 2 and event["checkpoint"].endswith("step-00000002")
    # The survivors held a valid layout: no wait for the lost node (elastic.wait_for_resources_s=30).
    assert event["wait_for_resources_s"] == 0


def test_node_loss_dp4_to_dp3_keeps_the_global_batch(results, refs):
    r = finished(results, "node loss, dp4 -> dp3, global batch kept",
                 refs(parallel={"micro_batch_size": 1}, train={"global_batch_size": 12}))
    assert restart_layouts(r) == [("failure", 4, 3)]


def test_node_loss_dp2_pp2(results, refs):
    r = finished(results, "node loss, dp2 x pp2 -> dp1 x pp2", refs())
    assert restart_layouts(r) == [("failure", 2, 1)] and r["restarts"][0]["layout_after"]["pp"] == 2


def test_node_loss_3d(results, refs):
    r = finished(
        results, "node loss, dp2 x pp2 x tp2 -> dp1 x pp2 x tp2", refs(parallel={"micro_batch_size": 1})
    )
    after = r["restarts"][0]["layout_after"]
    assert (after["dp"], after["pp"], after["tp"]) == (1, 2, 2)


@pytest.mark.parametrize("name,dp,kept_dp,kept_ranks", [
    ("node loss, survivors keep their state, dp2 -> dp1", 2, 1, 1),
    ("node loss of the rendezvous rank, survivors keep their state, dp4 -> dp2", 4, 2, 2),
    ("node loss of an HSDP group's rank, survivors keep their state, 2x2 -> 1x2", 4, 2, 2),
    ("node loss, survivors keep their state, dp2 x pp2 -> dp1 x pp2", 2, 1, 2),
    ("node loss, survivors keep their state, dp2 x pp2 x tp2 -> dp1 x pp2 x tp2", 2, 1, 4),
], ids=["dp2", "dp4-rank0", "hsdp2x2-zero3", "dp2xpp2", "dp2xpp2xtp2"])
def test_node_loss_survivors_keep_their_state(results, refs, name, dp, kept_dp, kept_ranks):
    """elastic.keep_survivors: the same processes go on from the failed step with what they hold
    in memory; no checkpoint is read and no step is redone."""
    r = finished(results, name, refs(parallel={"micro_batch_size": 1}))
    (event,) = r["restarts"]
    assert event["recovery"] == "survivors" and event["checkpoint"] is None
    assert event["resumed_step"] == event["failed_step"]
    assert len(event["pids"]) == kept_ranks and set(event["pids"]) <= set(r["pids_before"])
    assert restart_layouts(r) == [("failure", dp, kept_dp)]
    assert [event["layout_after"][d] for d in ("pp", "tp")] == [
        event["layout_before"][d] for d in ("pp", "tp")
    ]


def test_the_returning_node_joins_from_a_live_peer(results, refs):
    """The survivor goes on alone; once the node is back, a new rank starts in the lost rank's
    re-placed bundle and takes its state from the survivor's memory: no checkpoint read, no
    step redone, the survivor's process the same throughout."""
    r = finished(
        results,
        "node loss, survivors keep their state, the node returns and joins from a live peer, "
        "dp2 -> dp1 -> dp2",
        refs(parallel={"micro_batch_size": 1}),
    )
    survived, joined = r["restarts"]
    assert (survived["recovery"], joined["recovery"]) == ("survivors", "live join")
    assert survived["checkpoint"] is None and joined["checkpoint"] is None
    assert survived["resumed_step"] == survived["failed_step"] and joined["failed_step"] is None
    assert restart_layouts(r) == [("failure", 2, 1), ("grow", 1, 2)]
    assert survived["pids"] == joined["pids"] == r["pids_after"][:1] and joined["pids"][0] in r["pids_before"]
    assert r["pids_after"][1] not in r["pids_before"]
    assert [m["dp"] for m in r["history"]][-1] == 2


def test_a_replacement_on_a_spare_node_joins_from_a_live_peer(results, refs):
    r = finished(
        results,
        "node loss with a spare node, survivors keep their state, a replacement joins from a "
        "live peer, dp2",
        refs(parallel={"micro_batch_size": 1}),
    )
    survived, joined = r["restarts"]
    assert (survived["recovery"], joined["recovery"]) == ("survivors", "live join")
    assert survived["checkpoint"] is None and joined["checkpoint"] is None
    assert restart_layouts(r) == [("failure", 2, 1), ("grow", 1, 2)]
    assert r["pids_after"][0] in r["pids_before"] and r["pids_after"][1] not in r["pids_before"]


def test_a_warm_spare_takes_the_lost_nodes_rank_with_dp_unchanged(results, refs):
    """elastic.spares=1: in the survivor's recovery, the process started as a spare before the
    loss becomes the new rank 1, its state from the survivor's memory; no checkpoint read, no step
    redone, dp 2 throughout."""
    r = finished(results,
                 "node loss with a warm spare on a third node, the spare joins from a live peer, dp2",
                 refs(parallel={"micro_batch_size": 1}))
    (survived,) = r["restarts"]
    assert survived["recovery"] == "survivors" and survived["checkpoint"] is None
    assert survived["resumed_step"] == survived["failed_step"]
    assert restart_layouts(r) == [("failure", 2, 2)] and [m["dp"] for m in r["history"]] == [2] * STEPS
    assert len(r["spare_pids"]) == 1 and r["pids_after"] == [r["pids_before"][0], r["spare_pids"][0]]


def test_a_warm_spare_takes_a_lost_pipeline_stage_s_place_from_the_peer_copy(results, refs):
    """dp2 x pp2 ZeRO-1, one rank per node: the node of rank 3 (stage 1 of replica 1) is lost. No
    whole copy of the state survives (ZeRO-1 shards the optimizer state over dp), so ranks 0-2, in
    their processes, and the spare started before the loss reload the newest peer copy: dp 2 kept,
    nothing read from storage, at most the copy interval (one step) redone."""
    r = finished(results, "node loss of a pipeline stage, dp2 x pp2 ZeRO-1, a warm spare reloads it from the "
                 "peer copy", refs(parallel={"micro_batch_size": 1}))
    (event,) = r["restarts"]
    assert event["recovery"] == "survivors reloaded" and event["checkpoint"] == "peer memory"
    assert event["failed_step"] - event["resumed_step"] <= 1
    assert restart_layouts(r) == [("failure", 2, 2)] and event["layout_after"]["pp"] == 2
    assert len(r["spare_pids"]) == 1 and r["pids_after"] == r["pids_before"][:3] + r["spare_pids"]


def test_node_loss_restores_the_peer_copy_from_the_other_node(results, refs):
    """ZeRO-3 over two nodes: what rank 1 held is only on its node and in the peer copy on rank
    0's node. The restart (dp=1, a new layout) loads that copy: no checkpoint read from storage."""
    r = finished(
        results,
        "node loss, ZeRO-3 dp2 -> dp1 from the peer copy on the other node, nothing on storage",
        refs(),
    )
    (event,) = r["restarts"]
    copy = r["copy"]
    assert copy["copy_nodes"] == copy["nodes"][::-1] and copy["nodes"][0] != copy["nodes"][1]
    assert event["checkpoint"] == "peer memory" and event["resumed_step"] >= copy["step"]
    assert restart_layouts(r) == [("failure", 2, 1)]


def test_an_expert_parallel_restart_reshards_the_experts_from_the_peer_copies(results, refs):
    """dp 2 x ep 2 over two nodes: the lost node's experts are only in its peer copy on the other
    node. The restart at dp 1 re-plans ep to 1 and loads every expert from the copies, resharded
    from ep 2: no checkpoint read from storage, every step like one process."""
    r = finished(results, "node loss, MoE dp2 x ep2 -> dp1 x ep1 from the peer copies, experts resharded",
                 refs(model=MOE_MODEL, parallel={"micro_batch_size": 1}))
    (event,) = r["restarts"]
    assert event["checkpoint"] == "peer memory" and event["resumed_step"] >= r["copy"]["step"]
    assert [(e["layout_before"]["ep"], e["layout_after"]["ep"]) for e in r["restarts"]] == [(2, 1)]
    assert restart_layouts(r) == [("failure", 2, 1)]


def test_a_group_on_one_node_keeps_its_peer_copy_on_another(results, refs):
    r = finished(
        results,
        "node loss of the node holding every rank, dp2 restarts from the peer copy on another node",
        refs(),
    )
    (event,) = r["restarts"]
    copy = r["copy"]
    assert len(set(copy["nodes"])) == 1 and set(copy["copy_nodes"]).isdisjoint(copy["nodes"])
    assert event["checkpoint"] == "peer memory" and event["resumed_step"] >= copy["step"]


def test_an_expert_parallel_run_loses_its_ep_group_and_restarts_resharded(results, refs):
    """dp2 x ep2: the two ranks hold one copy of the experts between them, so a node loss leaves
    no whole copy in memory. The restart at dp1 re-plans ep to 1 (ep must divide dp) and loads
    each block's experts, sharded over two ranks when saved, whole from the checkpoint."""
    r = finished(results, "node loss, MoE dp2 x ep2 -> dp1 x ep1, experts resharded",
                 refs(model=MOE_MODEL, parallel={"micro_batch_size": 1}))
    (event,) = r["restarts"]
    assert event["recovery"] == "restart" and event["checkpoint"].endswith("step-00000002")
    assert [(e["layout_before"]["ep"], e["layout_after"]["ep"]) for e in r["restarts"]] == [(2, 1)]
    assert restart_layouts(r) == [("failure", 2, 1)] and event["resumed_step"] == 2


def test_node_loss_before_the_first_checkpoint_starts_over(results, refs):
    r = finished(results, "node loss before the first checkpoint", refs())
    assert r["restarts"][0]["resumed_step"] == 0 and r["restarts"][0]["checkpoint"] is None


def test_node_loss_mid_async_write(results, refs):
    r = finished(results, "node loss mid-async-write (slow storage)", refs())
    (event,) = r["restarts"]
    # The save of step 4 was in flight and never finished: the previous commit (2) is used.
    assert event["checkpoint_in_flight"] == 4 and not event["checkpoint_in_flight_committed"]
    assert event["resumed_step"] == 2


def test_two_node_losses_in_a_row(results, refs):
    r = finished(results, "two node losses in a row", refs())
    assert [e["reason"] for e in r["restarts"]] == ["failure", "failure"]
    assert r["restarts"][-1]["layout_after"]["dp"] == 1


@pytest.mark.parametrize("bundle", ["the first bundle", "another bundle"])
def test_node_loss_mid_restart_is_a_new_failure_and_training_goes_on(results, refs, bundle):
    """Issue: the driver hung in the rendezvous, or the half-built placement group leaked and
    blocked every retry."""
    r = finished(results, f"node loss mid-restart, on the node of {bundle}", refs())
    assert len(r["failures"]) == 2  # the first loss, and the one during the restart
    (event,) = r["restarts"]
    assert event["attempts"] == 2 and event["layout_after"]["dp"] == 1


def test_grow_back_when_the_node_returns(results, refs):
    r = finished(results, "node loss, then the node returns: grow back", refs())
    assert restart_layouts(r) == [("failure", 2, 1), ("grow", 1, 2)]
    grow = r["restarts"][1]
    assert [m["dp"] for m in r["history"] if m["step"] >= grow["resumed_step"]] == \
        [2] * (STEPS - grow["resumed_step"])
    # One MLflow run tells it: each step once, both restarts, the layout now.
    run = r["mlflow"]
    assert run["status"] == "FINISHED" and run["loss_steps"] == list(range(STEPS))
    assert run["tags"]["raymp.restarts"] == "2" and run["tags"]["raymp.layout"] == "dp2-pp1-tp1-zero2"
    assert run["events"] == ["events/restart-1.json", "events/restart-2.json"] and run["elastic_dp"] == [1, 2]


def test_no_room_for_a_replica_fails_after_the_wait_and_names_the_knob(results):
    r = result_of(results, "no room for one replica: the wait times out and names its knob")
    assert r["error"].startswith("ElasticError: ") and "elastic.wait_for_resources_s" in r["error"]


def test_driver_killed_and_run_again_continues_exactly(results, refs):
    r = finished(results, "driver killed with SIGKILL, the command run again", refs())
    assert r["resumed_step"] is not None and r["resumed_step"] >= 4  # from the committed checkpoint
