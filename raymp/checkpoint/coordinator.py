"""The driver's side of checkpointing: when to save, and committing a save once every rank's
shards are on storage. Ranks report a finished background save with their next step's result,
so committing costs no extra call; the marker goes on last (see store.py)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from raymp.checkpoint.store import Checkpoint, CheckpointStore


@dataclass
class PendingSave:
    step: int
    path: str
    meta: dict
    world_size: int
    reported: dict = field(default_factory=dict)  # rank -> error or None


class CheckpointCoordinator:
    def __init__(self, store: CheckpointStore, every: int, async_save: bool, log=print):
        self.store, self.every, self.async_save, self.log = store, every, async_save, log
        self.pending: PendingSave | None = None
        self.committed: list[Checkpoint] = []
        self.failed: list[tuple[int, str]] = []

    def due(self, steps_done: int, total_steps: int) -> bool:
        return bool(self.every) and (steps_done % self.every == 0 or steps_done == total_steps)

    def start(self, group, steps_done: int, meta: dict) -> dict:
        """Ask every rank to write its shards of the state after `steps_done` steps. Returns how
        long the ranks were blocked (max over ranks): the cost the step loop sees."""
        if self.pending is not None:
            self.finish(group)  # commits in order: one save in flight at a time
        path = self.store.prepare(steps_done)
        reports = group.call("save_checkpoint", path, steps_done, self.async_save)
        self.pending = PendingSave(steps_done, path, meta, group.world_size)
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
        if len(pending.reported) < pending.world_size:
            return None
        self.pending = None
        errors = {r: e for r, e in pending.reported.items() if e}
        if errors:
            # Not fatal: the previous checkpoint stays committed and the next save tries again.
            rank, error = next(iter(errors.items()))
            self.failed.append((pending.step, error))
            warnings.warn(f"checkpoint of step {pending.step} failed on {len(errors)} rank(s) "
                          f"(rank {rank}: {error}); it was not committed, {self._latest_text()}")
            return None
        checkpoint = self.store.commit(pending.step, pending.meta)
        self.committed.append(checkpoint)
        return checkpoint

    def finish(self, group) -> Checkpoint | None:
        """Wait for the save in flight and commit it."""
        if self.pending is None:
            return None
        return self.collect(group.call("wait_checkpoint"))

    def abandon(self) -> tuple[int | None, Checkpoint | None]:
        """The ranks of the save in flight are gone. If DCP's index (.metadata) is on storage,
        every rank's shards were written before the loss (DCP's coordinator writes it only after
        all ranks report their writes done): commit it. Otherwise it stays uncommitted, is never
        loaded, and a later prune deletes it. Returns (its step, the commit or None)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None, None
        if self.store.has_index(pending.step):
            checkpoint = self.store.commit(pending.step, pending.meta)
            self.committed.append(checkpoint)
            return pending.step, checkpoint
        return pending.step, None

    def _latest_text(self) -> str:
        latest = self.store.latest()
        return f"the latest committed checkpoint is step {latest.step}" if latest else "no checkpoint is committed yet"
