"""Recovery as a small state machine, with the two decisions in it as policy objects.

    RUNNING --failure--> RECOVERING --relaunched--> RUNNING
    RUNNING --non-finite step, train.on_nonfinite=restore--> RECOVERING (rewind) --relaunched--> RUNNING
    RUNNING --checkpoint committed, room to grow--> RESIZING --relaunched--> RUNNING
    RUNNING --a lost node's bundles placed again--> RESIZING --joined from live peers--> RUNNING
    RECOVERING --a fault while relaunching--> RECOVERING (counted as a new failure)
    RECOVERING --too many failures / no room / no intact state--> FAILED

FailurePolicy decides whether a failure is retried; ScalingPolicy decides the dp to go on with
(at once with what the survivors hold, waiting only when not even one replica fits) and when to
grow back. The controller drives a run through the small interface below (the Trainer): it never
touches actors, checkpoints or tracking itself.
"""

from __future__ import annotations

import time
from enum import Enum
from typing import Protocol

from raymp.checkpoint.store import Checkpoint, CheckpointError
from raymp.elastic.capacity import (ElasticError, capacity, largest_valid_dp, largest_valid_replicas, wait_for_replicas,
                                    with_dp, with_replicas)
from raymp.elastic.peer_copies import PEER_MEMORY
from raymp.layout import Layout
from raymp.runtime.actor_group import PlacementError, WorkerLostError


class Phase(str, Enum):
    RUNNING = "running"
    RECOVERING = "recovering"
    RESIZING = "resizing"
    FAILED = "failed"


class ElasticRun(Protocol):
    """What the controller needs of a run."""

    config: object
    group: object  # the live actor group, None once torn down

    def abandon_save(self) -> tuple[int | None, Checkpoint | None]: ...

    def teardown(self) -> None: ...

    def relaunch(self, dp: int) -> Checkpoint | None: ...

    def keep_survivors(self, lost_rank: int | None) -> dict[int, int]: ...

    def continue_on_ranks(self, ranks: list[int], config, kept: bool) -> tuple[Checkpoint | None, list[int]]: ...

    def joinable_replicas(self) -> int: ...

    def has_free_bundles(self) -> bool: ...

    def join_live(self, replicas: int) -> list[int]: ...

    def on_restart(self, event: dict) -> None: ...

    def commit_in_flight(self) -> None: ...


class FailurePolicy:
    """A failure is retried while the run has had at most elastic.max_restarts of them."""

    def __init__(self, elastic, group_is_shared: bool):
        self.enabled, self.max_restarts, self.group_is_shared = elastic.enabled, elastic.max_restarts, group_is_shared

    def refusal(self) -> str | None:
        if not self.enabled:
            return "elastic.enabled is false"
        if self.group_is_shared:
            return "the actor group was passed in (Trainer(actor_group=...)), so the driver cannot replace it"
        return None

    def give_up(self, failures: int) -> bool:
        return failures > self.max_restarts


class ScalingPolicy:
    """dp after a failure: the largest the live nodes hold now (pp x tp kept, the global batch
    kept); back to the configured dp at a checkpoint once the cluster has room again."""

    def __init__(self, target, device: str, reserve_node: str | None, grow_back: bool):
        """`target`: the configured Layout."""
        self.target_dp, self.target_replicas = target.dp, target.state_replicas
        self.device, self.reserve_node, self.grow_back = device, reserve_node, grow_back

    def after_failure(self, cfg, log) -> tuple[int, float]:
        dp, waited, _ = wait_for_replicas(cfg, self.target_dp, self.device, self.reserve_node, log)
        return dp, waited

    def replicas_to_join(self, cfg, free_replicas: int) -> int | None:
        """More whole copies of the state than now, up to the configured count, that the free
        bundles hold and the global batch splits into; None if none."""
        now = cfg.parallel.layout.state_replicas
        if not self.grow_back or not free_replicas:
            return None
        n = largest_valid_replicas(cfg, min(now + free_replicas, self.target_replicas))
        return n if n is not None and n > now else None

    def grow_to(self, cfg) -> int | None:
        """A larger dp the cluster holds now, or None."""
        if not self.grow_back or cfg.parallel.dp >= self.target_dp:
            return None
        cap = capacity(cfg, self.device, self.reserve_node, cfg.data.stream_cpus)
        dp = largest_valid_dp(cfg, min(cap.replicas, self.target_dp))
        return dp if dp is not None and dp > cfg.parallel.dp else None


class ElasticController:
    def __init__(self, run: ElasticRun, failures: FailurePolicy, scaling: ScalingPolicy, say=print):
        self.run, self.failure_policy, self.scaling, self.say = run, failures, scaling, say
        self.phase = Phase.RUNNING
        self.transitions: list[tuple[str, float]] = [(Phase.RUNNING.value, time.time())]
        self.failures: list[dict] = []  # every lost rank, in order (faults while recovering too)
        self.restarts: list[dict] = []  # every restart (after a failure, or growing back)

    def _enter(self, phase: Phase) -> None:
        self.phase = phase
        self.transitions.append((phase.value, time.time()))

    def recover(self, lost: WorkerLostError) -> dict:
        """A rank is lost. With elastic.keep_survivors, the whole replicas left go on with the
        state they hold; otherwise (or when they cannot) tear the group down and go on with the
        dp the live nodes hold, restored from the lineage's newest intact state. A fault while
        doing so is a new failure (and takes the restart path)."""
        refusal = self.failure_policy.refusal()
        if refusal:
            raise WorkerLostError(f"{lost}; the run stopped ({refusal})", lost.rank, lost.kind, lost.step) from lost
        self._enter(Phase.RECOVERING)
        detected, t0, attempts = time.time(), time.monotonic(), 0
        first, in_flight = lost, None
        while True:
            self.failures.append({"step": lost.step, "kind": lost.kind, "message": str(lost), "at": time.time()})
            if self.failure_policy.give_up(len(self.failures)):
                self._fail()
                raise ElasticError(
                    f"giving up after {len(self.failures)} failures (elastic.max_restarts="
                    f"{self.failure_policy.max_restarts}): " + "; ".join(f["message"] for f in self.failures)
                    + ". Resume later from the last checkpoint with checkpoint.resume=auto") from lost
            attempts += 1
            in_flight = in_flight or self.run.abandon_save()
            try:
                event = None
                # A hung rank (a step past its deadline) may not answer the survivors' calls: restart.
                if (attempts == 1 and self.run.config.elastic.keep_survivors and self.run.group is not None
                        and lost.kind != "timeout"):
                    self.say(f"elastic: {lost}; going on with the survivors "
                             f"({len(self.failures)}/{self.failure_policy.max_restarts})")
                    event = self._go_on_with_survivors(first, in_flight)
                if not isinstance(event, dict):  # None, or why the survivors could not go on
                    self.say(f"elastic: {lost}; restarting ({len(self.failures)}/{self.failure_policy.max_restarts})")
                    event = {**self._relaunch("failure", first, in_flight), "survivors_refused": event}
                break
            except (WorkerLostError, PlacementError) as again:
                lost = WorkerLostError(f"while restarting: {again}", getattr(again, "rank", None),
                                       getattr(again, "kind", "placement"), first.step)
            except (ElasticError, CheckpointError):
                self._fail()
                raise
        # Every attempt counts: from the failure's detection to the relaunched group.
        event.update(detected_at=detected, attempts=attempts, restart_s=time.monotonic() - t0)
        return self._done(event)

    def rewind(self, step: int, why: str) -> dict:
        """Go back to the lineage's newest intact state at the same layout and redo the steps
        from it (train.on_nonfinite=restore): the save in flight (of a good state: a non-finite
        step applies no update) is committed first, the ranks are set up anew (torn down, as a
        restart does, so no queued step or stale stream survives) and restored."""
        self._enter(Phase.RECOVERING)
        detected, t0 = time.time(), time.monotonic()
        self.run.commit_in_flight()
        event = self._relaunch("nonfinite", None, (None, None), self.run.config.parallel.dp)
        event.update(failed_step=step, message=why, detected_at=detected, attempts=1,
                     restart_s=time.monotonic() - t0)
        return self._done(event)

    def grow(self) -> dict | None:
        """At a committed checkpoint: back towards the configured dp if the cluster has room."""
        if self.failure_policy.refusal():
            return None
        dp = self.scaling.grow_to(self.run.config)
        if dp is None:
            return None
        self._enter(Phase.RESIZING)
        t0 = time.monotonic()
        try:
            event = self._relaunch("grow", None, (None, None), dp)
        except (WorkerLostError, PlacementError) as lost:
            self._enter(Phase.RUNNING)
            return self.recover(lost if isinstance(lost, WorkerLostError) else
                                WorkerLostError(f"while growing: {lost}", None, "placement"))
        event["restart_s"] = time.monotonic() - t0
        return self._done(event)

    def grows_at_checkpoint(self) -> bool:
        """Whether the run should relaunch larger from the checkpoint due now. Not while the group
        has free bundles: those are where the lost replicas come back, live (join_if_room)."""
        return not self.run.has_free_bundles() and self.scaling.grow_to(self.run.config) is not None

    def join_if_room(self, now: bool) -> bool:
        """Between steps: whole replicas that fit in the group's free bundles again (a lost node
        came back, or room was made) join and take their state from live peers, not storage.
        `now`: no step is queued on the ranks. True when replicas wait to join but must not yet
        (the caller then queues no step ahead, and joins before the next)."""
        if self.failure_policy.refusal() or not self.run.has_free_bundles():
            return False
        n = self.scaling.replicas_to_join(self.run.config, self.run.joinable_replicas())
        if n is None or not now:
            return n is not None
        self._enter(Phase.RESIZING)
        t0, before = time.monotonic(), self.run.config.parallel.layout.record()
        try:
            pids = self.run.join_live(n)
        except (WorkerLostError, PlacementError) as lost:
            self._enter(Phase.RUNNING)
            self.recover(lost if isinstance(lost, WorkerLostError) else
                         WorkerLostError(f"while joining: {lost}", None, "placement"))
            return False
        took = time.monotonic() - t0
        self._done({**self._event("grow", None, (None, None), before), "recovery": "live join",
                    "resumed_step": self.run.global_step, "checkpoint": None, "wait_for_resources_s": 0.0,
                    "relaunch_s": took, "restart_s": took, "pids": pids})
        return False

    def _relaunch(self, reason: str, lost: WorkerLostError | None, in_flight: tuple,
                  dp: int | None = None) -> dict:
        """Tear the group down and launch `dp` replicas (default: what the cluster holds) from
        the lineage's newest intact state. `in_flight`: abandon_save()'s (step, commit)."""
        t0 = time.monotonic()
        before = self.run.config.parallel.layout.record()
        self.run.teardown()
        waited = 0.0
        if dp is None:
            dp, waited = self.scaling.after_failure(self.run.config, self.say)
        checkpoint = self.run.relaunch(dp)
        return {**self._event(reason, lost, in_flight, before), "recovery": "restart",
                "resumed_step": checkpoint.step if checkpoint else self.run.global_step,
                "checkpoint": checkpoint.path if checkpoint else None,
                "wait_for_resources_s": waited, "relaunch_s": time.monotonic() - t0}

    def _go_on_with_survivors(self, lost: WorkerLostError, in_flight: tuple) -> dict | str:
        """elastic.keep_survivors: the live ranks copy their state to host memory; the whole dp
        replicas among them re-form the process group and go on from the failed step (nothing
        redone, nothing read from storage). When they cannot, why (the restart event records it):
        they did not all stop at the run's step (the failed step was taken on some: a rank was
        lost after its last collective, before it reported), no whole replica survived, or no
        valid dp is left."""
        t0 = time.monotonic()
        layout = self.run.config.parallel.layout
        kept = self.run.keep_survivors(lost.rank if lost.kind == "died" else None)
        held, at = sorted(set(kept.values())), self.run.global_step
        replicas = layout.whole_replicas(kept)
        n = largest_valid_replicas(self.run.config, len(replicas)) if replicas else None
        if held != [at] or n is None:
            why = (f"their states are after steps {held}, the run is at step {at}" if held != [at] else
                   "no whole copy of the state survived" if not replicas else
                   f"{len(replicas)} whole copies of the state split the global batch into no valid dp")
            return self._survivors_reload(lost, in_flight, sorted(kept), t0, why)
        before = layout.record()
        _, pids = self.run.continue_on_ranks([r for ranks in replicas[:n] for r in ranks],
                                      with_replicas(self.run.config, n), kept=True)
        return {**self._event("failure", lost, in_flight, before), "recovery": "survivors",
                "resumed_step": at, "checkpoint": None, "wait_for_resources_s": 0.0,
                "relaunch_s": time.monotonic() - t0, "pids": pids}

    def _survivors_reload(self, lost, in_flight: tuple, alive: list[int], t0: float, why: str) -> dict | str:
        """elastic.peer_copy_every: no whole copy of the state is in the survivors' memory, but the
        peer copies hold every part. The live ranks (whole TP groups of them) go on as the largest
        valid dp, set up anew and restored like a restart (the newest peer copy, else the lineage):
        the same processes, no new actors. `why` (restart) without peer copies or enough ranks."""
        cfg = self.run.config
        lay = cfg.parallel.layout
        per = lay.world_size // lay.dp  # the ranks of one dp replica
        ranks = lay.whole_tp_groups(alive)
        dp = largest_valid_dp(cfg, len(ranks) // per) if cfg.elastic.peer_copy_every and len(ranks) >= per else None
        if dp is None:
            self.say(f"elastic: the survivors cannot go on alone ({why}); restarting from the lineage")
            return why
        self.say(f"elastic: the survivors cannot go on with their state ({why}); they reload it")
        before = lay.record()
        restored, pids = self.run.continue_on_ranks(ranks[:dp * per], with_dp(cfg, dp), kept=False)
        return {**self._event("failure", lost, in_flight, before), "recovery": "survivors reloaded",
                "resumed_step": restored.step if restored else 0, "checkpoint": restored.path if restored else None,
                "wait_for_resources_s": 0.0, "relaunch_s": time.monotonic() - t0, "pids": pids}

    def _event(self, reason: str, lost: WorkerLostError | None, in_flight: tuple, before: dict) -> dict:
        abandoned, salvaged = in_flight
        return {"reason": reason, "failed_step": lost.step if lost else None, "kind": lost.kind if lost else None,
                "message": str(lost) if lost else None, "checkpoint_in_flight": abandoned,
                "checkpoint_in_flight_committed": salvaged is not None, "layout_before": before,
                "layout_after": self.run.config.parallel.layout.record()}

    def _done(self, event: dict) -> dict:
        self._enter(Phase.RUNNING)
        self.restarts.append(event)
        steps = (event["failed_step"] - event["resumed_step"]) if event["failed_step"] is not None else 0
        what = "live join" if event.get("recovery") == "live join" else f"{event['reason']} restart"
        self.say(
            f"elastic: {what} {len(self.restarts)}: {Layout.from_record(event['layout_before']).text()} -> "
            f"{Layout.from_record(event['layout_after']).text()}, resumed at step {event['resumed_step']} "
            f"({_resumed_from(event)}), {steps} step(s) to redo, "
            f"{event['restart_s']:.1f}s to {'join' if what == 'live join' else 'restart'}")
        self.run.on_restart(event)
        return event

    def _fail(self) -> None:
        self._enter(Phase.FAILED)
        self.run.abandon_save()  # committed if its shards all made it to storage
        self.run.teardown()


def _resumed_from(event: dict) -> str:
    if event.get("recovery") == "survivors":
        return "the survivors' state in memory"
    if event.get("recovery") == "live join":
        return "the live replicas' state, sent to the new ones"
    if event["checkpoint"] == PEER_MEMORY:
        return "the peer copy in Ray's object store, no storage read"
    return event["checkpoint"] or "no checkpoint: from the start"
