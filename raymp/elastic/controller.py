"""Recovery as states that carry their data, each step decided by a policy.

    Running --a rank lost--> Recovering(failure)
    Recovering --policy: keep survivors--> KeepingSurvivors(failure) --went on (ready warm spares
        joined from them)--> Running
    KeepingSurvivors --no whole copy kept, peer copies hold it--> ReloadingSurvivors(ranks, dp, spares)
        --> Running
    KeepingSurvivors --cannot go on (why)--> Restoring(refused=why) --relaunched--> Running
    Recovering --policy: restore--> Restoring --relaunched--> Running
    Recovering --policy: give up / no intact state--> Failed(error)
    any recovery state --a fault while in it--> Recovering(the new failure; a joining rank's: during Joining)
    Running --non-finite step, train.on_nonfinite=restore--> Restoring (rewind, same dp) --> Running
    Running --checkpoint committed, room to grow--> Resizing(dp) --relaunched--> Running
    Running --a lost node's bundles placed again, or warm spares ready--> Joining(replicas)
        --joined from live peers--> Running

`RecoveryPolicy.decide` sees the failure (what was lost, how, and in which state) and the run's
failures so far, and returns what to do; `ScalingPolicy` decides the dp to go on with and when
to grow back. The controller drives a run through the two small interfaces below (the Trainer's
session, and RankChanges on it for changing its ranks): it never touches actors, checkpoints or
tracking itself. Every restart ends in one `RestartEvent`, made by `_restart_event`; listeners
(`subscribe`) see every state entered.
"""

from __future__ import annotations

import time
from typing import Callable, Protocol

from raymp.checkpoint.store import Checkpoint, CheckpointError
from raymp.elastic.capacity import ElasticError, with_dp, with_replicas
from raymp.elastic.peer_copies import PEER_MEMORY
from raymp.elastic.policy import Action, RecoveryPolicy, Refuse, Reload, ScalingPolicy
from raymp.elastic.states import (Failed, Joining, KeepingSurvivors, Recovering, ReloadingSurvivors, Resizing,
                                  RestartEvent, Restoring, Running, State)
from raymp.layout import Layout, LayoutRecord
from raymp.runtime.placement import PlacementError
from raymp.runtime.rank_calls import JoinFailed, WorkerLostError


class ElasticRun(Protocol):
    """What the controller needs of a run (driver.session.Session)."""

    config: object
    group: object  # the live actor group, None once torn down
    global_step: int

    def abandon_save(self) -> tuple[int | None, Checkpoint | None]: ...

    def teardown(self) -> None: ...

    def relaunch(self, dp: int) -> Checkpoint | None: ...

    def finished_failed_step(self) -> dict: ...

    def commit_failed_step(self, finished: dict) -> None: ...

    def commit_in_flight(self) -> None: ...


class ElasticRanks(Protocol):
    """How the controller changes a live run's ranks (driver.rank_changes.RankChanges)."""

    def keep_survivors(self, lost_rank: int | None) -> dict[int, int]: ...

    def continue_with_kept_state(self, ranks: list[int], config, spares: int = 0) -> list[int]: ...

    def continue_with_reloaded_state(
        self, ranks: list[int], config, spares: int = 0
    ) -> tuple[Checkpoint | None, list[int]]: ...

    def ready_spares(self) -> int: ...

    def joinable_replicas(self) -> int: ...

    def has_room_to_join(self) -> bool: ...

    def join_live(self, replicas: int) -> list[int]: ...

    def stop_rank(self, rank: int) -> None: ...


# -- the controller ----------------------------------------------------------------------------

class ElasticController:
    def __init__(self, run: ElasticRun, ranks: ElasticRanks, policy: RecoveryPolicy, scaling: ScalingPolicy,
                 say=print):
        self.run, self.ranks, self.policy, self.scaling, self.say = run, ranks, policy, scaling, say
        self.state: State = Running()
        self.transitions: list[tuple[str, float]] = [(Running.name, time.time())]
        self.failures: list[dict] = []  # every lost rank, in order (faults while recovering too)
        self.restarts: list[RestartEvent] = []  # every restart (after a failure, a rewind, growing back)
        self._listeners: list[Callable[[State], None]] = []

    def subscribe(self, listener: Callable[[State], None]) -> None:
        """Call `listener(state)` on every state entered: `Running(after=event)` is how the run
        (its history, its MLflow record) learns of a restart."""
        self._listeners.append(listener)

    def recover(self, lost: WorkerLostError) -> RestartEvent:
        """A rank is lost: recover as the policy decides (the survivors go on with their state,
        or the run is restored from the lineage), or fail. A run that recovers from nothing
        (RecoveryPolicy.refusal) stops here with the failure, no state changed."""
        refusal = self.policy.refusal()
        if refusal:
            raise WorkerLostError(
                f"{lost}; the run stopped ({refusal})", lost.rank, lost.kind, lost.step
            ) from lost
        return self._drive(Recovering(lost))

    def rewind(self, step: int, why: str) -> RestartEvent:
        """Go back to the lineage's newest intact state at the same layout and redo the steps
        from it (train.on_nonfinite=restore): the save in flight (of a good state: a non-finite
        step applies no update) is committed first, the ranks are set up anew (torn down, as a
        restart does, so no queued step or stale stream survives) and restored."""
        self.run.commit_in_flight()
        event = self._drive(Restoring("nonfinite", dp=self.run.config.parallel.dp), failed_step=step)
        event.update(failed_step=step, message=why)
        return event

    def replace_straggler(self, rank: int) -> str | None:
        """elastic.replace_stragglers: stop a straggler's process. The next step finds the rank lost
        and recovers as from any loss (its peers go on with their state, a new process joins in its
        place from their memory). Returns why it was not replaced (RecoveryPolicy), or None."""
        if why := self.policy.replacement_refusal(self.failures):
            return why
        self.ranks.stop_rank(rank)
        return None

    def grow(self) -> RestartEvent | None:
        """At a committed checkpoint: back towards the configured dp if the cluster has room."""
        if self.policy.refusal():
            return None
        dp = self.scaling.grow_to(self.run.config)
        return None if dp is None else self._drive(Resizing(dp))

    def grows_at_checkpoint(self) -> bool:
        """Whether the run should relaunch larger from the checkpoint due now. Not while replicas
        may join live (ScalingPolicy.may_join) and the group has free bundles or warm spares:
        there the lost replicas come back, live (join_if_room)."""
        cfg = self.run.config
        joins_live = self.scaling.may_join(cfg) and self.ranks.has_room_to_join()
        return not joins_live and self.scaling.grow_to(cfg) is not None

    def join_if_room(self, now: bool) -> bool:
        """Between steps: whole replicas that fit in the group's free bundles again (a lost node
        came back, or room was made) join and take their state from live peers, not storage.
        `now`: no step is queued on the ranks. True when replicas wait to join but must not yet
        (the caller then queues no step ahead, and joins before the next)."""
        if self.policy.refusal() or not self.scaling.may_join(self.run.config) or \
                not self.ranks.has_room_to_join():
            return False
        n = self.scaling.replicas_to_join(self.run.config, self.ranks.joinable_replicas())
        if n is None or not now:
            return n is not None
        self._drive(Joining(n))
        return False

    # -- the state loop -------------------------------------------------------------------------

    def _enter(self, state: State) -> None:
        self.state = state
        self.transitions.append((state.name, time.time()))
        for listener in self._listeners:
            listener(state)

    def _drive(self, state: State, failed_step: int | None = None) -> RestartEvent:
        """Run the states from `state` until the run is Running again (its restart event) or
        Failed (the error raised). A fault in any state is a new failure: Recovering it.
        `failed_step`: the step a fault is counted at when no failure started this."""
        detected, t0, attempts = time.time(), time.monotonic(), 0
        first: WorkerLostError | None = None  # the failure the event reports
        in_flight: tuple | None = None  # abandon_save()'s (step, commit), asked once per recovery
        while not isinstance(state, (Running, Failed)):
            self._enter(state)
            try:
                if isinstance(state, Recovering):
                    first = first or state.failure
                    self.failures.append({"step": state.failure.step, "kind": state.failure.kind,
                                          "message": str(state.failure), "at": time.time()})
                    attempts += 1
                    state, in_flight = self._decide(state, first, in_flight)
                elif isinstance(state, KeepingSurvivors):
                    state = self._keep_survivors(state, first, in_flight)
                elif isinstance(state, ReloadingSurvivors):
                    state = self._reload_survivors(state, first, in_flight)
                elif isinstance(state, (Restoring, Resizing)):
                    state = self._relaunch(state, first, in_flight)
                elif isinstance(state, Joining):
                    state = self._join(state)
            except (WorkerLostError, PlacementError) as again:
                if self.policy.refusal():
                    raise
                # A rank that was joining is lost: the ranks that were there still hold their state.
                during = Joining.name if isinstance(again, JoinFailed) else state.name
                state = Recovering(
                    WorkerLostError(
                        f"while {state.name}: {again}",
                        getattr(again, "rank", None),
                        getattr(again, "kind", "placement"),
                        (
                            first.step
                            if first
                            else failed_step if failed_step is not None else self.run.global_step
                        ),
                    ),
                    during=during,
                )
            except (ElasticError, CheckpointError) as error:
                state = Failed(error)
        if isinstance(state, Failed):
            self._enter(state)
            self.run.abandon_save()  # committed if its shards all made it to storage
            self.run.teardown()
            raise state.error
        event = state.after
        event.update(detected_at=detected, attempts=attempts, restart_s=time.monotonic() - t0)
        self.restarts.append(event)
        self.say(_summary(event, len(self.restarts)))
        self._enter(state)  # listeners see Running(after=event) with the restart counted
        return event

    def _decide(self, state: Recovering, first: WorkerLostError,
                in_flight: tuple | None) -> tuple[State, tuple | None]:
        action = self.policy.decide(state, self.failures, self.run.config, self.run.group is not None)
        count = f"({len(self.failures)}/{self.policy.max_restarts})"
        if action is Action.GIVE_UP:
            error = ElasticError(
                f"giving up after {len(self.failures)} failures "
                f"(elastic.max_restarts={self.policy.max_restarts}): "
                + "; ".join(f["message"] for f in self.failures)
                + ". Resume later from the last checkpoint with checkpoint.resume=auto"
            )
            error.__cause__ = state.failure
            return Failed(error), in_flight
        if in_flight is None:
            in_flight = self.run.abandon_save()
        if action is Action.KEEP_SURVIVORS:
            self.say(f"elastic: {state.failure}; going on with the survivors {count}")
            return KeepingSurvivors(state.failure), in_flight
        self.say(f"elastic: {state.failure}; restarting {count}")
        return Restoring("failure", first), in_flight

    def _keep_survivors(
        self, state: KeepingSurvivors, first: WorkerLostError, in_flight: tuple | None
    ) -> State:
        """The live ranks drop the failed step and copy their state to host memory; the policy
        says what they can do with it: go on from the failed step, or after it when they all took
        it whole (its commit vote passed; it is recorded from their reports), nothing redone and
        nothing read from storage; reload it from peer copies; or nothing (the run restores)."""
        t0 = time.monotonic()
        cfg, lost = self.run.config, state.failure
        kept = self.ranks.keep_survivors(lost.rank if lost.kind == "died" else None)
        finished = self.run.finished_failed_step()
        spares = self.ranks.ready_spares()
        plan = self.policy.survivors(cfg, kept, self.run.global_step, set(finished), spares)
        if isinstance(plan, Refuse):
            self.say(f"elastic: the survivors cannot go on alone ({plan.why}); restarting from the lineage")
            return Restoring("failure", first, refused=plan.why)
        if isinstance(plan, Reload):
            spares = f", with {plan.spares} warm spare rank(s) in the lost places" if plan.spares else ""
            self.say(f"elastic: the survivors cannot go on with their state ({plan.why}); they reload it"
                     f" from the peer copy{spares}")
            return ReloadingSurvivors(lost, plan.ranks, plan.dp, plan.why, plan.spares)
        before = cfg.parallel.layout.record()
        if plan.took_step:  # lost after the step's commit vote: every rank took it, it is done
            self.run.commit_failed_step(finished)
        if plan.spares:
            self.say(f"elastic: {plan.spares} warm spare rank(s) take the lost ranks' places, their state "
                     "from the survivors")
        pids = self.ranks.continue_with_kept_state(plan.ranks, with_replicas(cfg, plan.replicas), plan.spares)
        event = self._restart_event("failure", "survivors", first, in_flight, before,
                                    resumed_step=self.run.global_step, checkpoint=None, since=t0, pids=pids)
        return Running(event)

    def _reload_survivors(
        self, state: ReloadingSurvivors, first: WorkerLostError, in_flight: tuple | None
    ) -> State:
        t0, before = time.monotonic(), self.run.config.parallel.layout.record()
        restored, pids = self.ranks.continue_with_reloaded_state(
            state.ranks, with_dp(self.run.config, state.dp), state.spares
        )
        return Running(
            self._restart_event(
                "failure",
                "survivors reloaded",
                first,
                in_flight,
                before,
                resumed_step=restored.step if restored else 0,
                checkpoint=restored,
                since=t0,
                pids=pids,
            )
        )

    def _relaunch(
        self, state: Restoring | Resizing, first: WorkerLostError | None, in_flight: tuple | None
    ) -> State:
        """Tear the group down and launch `state.dp` replicas (None: what the cluster holds now)
        from the lineage's newest intact state."""
        t0, before = time.monotonic(), self.run.config.parallel.layout.record()
        self.run.teardown()
        dp, waited = state.dp, 0.0
        if dp is None:
            dp, waited = self.scaling.after_failure(self.run.config, self.say)
        checkpoint = self.run.relaunch(dp)
        restoring = isinstance(state, Restoring)
        return Running(
            self._restart_event(
                state.reason if restoring else "grow",
                "restart",
                first,
                in_flight,
                before,
                resumed_step=checkpoint.step if checkpoint else self.run.global_step,
                checkpoint=checkpoint,
                since=t0,
                waited=waited,
                survivors_refused=state.refused if restoring else None,
            )
        )

    def _join(self, state: Joining) -> State:
        t0, before = time.monotonic(), self.run.config.parallel.layout.record()
        pids = self.ranks.join_live(state.replicas)
        return Running(
            self._restart_event(
                "grow",
                "live join",
                None,
                None,
                before,
                resumed_step=self.run.global_step,
                checkpoint=None,
                since=t0,
                pids=pids,
            )
        )

    def _restart_event(
        self,
        reason: str,
        recovery: str,
        lost: WorkerLostError | None,
        in_flight: tuple | None,
        before: LayoutRecord,
        *,
        resumed_step: int,
        checkpoint: Checkpoint | None,
        since: float,
        waited: float = 0.0,
        pids: list[int] | None = None,
        survivors_refused: str | None = None,
    ) -> RestartEvent:
        """The one place a restart event is made (the controller's loop adds the timings of the
        whole recovery: detected_at, attempts, restart_s). `in_flight`: abandon_save()'s (step,
        commit), None when no save was abandoned."""
        abandoned, salvaged = in_flight or (None, None)
        event = RestartEvent(
            reason=reason,
            recovery=recovery,
            failed_step=lost.step if lost else None,
            kind=lost.kind if lost else None,
            message=str(lost) if lost else None,
            checkpoint_in_flight=abandoned,
            checkpoint_in_flight_committed=salvaged is not None,
            layout_before=before,
            layout_after=self.run.config.parallel.layout.record(),
            resumed_step=resumed_step,
            checkpoint=checkpoint.path if checkpoint else None,
            wait_for_resources_s=waited,
            relaunch_s=time.monotonic() - since,
            survivors_refused=survivors_refused,
        )
        if pids is not None:
            event["pids"] = pids
        return event


def _summary(event: RestartEvent, number: int) -> str:
    steps = (event["failed_step"] - event["resumed_step"]) if event["failed_step"] is not None else 0
    what = "live join" if event["recovery"] == "live join" else f"{event['reason']} restart"
    return (f"elastic: {what} {number}: {Layout.from_record(event['layout_before']).text()} -> "
            f"{Layout.from_record(event['layout_after']).text()}, resumed at step {event['resumed_step']} "
            f"({_resumed_from(event)}), {steps} step(s) to redo, "
            f"{event['restart_s']:.1f}s to {'join' if what == 'live join' else 'restart'}")


def _resumed_from(event: RestartEvent) -> str:
    if event["recovery"] == "survivors":
        return "the survivors' state in memory"
    if event["recovery"] == "live join":
        return "the live replicas' state, sent to the new ones"
    if event["checkpoint"] == PEER_MEMORY:
        return "the peer copy in Ray's object store, no storage read"
    return event["checkpoint"] or "no checkpoint: from the start"
