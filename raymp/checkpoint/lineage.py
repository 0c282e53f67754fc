"""A run's one timeline of committed states, and which of them a start or a restart resumes from.

Every marker records its lineage: `{"id", "parent", "parent_step"}`, where parent is the
checkpoint the timeline started from (a warm start's or a rewind's source; None for a run started
fresh). The rules, in one place:

- A checkpoint.dir holds one lineage (plus the older checkpoints it grew from). A rewind
  (checkpoint.resume = an older checkpoint of the same dir) never loads the newer checkpoints of
  the abandoned timeline; at the rewound run's first save they move to
  `<dir>/abandoned-<time>/` (kept, out of the way of this lineage's commits and prunes). A warm
  start from another dir refuses a checkpoint.dir that holds another run's checkpoints.
- Every start and every restart resumes from the newest intact state of the lineage: its own
  newest commit, then older ones, then the source it started from. Never from another timeline,
  never from scratch while the lineage has a state (restore.py loads them in that order).
- Running the same command again (after a driver crash) continues the lineage: checkpoints in
  the dir whose parent is the given source are this lineage's, further along.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from raymp.checkpoint.store import Checkpoint, CheckpointError, CheckpointStore, read_marker
from raymp.storage import fsspec_fs
from raymp.config import ConfigError


def _same(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return False
    return fsspec_fs(a)[1].rstrip("/") == fsspec_fs(b)[1].rstrip("/")


def _parent(c: Checkpoint) -> str | None:
    return (c.meta.get("lineage") or {}).get("parent")


def _parent_outside(store: CheckpointStore, c: Checkpoint) -> bool:
    """Whether c's lineage started from a checkpoint outside `store` (a warm start)."""
    record = c.meta.get("lineage") or {}
    if record.get("parent") is None:
        return False
    return not _same(record["parent"], store.path_for(int(record["parent_step"])))


@dataclass
class Lineage:
    store: CheckpointStore
    id: str
    source: Checkpoint | None = None  # the state this run started from (None: fresh)
    root: str | None = None  # the timeline's first parent outside the store (a warm start's source)
    rewound_from: int | None = None  # a rewind's step: newer checkpoints here are another timeline's
    set_aside: list[str] = field(default_factory=list)

    @classmethod
    def open(cls, store: CheckpointStore, resume: str) -> "Lineage":
        """The lineage a run with `checkpoint.resume=resume` continues in `store`."""
        if resume == "never":
            latest = store.latest()
            if latest is not None:
                raise ConfigError(
                    f"checkpoint.dir {store.root} already holds checkpoints (latest: step {latest.step}) and "
                    "checkpoint.resume is 'never'; set checkpoint.resume=auto to continue that run, or "
                    "choose another checkpoint.dir")
            return cls(store, uuid.uuid4().hex)
        if resume == "auto":
            return cls._continue(store)
        source = read_marker(resume)
        inside = _same(source.path, store.path_for(source.step))
        further = [c for c in store.committed() if _same(_parent(c), source.path)]
        if further:  # the same command again: this lineage has gone on from the source
            lineage = cls._continue(store)
            lineage.root = lineage.root or (None if inside else source.path)
            return lineage
        lineage = cls(store, uuid.uuid4().hex, source, None if inside else source.path,
                      source.step if inside else None)
        if not inside and (store.committed() or any(e.problem for e in store.scan())):
            raise CheckpointError(
                f"checkpoint.dir {store.root} holds checkpoints of another run; a warm start from {resume} "
                "needs a checkpoint.dir of its own (or set checkpoint.resume=auto to continue that run)")
        return lineage

    @classmethod
    def _continue(cls, store: CheckpointStore) -> "Lineage":
        entries = store.scan()
        committed = [e.checkpoint for e in entries if e.checkpoint is not None]
        damaged = [e for e in entries if e.problem]
        if not committed:
            if damaged:
                raise CheckpointError(
                    f"checkpoint.dir {store.root} holds only damaged checkpoints ({damaged[-1].problem}); "
                    "restore them, or start fresh in another checkpoint.dir")
            return cls(store, uuid.uuid4().hex)
        newest = committed[-1]
        record = newest.meta.get("lineage") or {}
        root = next((_parent(c) for c in committed if _parent_outside(store, c)), None)
        return cls(store, record.get("id") or uuid.uuid4().hex, newest, root)

    def record(self) -> dict:
        """What every marker of this lineage says about it."""
        return {"id": self.id, "parent": self.source.path if self.source else None,
                "parent_step": self.source.step if self.source else None}

    def abandoned(self) -> list[Checkpoint]:
        """After a rewind: the newer checkpoints of the abandoned timeline still in the dir."""
        if self.rewound_from is None:
            return []
        return [c for c in self.store.committed() if c.step > self.rewound_from and not self.owns(c)]

    def before_save(self) -> list[str]:
        """Called before this lineage's first save: a rewind's abandoned timeline moves aside."""
        if self.rewound_from is None:
            return []
        self.set_aside = self.store.set_aside(self.rewound_from, time.strftime("%Y%m%d-%H%M%S"))
        self.rewound_from = None
        return self.set_aside

    def owns(self, c: Checkpoint) -> bool:
        """Whether `c` was written by this lineage (a checkpoint of the same step from another is
        another state)."""
        return (c.meta.get("lineage") or {}).get("id") == self.id

    def candidates(self) -> list[Checkpoint]:
        """The lineage's states, newest first: this dir's commits, then the warm start's source."""
        states = [c for c in reversed(self.store.committed())
                  if self.rewound_from is None or c.step <= self.rewound_from or self.owns(c)]
        if self.root is not None and not any(_same(c.path, self.root) for c in states):
            try:
                states.append(read_marker(self.root))
            except CheckpointError:
                pass  # gone (pruned by its own run): this dir's states are all there is
        return states


def config_overrides(saved: dict, cfg) -> list[str]:
    """What the config changes against the checkpoint's config among the settings a resume takes
    from the config (optimizer hyperparameters, the schedule's length): said once at start."""
    now = cfg.model_dump(mode="json")
    out = []
    for key in sorted(set(saved.get("optimizer", {})) | set(now["optimizer"])):
        old, new = saved.get("optimizer", {}).get(key), now["optimizer"].get(key)
        if old != new:
            out.append(f"optimizer.{key}={new} applies (the checkpoint's run had {old})")
    old_steps = saved.get("train", {}).get("steps")
    if old_steps is not None and old_steps != now["train"]["steps"]:
        out.append(f"train.steps={now['train']['steps']} applies (the checkpoint's run had {old_steps}; "
                   "the LR schedule's length follows the config)")
    return out
