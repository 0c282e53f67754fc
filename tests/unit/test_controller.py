"""The elastic controller's state machine without actors: a scripted run (the ElasticRun and
ElasticRanks interfaces in one object) and scripted failures drive it through every state and
transition, and each path's restart event says what happened. The fault matrix runs the same
paths with real actors."""

from __future__ import annotations

import pytest

from raymp.checkpoint.store import Checkpoint, CheckpointError
from raymp.config import config_from_dict
from raymp.elastic.capacity import ElasticError, with_dp
from raymp.elastic import states
from raymp.elastic.controller import ElasticController
from raymp.elastic.policy import Action, RecoveryPolicy, ScalingPolicy
from raymp.elastic.states import Failed, Recovering, Restoring, Running
from raymp.runtime.rank_calls import JoinFailed, WorkerLostError


def _config(**elastic):
    """dp=2 ZeRO-0; survivors only where a test asks for them (the default would keep them)."""
    return config_from_dict({"parallel": {"dp": 2, "zero": 0, "micro_batch_size": 1},
                             "train": {"global_batch_size": 8, "seq_len": 32}, "model": {"preset": "tiny"},
                             "elastic": {"max_restarts": 2, "keep_survivors": False, **elastic}})


class ScriptedRun:
    """The ElasticRun and ElasticRanks interfaces, answering from a script: `relaunch_faults` are
    raised by the next relaunches, in order (then it succeeds); `held` is what keep_survivors reports;
    `took`: the survivors' calls of the failed step ended well (its commit vote passed)."""

    def __init__(self, config, step: int = 5, relaunch_faults=(), held=None, took=False, spares=0):
        self.config, self.group, self.global_step = config, object(), step
        self.relaunch_faults, self.held, self.took, self.spares = list(relaunch_faults), held, took, spares
        self.kept: dict = {}
        self.calls: list[str] = []
        self.events: list[dict] = []

    def abandon_save(self):
        self.calls.append("abandon_save")
        return None, None

    def commit_in_flight(self):
        self.calls.append("commit_in_flight")

    def teardown(self):
        self.calls.append("teardown")
        self.group = None

    def relaunch(self, dp):
        self.calls.append(f"relaunch({dp})")
        if self.relaunch_faults:
            raise self.relaunch_faults.pop(0)
        self.config, self.group = with_dp(self.config, dp), object()
        return Checkpoint("ck/step-00000004", 4, {})

    def keep_survivors(self, lost_rank):
        self.calls.append(f"keep_survivors({lost_rank})")
        layout = self.config.parallel.layout
        held = self.held if self.held is not None else self.global_step
        self.kept = {r: held for r in range(layout.world_size) if r not in layout.replica_of(lost_rank)}
        return self.kept

    def finished_failed_step(self):
        return {r: f"report of rank {r}" for r in self.kept} if self.took else {}

    def commit_failed_step(self, finished):
        self.calls.append(f"commit_failed_step({sorted(finished)})")
        self.global_step += 1

    def continue_with_kept_state(self, ranks, config, spares=0):
        return self._continue("continue_with_kept_state", ranks, config, spares)

    def continue_with_reloaded_state(self, ranks, config, spares=0):
        return None, self._continue("continue_with_reloaded_state", ranks, config, spares)

    def _continue(self, name, ranks, config, spares):
        self.calls.append(f"{name}({ranks}" + (f", spares={spares})" if spares else ")"))
        self.config = config
        return [100 + r for r in ranks] + [200 + i for i in range(spares)]

    def ready_spares(self):
        return self.spares

    def stop_rank(self, rank):
        self.calls.append(f"stop_rank({rank})")

    def joinable_replicas(self):
        return 1

    def has_room_to_join(self):
        return True

    def join_live(self, replicas):
        self.calls.append(f"join_live({replicas})")
        self.config = with_dp(self.config, replicas)
        return [100]

    def on_state(self, state):  # the run's listener (the Trainer's): what a restart tells it
        if isinstance(state, Running) and state.after is not None:
            self.events.append(state.after)


class ScriptedScaling:
    def __init__(self, dp_after_failure=1, grow_to=None, join=None):
        self.dp_after_failure, self._grow_to, self._join = dp_after_failure, grow_to, join

    def after_failure(self, cfg, log):
        return self.dp_after_failure, 0.0

    def grow_to(self, cfg):
        return self._grow_to

    def may_join(self, cfg):
        return self._join is not None

    def replicas_to_join(self, cfg, free):
        return self._join


def _controller(run, scaling=None, shared=False):
    said = []
    controller = ElasticController(
        run, run, RecoveryPolicy(run.config.elastic, shared), scaling or ScriptedScaling(), said.append
    )
    controller.subscribe(run.on_state)
    return controller, said


def _phases(controller) -> list[str]:
    return [phase for phase, _ in controller.transitions]


def _lost(kind="died", rank=1, step=5):
    return WorkerLostError(f"rank {rank} lost", rank, kind, step)


def test_a_failure_restarts_from_the_lineage():
    run = ScriptedRun(_config())
    controller, said = _controller(run)
    event = controller.recover(_lost())
    assert _phases(controller) == ["running", "recovering", "restoring", "running"]
    assert isinstance(controller.state, Running) and controller.state.after is event
    assert event["recovery"] == "restart" and event["reason"] == "failure" and event["resumed_step"] == 4
    assert event["attempts"] == 1 and event["failed_step"] == 5 and run.events == [event]
    assert run.calls == ["abandon_save", "teardown", "relaunch(1)"]
    assert any("1 step(s) to redo" in line for line in said)


def test_survivors_go_on_with_their_state():
    run = ScriptedRun(_config(keep_survivors=True))
    controller, _ = _controller(run)
    event = controller.recover(_lost(rank=1))
    assert _phases(controller) == ["running", "recovering", "keeping survivors", "running"]
    assert event["recovery"] == "survivors" and event["resumed_step"] == 5 and event["checkpoint"] is None
    assert run.calls == ["abandon_save", "keep_survivors(1)", "continue_with_kept_state([0])"]
    assert run.config.parallel.dp == 1


def test_survivors_that_all_took_the_failed_step_count_it_done_and_go_on():
    """A rank lost after its step's commit vote: every survivor took the step and its call
    ended well (held 6 at 5), so the step is recorded from their reports and the run goes on
    after it, nothing redone."""
    run = ScriptedRun(_config(keep_survivors=True), held=6, took=True)
    controller, _ = _controller(run)
    event = controller.recover(_lost(rank=1))
    assert _phases(controller) == ["running", "recovering", "keeping survivors", "running"]
    assert event["recovery"] == "survivors" and event["resumed_step"] == 6 and event["failed_step"] == 5
    assert run.calls == ["abandon_save", "keep_survivors(1)", "commit_failed_step([0])",
                         "continue_with_kept_state([0])"]


def test_survivors_ahead_of_the_run_without_their_step_ending_are_refused_and_the_run_restarts():
    """The survivors hold step 5 applied (held 6 at 5) but their calls of it did not end well (a
    fault after their optimizer step): what they hold is not known whole, so the run restarts."""
    run = ScriptedRun(_config(keep_survivors=True), held=6)
    controller, _ = _controller(run)
    event = controller.recover(_lost(rank=1))
    assert event["recovery"] == "restart"
    assert event["survivors_refused"] == "their states are after steps [6], the run is at step 5 and ranks [0] did not end it"
    assert run.calls[-2:] == ["teardown", "relaunch(1)"]
    assert _phases(controller) == ["running", "recovering", "keeping survivors", "restoring", "running"]


def test_a_hung_step_never_asks_the_survivors():
    run = ScriptedRun(_config(keep_survivors=True))
    controller, _ = _controller(run)
    event = controller.recover(_lost(kind="timeout"))
    assert event["recovery"] == "restart" and not any(c.startswith("keep_survivors") for c in run.calls)


def test_a_fault_while_relaunching_is_a_new_failure_and_is_retried():
    run = ScriptedRun(_config(), relaunch_faults=[WorkerLostError("a node went while starting", 0, "died")])
    controller, _ = _controller(run)
    event = controller.recover(_lost())
    assert event["attempts"] == 2 and len(controller.failures) == 2 and event["failed_step"] == 5
    assert _phases(controller) == ["running", "recovering", "restoring", "recovering", "restoring", "running"]
    assert run.calls.count("teardown") == 2


def test_too_many_failures_give_up_and_fail():
    faults = [WorkerLostError(f"fault {i}", 0, "died") for i in range(5)]
    run = ScriptedRun(_config(), relaunch_faults=faults)
    controller, _ = _controller(run)
    with pytest.raises(ElasticError, match=r"giving up after 3 failures \(elastic.max_restarts=2\)"):
        controller.recover(_lost())
    assert _phases(controller) == ["running"] + ["recovering", "restoring"] * 2 + ["recovering", "failed"]
    assert isinstance(controller.state, Failed) and run.calls[-2:] == ["abandon_save", "teardown"]


def test_no_intact_state_fails_at_once():
    run = ScriptedRun(
        _config(), relaunch_faults=[CheckpointError("no intact checkpoint in this run's lineage")]
    )
    controller, _ = _controller(run)
    with pytest.raises(CheckpointError):
        controller.recover(_lost())
    assert (
        _phases(controller) == ["running", "recovering", "restoring", "failed"]
        and len(controller.failures) == 1
    )


def test_a_refused_failure_changes_no_state():
    run = ScriptedRun(_config(enabled=False))
    controller, _ = _controller(run)
    with pytest.raises(WorkerLostError, match=r"the run stopped \(elastic.enabled is false\)"):
        controller.recover(_lost())
    assert _phases(controller) == ["running"] and run.calls == []


def test_growing_back_resizes_and_a_fault_while_growing_is_a_failure():
    run = ScriptedRun(_config())
    run.config = with_dp(run.config, 1)
    controller, _ = _controller(run, ScriptedScaling(grow_to=2))
    event = controller.grow()
    assert event["reason"] == "grow" and run.config.parallel.dp == 2
    assert _phases(controller) == ["running", "resizing", "running"]

    failing = ScriptedRun(_config(), relaunch_faults=[WorkerLostError("lost while growing", 1, "died")])
    failing.config = with_dp(failing.config, 1)
    controller, _ = _controller(failing, ScriptedScaling(grow_to=2, dp_after_failure=1))
    event = controller.grow()
    assert event["reason"] == "failure" and len(controller.failures) == 1
    assert _phases(controller) == ["running", "resizing", "recovering", "restoring", "running"]


def test_replicas_join_live_between_steps():
    run = ScriptedRun(_config())
    run.config = with_dp(run.config, 1)
    controller, _ = _controller(run, ScriptedScaling(join=2))
    assert controller.join_if_room(now=False) is True and run.calls == []  # due, not yet
    assert controller.join_if_room(now=True) is False
    (event,) = run.events
    assert event["recovery"] == "live join" and event["checkpoint"] is None and run.calls == ["join_live(2)"]
    assert _phases(controller) == ["running", "joining", "running"]


def test_a_join_is_looked_for_only_below_the_configured_copies_and_with_grow_back():
    """ScalingPolicy.may_join: the cheap check before the driver asks Ray for free bundles and
    ready spares, so a run at its layout pays nothing per step for having spares."""
    cfg = _config()
    policy = ScalingPolicy(cfg.parallel.layout, "cpu", None, grow_back=True)
    assert not policy.may_join(cfg)  # at the configured dp
    assert policy.may_join(with_dp(cfg, 1)) and policy.replicas_to_join(with_dp(cfg, 1), 1) == 2
    assert not ScalingPolicy(cfg.parallel.layout, "cpu", None, grow_back=False).may_join(with_dp(cfg, 1))


def test_a_rewind_commits_the_save_in_flight_and_relaunches_at_the_same_layout():
    run = ScriptedRun(_config())
    controller, _ = _controller(run)
    event = controller.rewind(5, "step 5: non-finite gradient norm nan")
    assert event["reason"] == "nonfinite" and event["failed_step"] == 5 and event["resumed_step"] == 4
    assert run.calls == ["commit_in_flight", "teardown", "relaunch(2)"]
    assert _phases(controller) == ["running", "restoring", "running"]


def test_a_resize_keeps_survivors_on_exactly_where_the_config_rule_allows_it():
    """elastic.with_replicas and the config rule ask one predicate: under ZeRO, down to one whole
    copy of the state, a keep_survivors set to true goes back to unset (off for that layout, so
    the resized run is not refused), unless peer copies give the survivors a state."""
    from raymp.config.rules import keeps_survivors
    from raymp.elastic import with_replicas

    def hsdp(**elastic):
        return config_from_dict(
            {
                "parallel": {"dp": 4, "dp_replicate": 2, "zero": 2, "micro_batch_size": 1},
                "train": {"global_batch_size": 8, "seq_len": 32},
                "model": {"preset": "tiny"},
                "elastic": {"keep_survivors": True, **elastic},
            }
        )

    one = with_replicas(hsdp(), 1)
    assert one.parallel.dp == 2 and one.elastic.keep_survivors is None and not keeps_survivors(one)
    assert keeps_survivors(with_replicas(one, 2))  # back on when a second copy joins
    assert with_replicas(hsdp(peer_copy_every=2), 1).elastic.keep_survivors


@pytest.mark.parametrize("kind, during, keep, alive, failures, action", [
    ("died", None, True, True, 1, Action.KEEP_SURVIVORS),
    ("died", "joining", True, True, 1, Action.KEEP_SURVIVORS),  # a failed join: the live ranks still hold it
    ("died", None, False, True, 1, Action.RESTORE),  # elastic.keep_survivors off
    ("timeout", None, True, True, 1, Action.RESTORE),  # a hung rank may not answer the survivors
    ("died", None, True, False, 1, Action.RESTORE),  # the group is gone
    ("died", "keeping survivors", True, True, 2, Action.RESTORE),  # the survivors failed themselves
    ("died", "restoring", True, False, 2, Action.RESTORE),
    ("died", None, True, True, 3, Action.GIVE_UP),  # past elastic.max_restarts=2
])
def test_the_policy_decides_from_the_failure_and_the_run_s_history(
    kind, during, keep, alive, failures, action
):
    cfg = _config(keep_survivors=keep)
    policy = RecoveryPolicy(cfg.elastic, group_is_shared=False)
    state = Recovering(_lost(kind=kind), during=during)
    assert policy.decide(state, [{}] * failures, cfg, alive) is action


def test_survivors_without_their_state_reload_it_from_peer_copies():
    run = ScriptedRun(_config(keep_survivors=True, peer_copy_every=2), held=6)
    controller, said = _controller(run)
    event = controller.recover(_lost(rank=1))
    assert _phases(controller) == [
        "running",
        "recovering",
        "keeping survivors",
        "reloading survivors",
        "running",
    ]
    assert event["recovery"] == "survivors reloaded" and run.calls[-1] == "continue_with_reloaded_state([0])"
    assert any("they reload it" in line for line in said)


def test_survivors_reloading_take_ready_spares_into_the_lost_places_at_the_same_dp():
    run = ScriptedRun(_config(keep_survivors=True, peer_copy_every=2), held=6, spares=1)
    controller, said = _controller(run)
    event = controller.recover(_lost(rank=1))
    assert run.calls[-1] == "continue_with_reloaded_state([0], spares=1)"
    assert event["recovery"] == "survivors reloaded" and event["pids"] == [100, 200]
    assert run.config.parallel.dp == 2 and any("1 warm spare rank(s) in the lost places" in s for s in said)


@pytest.mark.parametrize("spares, ranks, dp, joining", [
    (0, [0, 1], 1, 0),  # the whole pipeline of replica 0 goes on alone; rank 2 is let go
    (1, [0, 1, 2], 2, 1),  # a spare in rank 3's place: dp 2 again
    (2, [0, 1, 2], 2, 1),  # never more than the dp the run had
])
def test_a_pipeline_replica_broken_in_part_reloads_with_spares_in_the_lost_places(spares, ranks, dp, joining):
    """dp2 x pp2 ZeRO-1, rank 3 lost: no whole copy of the state survives (the optimizer state is
    sharded over dp); peer copies hold every part, so the survivors and spares reload them."""
    from raymp.elastic.policy import Reload

    cfg = config_from_dict({"parallel": {"dp": 2, "pp": 2, "zero": 1, "micro_batch_size": 1},
                            "train": {"global_batch_size": 8, "seq_len": 32},
                            "model": {"preset": "tiny", "n_layers": 2},
                            "elastic": {"peer_copy_every": 1, "spares": 1}})
    policy = RecoveryPolicy(cfg.elastic, group_is_shared=False)
    plan = policy.survivors(cfg, {0: 5, 1: 5, 2: 5}, 5, set(), spares)
    assert plan == Reload(ranks, dp, "no whole copy of the state survived", joining)


def test_survivors_going_on_take_ready_spares_into_the_lost_places_in_the_same_transition():
    run = ScriptedRun(_config(keep_survivors=True), spares=1)
    controller, said = _controller(run)
    event = controller.recover(_lost(rank=1))
    assert _phases(controller) == ["running", "recovering", "keeping survivors", "running"]
    assert run.calls[-1] == "continue_with_kept_state([0], spares=1)"
    assert event["recovery"] == "survivors" and event["pids"] == [100, 200] and run.config.parallel.dp == 2
    assert any("1 warm spare rank(s) take the lost ranks' places" in line for line in said)


def test_a_spare_lost_while_joining_leaves_the_survivors_going_on_alone():
    """The spare dies in the transition that would have taken it (JoinFailed: the group is back
    to the survivors, who still hold their state): a failure while joining, so the survivors go
    on, alone this time; a new spare joins later (Joining)."""

    class SpareDies(ScriptedRun):
        def continue_with_kept_state(self, ranks, config, spares=0):
            if spares:
                self.calls.append(f"continue_with_kept_state({ranks}, spares={spares}): the spare died")
                self.spares, self.config = 0, with_dp(self.config, 1)
                raise JoinFailed("a rank that was joining: rank 1 died", None, "died", 5)
            return super().continue_with_kept_state(ranks, config)

        def keep_survivors(self, lost_rank):
            if lost_rank is not None:
                return super().keep_survivors(lost_rank)
            self.calls.append("keep_survivors(None)")
            self.kept = {0: self.global_step}
            return self.kept

    run = SpareDies(_config(keep_survivors=True), spares=1)
    controller, _ = _controller(run)
    event = controller.recover(_lost(rank=1))
    assert _phases(controller) == ["running", "recovering", "keeping survivors", "recovering",
                                   "keeping survivors", "running"]
    assert run.calls[-2:] == ["keep_survivors(None)", "continue_with_kept_state([0])"]
    assert event["recovery"] == "survivors" and event["attempts"] == 2 and run.config.parallel.dp == 1
    assert len(controller.failures) == 2 and "teardown" not in run.calls


def test_a_run_grows_back_at_a_checkpoint_where_replicas_cannot_join_live():
    """Free bundles or spares hold a run back from relaunching larger only where the lost
    replicas can join live (ScalingPolicy.may_join); under ZeRO they cannot."""
    run = ScriptedRun(_config())
    run.config = with_dp(run.config, 1)
    assert _controller(run, ScriptedScaling(grow_to=2, join=None))[0].grows_at_checkpoint()
    assert not _controller(run, ScriptedScaling(grow_to=2, join=2))[0].grows_at_checkpoint()


def test_listeners_see_every_state_and_the_scripted_paths_cover_them_all():
    """Every state the controller has is entered by one of the scripted paths above."""
    seen: list[str] = []
    paths = [(_config(keep_survivors=True, peer_copy_every=2), 6), (_config(keep_survivors=True), 6)]
    for cfg, held in paths:
        controller, _ = _controller(ScriptedRun(cfg, held=held))
        controller.subscribe(lambda state: seen.append(state.name))
        controller.recover(_lost())
    run = ScriptedRun(_config())
    run.config = with_dp(run.config, 1)
    controller, _ = _controller(run, ScriptedScaling(grow_to=2, join=2))
    controller.subscribe(lambda state: seen.append(state.name))
    controller.join_if_room(now=True)
    controller.grow()
    controller, _ = _controller(ScriptedRun(_config(), relaunch_faults=[CheckpointError("none intact")]))
    controller.subscribe(lambda state: seen.append(state.name))
    with pytest.raises(CheckpointError):
        controller.recover(_lost())
    every = {cls.name for cls in states.State.__args__}
    assert set(seen) == every and isinstance(Restoring("failure"), states.State.__args__)


def test_the_policy_says_what_the_survivors_can_do_with_what_they_hold():
    """dp4 (ZeRO-0: each rank a whole copy): survivors at the run's step go on; so do survivors
    that all took the step whole (a rank lost after its commit vote); ahead of it without every
    survivor's call of it ending, or disagreeing, they reload from peer copies if there are any,
    else the run restores."""
    from raymp.elastic.policy import GoOn, Refuse, Reload

    def cfg(**elastic):
        return config_from_dict(
            {
                "parallel": {"dp": 4, "zero": 0, "micro_batch_size": 1},
                "train": {"global_batch_size": 8, "seq_len": 32},
                "model": {"preset": "tiny"},
                "elastic": {"keep_survivors": True, **elastic},
            }
        )

    policy = RecoveryPolicy(cfg().elastic, group_is_shared=False)
    assert policy.survivors(cfg(), {0: 5, 1: 5, 3: 5}, 5, set()) == GoOn([0, 1], 2)  # 3 copies: 8 splits into 2
    # Every survivor took step 5 and its call of it ended (the vote passed): the step is done.
    assert policy.survivors(cfg(), {0: 6, 1: 6, 3: 6}, 5, {0, 1, 3}) == GoOn([0, 1], 2, took_step=True)
    ahead = policy.survivors(cfg(), {0: 6, 1: 6, 3: 6}, 5, {0, 1})
    assert isinstance(ahead, Refuse)
    assert ahead.why == "their states are after steps [6], the run is at step 5 and ranks [3] did not end it"
    assert policy.survivors(cfg(peer_copy_every=2), {0: 6, 1: 6, 3: 6}, 5, {0, 1}) == Reload([0, 1], 2, ahead.why)
    apart = policy.survivors(cfg(), {0: 5, 1: 6, 3: 6}, 5, {1, 3})  # they disagree: none goes on
    assert apart == Refuse("their states are after steps [5, 6], the run is at step 5")


@pytest.mark.parametrize("parallel, elastic, kept", [
    ({"dp": 2, "zero": 0}, {}, True),  # each dp replica holds the state
    ({"dp": 2, "zero": 2}, {}, False),  # one copy, sharded over both ranks: restart from the checkpoint
    ({"dp": 4, "zero": 3, "dp_replicate": 2}, {}, True),  # each HSDP group holds it
    ({"dp": 2, "zero": 3}, {"peer_copy_every": 1}, True),  # the survivors reload the peer copy
    ({"dp": 2, "zero": 0}, {"keep_survivors": False}, False),
])
def test_survivors_are_kept_by_default_wherever_the_layout_leaves_them_the_state(parallel, elastic, kept):
    from raymp.config.rules import keeps_survivors

    cfg = config_from_dict({"parallel": {"micro_batch_size": 1, **parallel}, "elastic": elastic,
                            "train": {"global_batch_size": 8, "seq_len": 32}, "model": {"preset": "tiny"}})
    assert keeps_survivors(cfg) is kept
    state = Recovering(_lost(kind="died"), during=None)
    action = RecoveryPolicy(cfg.elastic, group_is_shared=False).decide(state, [{}], cfg, True)
    assert action is (Action.KEEP_SURVIVORS if kept else Action.RESTORE)



def test_a_straggler_is_replaced_only_while_a_recovery_is_left():
    """elastic.replace_stragglers: the controller stops the rank (the next step finds it lost), but
    not once its failure would be past elastic.max_restarts, nor when the run recovers from nothing."""
    run = ScriptedRun(_config(keep_survivors=True, replace_stragglers=True))
    controller, _ = _controller(run)
    assert controller.replace_straggler(1) is None and run.calls == ["stop_rank(1)"]
    controller.failures += [{}, {}]  # elastic.max_restarts=2 used up
    assert controller.replace_straggler(1) == (
        "the run has recovered from 2 of elastic.max_restarts=2 failures")
    shared, _ = _controller(ScriptedRun(_config(keep_survivors=True, replace_stragglers=True)), shared=True)
    assert "actor group was passed in" in shared.replace_straggler(1)
    assert run.calls == ["stop_rank(1)"]
