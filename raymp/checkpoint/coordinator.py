"""The driver's side of checkpointing: when to save, and committing a save once every rank's
shards are on storage. A save due after a step rides on that step's own call (a SaveOrder: the
ranks start it once the update is applied), so the next step can be queued behind it; ranks
report a finished background save with a later step's result, so committing costs no extra call
either. The marker goes on last (see store.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from raymp.checkpoint.integrity import directory_files
from raymp.checkpoint.lineage import Lineage
from raymp.checkpoint.store import Checkpoint
from raymp.storage import free_space_note


@dataclass(frozen=True)
class SaveOrder:
    """A checkpoint save that rides on a step's own call: once the step's update is applied, the
    rank starts writing its part of the state after `steps_done` steps to `path` (so the driver
    can queue the next step behind it, and a save costs no round trip of its own)."""

    path: str
    steps_done: int
    async_save: bool | str


@dataclass
class PendingSave:
    step: int
    path: str
    meta: dict
    world_size: int
    reported: dict = field(default_factory=dict)  # rank -> error or None
    files: dict = field(default_factory=dict)  # file name -> sha256, from every rank


class CheckpointCoordinator:
    def __init__(self, lineage: Lineage, every: int, async_save: bool, log=print,
                 write_timeout_s: float | None = None, on_commit=None):
        self.store, self.every, self.async_save, self.log = lineage.store, every, async_save, log
        self.lineage = lineage  # recorded in every marker
        self.write_timeout_s = write_timeout_s
        self.on_commit = on_commit  # on_commit(step): the steps before it are final
        self.pending: PendingSave | None = None
        self.ordered: SaveOrder | None = None  # riding on a step whose results are not read yet
        self.committed: list[Checkpoint] = []
        self.failed: list[tuple[int, str]] = []

    def due(self, steps_done: int, total_steps: int) -> bool:
        return bool(self.every) and (steps_done % self.every == 0 or steps_done == total_steps)

    def order(self, steps_done: int, total_steps: int) -> SaveOrder | None:
        """The save due after `steps_done` steps, to ride on the call of the step that completes
        them; None when none is due, or one is still in flight or ordered (then the save due
        starts by its own call, after the step: start())."""
        if not self.due(steps_done, total_steps) or self.pending is not None or self.ordered is not None:
            return None
        self._before_save()
        self.ordered = SaveOrder(self.store.prepare(steps_done), steps_done, self.async_save)
        return self.ordered

    def _before_save(self) -> None:
        moved = self.lineage.before_save()
        if moved:
            self.log(f"checkpoint: {len(moved)} checkpoint(s) of the timeline this run rewound from moved "
                     f"aside, never loaded by it: {moved[0].rsplit('/', 1)[0]}")

    def start(self, group, steps_done: int, meta: dict) -> dict:
        """Ask every rank to write its shards of the state after `steps_done` steps. Returns how
        long the ranks were blocked (max over ranks): the cost the step loop sees."""
        if self.pending is not None:
            self.finish(group)  # commits in order: one save in flight at a time
        self._before_save()
        path = self.store.prepare(steps_done)
        # Pending before the ranks are asked: a stop (KeyboardInterrupt) that lands while they are
        # being asked must still find this save to commit; their write goes on either way.
        self.pending = PendingSave(steps_done, path, meta, group.world_size)
        reports = group.call("save_checkpoint", path, steps_done, self.async_save)
        return {k: max(r[k] for r in reports) for k in ("blocked_s", "wait_s", "stage_s")}

    def collect(self, reports: list[dict | None]) -> Checkpoint | None:
        """Take the ranks' reports of finished saves (one per rank, None while still writing);
        commit once all ranks have reported success."""
        pending = self.pending
        if pending is None:
            return None
        for rank, report in enumerate(reports):
            if report is not None and report["step"] == pending.step:
                pending.reported[rank] = report["error"]
                pending.files.update(report.get("files") or {})
        if len(pending.reported) < pending.world_size:
            return None
        self.pending = None
        errors = {r: e for r, e in pending.reported.items() if e}
        if errors:
            # Not fatal: the previous checkpoint stays committed and the next save tries again.
            rank, error = next(iter(errors.items()))
            self.failed.append((pending.step, error))
            removed = self.store.discard(pending.step)
            self.log(f"checkpoint of step {pending.step} failed on {len(errors)} rank(s) (rank {rank}: "
                     f"{error.splitlines()[0][:300]}{free_space_note(pending.path)}); not committed"
                     + (", its partial directory removed" if removed else "") + f"; {self.latest_text()}")
            return None
        return self._commit(pending, pending.files)

    def _commit(self, pending: PendingSave, files: dict) -> Checkpoint:
        checkpoint = self.store.commit(
            pending.step, {**pending.meta, "lineage": self.lineage.record()}, files
        )
        self.committed.append(checkpoint)
        if self.on_commit is not None:
            self.on_commit(checkpoint.step)
        return checkpoint

    def after_step(self, group, reports: list[dict | None], started: list[dict | None], steps_done: int,
                   total_steps: int, meta, metrics: dict) -> bool:
        """After a step: commit the save the ranks report finished, and take on the one due now:
        in flight already if it rode on the step (`started`: each rank's start of it), else
        started by its own call (a non-finite step starts no save it carries). `meta()` gives
        its record. Notes both in the step's metrics; True if a save started."""
        if (done := self.collect(reports)) is not None:
            metrics["checkpoint_committed"] = done.step
        if not self.due(steps_done, total_steps):
            return False
        order, self.ordered = self.ordered, None
        if order is not None and order.steps_done == steps_done and any(started):
            if not all(started):  # never: every rank sees the same global gradient norm
                raise RuntimeError(f"the save of step {steps_done} started on ranks "
                                   f"{[r for r, s in enumerate(started) if s]} only")
            self.pending = PendingSave(steps_done, order.path, meta(), len(started))
            metrics["checkpoint_blocked_s"] = max(s["blocked_s"] for s in started)
            return True
        metrics["checkpoint_blocked_s"] = self.start(group, steps_done, meta())["blocked_s"]
        return True

    def finish(self, group) -> Checkpoint | None:
        """Wait for the save in flight (at most checkpoint.write_timeout_s) and commit it."""
        if self.pending is None:
            return None
        reports = group.call("wait_checkpoint", self.write_timeout_s)
        if any(r is not None and r.get("timeout") for r in reports):
            step = self.pending.step
            self.pending = None
            self.failed.append((step, "timeout"))
            self.log(f"checkpoint of step {step} was still writing after {self.write_timeout_s:g}s "
                     f"(checkpoint.write_timeout_s): not committed; {self.latest_text()}")
            return None
        return self.collect(reports)

    def save_now(self, group, steps_done: int, meta: dict) -> Checkpoint:
        """Save the state after `steps_done` steps and wait for its commit; RuntimeError if it
        was not committed."""
        self.start(group, steps_done, meta)
        checkpoint = self.finish(group)
        if checkpoint is None:
            raise RuntimeError(f"the checkpoint of step {steps_done} was not committed: {self.failed[-1][1]}")
        return checkpoint

    def commit_at_end(self, group, best_effort: bool = False) -> None:
        """Commit the save in flight at the end of the run. A save that fails is reported
        (self.failed, a log line) and never fails a run whose steps all finished.
        `best_effort` (closing after an error): commit what storage holds whole, never raise."""
        if self.pending is None:
            return
        if not best_effort:
            self.finish(group)
            return
        step = self.pending.step
        try:
            self.stop(group)
        except Exception as exc:  # closing after an error: that error is the one to show
            self.log(f"checkpoint: the save of step {step} was not committed: {exc}")

    def commit_on_stop(self, group, holding_signals) -> None:
        """The run was stopped (Ctrl-C, SIGTERM, `ray job stop`): commit the save in flight inside
        `holding_signals(step)` (a context in which further stop signals wait), and say what was
        kept. A save that rode on a step whose results never came back is not kept: the run
        stopped inside that step."""
        if self.pending is None:
            if (ordered := self.ordered) is not None:
                self.log(f"stopped before step {ordered.steps_done} came back: its checkpoint, started "
                         f"by the ranks with it, is not kept; {self.latest_text()}")
            return
        step = self.pending.step
        with holding_signals(step):
            _, committed = self.stop(group)
        self.log(f"stopped: the checkpoint of step {step} " + ("was committed" if committed else
                 "was still being written and is not kept") + f"; {self.latest_text()}")

    def stop(self, group) -> tuple[int | None, Checkpoint | None]:
        """The run is stopping (Ctrl-C, SIGTERM, `ray job stop`, which sends SIGKILL 3 s later by
        default): commit the save in flight as soon as that is safe. Once DCP's index is on
        storage every rank's shards are: commit from storage, without waiting for ranks still busy
        with the interrupted step. Otherwise wait for them (checkpoint.write_timeout_s). Returns
        (the step of the save in flight, its commit or None)."""
        if self.pending is None:
            return None, None
        step = self.pending.step
        if not self.store.has_index(step):
            try:
                return step, self.finish(group)
            except Exception:  # the ranks are gone or failing: what storage holds decides
                pass
        return self.abandon()

    def abandon(self) -> tuple[int | None, Checkpoint | None]:
        """The ranks of the save in flight are gone. If DCP's index (.metadata) is on storage,
        every rank's shards were written before the loss (DCP's coordinator writes it only after
        all ranks report their writes done): commit it. Otherwise it stays uncommitted, is never
        loaded, and a later prune deletes it. Returns (its step, the commit or None)."""
        pending, self.pending, self.ordered = self.pending, None, None  # an ordered save is never committed
        if pending is None:
            return None, None
        if self.store.has_index(pending.step):
            # The lost ranks cannot report checksums: hash what is on storage now.
            return pending.step, self._commit(pending, directory_files(self.store.path_for(pending.step)))
        return pending.step, None

    def latest_text(self) -> str:
        """What a message about a save that was not kept says is kept instead."""
        latest = self.store.latest()
        return (f"the latest committed checkpoint is step {latest.step}: {latest.path}" if latest
                else "no checkpoint is committed yet")
