"""Where checkpoints live and which of them count: one directory per step, committed by a marker
file that the driver writes last, after every rank's shards are on storage.

    <dir>/step-00000040/__0_0.distcp ...   the ranks' shards (torch.distributed.checkpoint)
    <dir>/step-00000040/.metadata          DCP's index, written by its coordinator
    <dir>/step-00000040/raymp.json         the commit marker: step, data position, layout, run,
                                           lineage, and a sha256 of every file above

A directory without raymp.json is a write that never finished (a crash, a lost node, a killed
job): it is never loaded, and is deleted by the next prune. The marker itself is written to a
temporary name and renamed, so it is either whole or absent.

Storage is a local or shared path, or any fsspec URI (s3://, gs://, file://, ...).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from raymp.storage import fsspec_fs, is_uri
from raymp.torch_compat import fsspec_storage_reader, fsspec_storage_writer

MARKER = "raymp.json"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or used; the message says which and why."""


def storage_writer(path: str):
    """DCP's writer for a path (plain files) or a URI (fsspec)."""
    if is_uri(path):
        return fsspec_storage_writer(path)

    return FileSystemWriter(path)


def storage_reader(path: str):
    if is_uri(path):
        return fsspec_storage_reader(path)

    return FileSystemReader(path)


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint: its location and what its marker says."""

    path: str
    step: int
    meta: dict

    @property
    def data_position(self) -> dict:
        return self.meta["data_position"]


def read_marker(path: str) -> Checkpoint:
    """The committed checkpoint at `path`; CheckpointError if it was never committed."""
    fs, root = fsspec_fs(path)
    marker = f"{root.rstrip('/')}/{MARKER}"
    if not fs.exists(marker):
        state = "does not exist" if not fs.exists(root) else "was never committed (no raymp.json: its write did not finish)"
        raise CheckpointError(f"checkpoint {path} {state}; pass a committed one (raymp checkpoint list DIR)")
    try:
        with fs.open(marker, "r") as f:
            meta = json.load(f)
        return Checkpoint(str(path), int(meta["step"]), meta)
    except (ValueError, KeyError, TypeError, OSError) as exc:
        raise CheckpointError(f"checkpoint {path}: its commit marker {MARKER} is damaged "
                              f"({type(exc).__name__}: {exc}); it is never loaded") from exc


@dataclass(frozen=True)
class Entry:
    """A step directory: committed (`checkpoint`), unfinished (neither), or damaged (`problem`)."""

    step: int
    path: str
    checkpoint: Checkpoint | None = None
    problem: str | None = None


class CheckpointStore:
    """The checkpoints of one run, under one directory (path or URI)."""

    def __init__(self, root: str, keep_last: int = 2):
        self.root = str(root).rstrip("/")
        self.keep_last = keep_last
        self.fs, self._root = fsspec_fs(self.root)

    def path_for(self, step: int) -> str:
        return f"{self.root}/step-{step:08d}"

    def _entries(self) -> list[tuple[int, str, bool]]:
        """(step, name, committed) of every step directory, oldest first."""
        if not self.fs.exists(self._root):
            return []
        out = []
        for entry in self.fs.ls(self._root, detail=False):
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            m = _STEP_DIR.match(name)
            if m:
                committed = self.fs.exists(f"{self._root}/{name}/{MARKER}")
                out.append((int(m.group(1)), name, committed))
        return sorted(out)

    def scan(self) -> list[Entry]:
        """Every step directory, oldest first; a marker that cannot be read makes it damaged."""
        out = []
        for step, name, ok in self._entries():
            path = f"{self.root}/{name}"
            if not ok:
                out.append(Entry(step, path))
                continue
            try:
                out.append(Entry(step, path, read_marker(path)))
            except CheckpointError as exc:
                out.append(Entry(step, path, problem=str(exc)))
        return out

    def committed(self) -> list[Checkpoint]:
        """Committed checkpoints whose marker reads, oldest first (files not verified here)."""
        return [e.checkpoint for e in self.scan() if e.checkpoint is not None]

    def uncommitted(self) -> list[str]:
        return [f"{self.root}/{name}" for _, name, ok in self._entries() if not ok]

    def latest(self) -> Checkpoint | None:
        done = self.committed()
        return done[-1] if done else None

    def probe_writable(self) -> None:
        """Create the directory and write, read back and delete a small file: a read-only or
        unreachable checkpoint.dir fails here, before any actor starts, not at the first save."""
        probe = f"{self._root}/.raymp-write-probe"
        try:
            self.fs.makedirs(self._root, exist_ok=True)
            with self.fs.open(probe, "w") as f:
                f.write("ok")
            self.fs.rm(probe)
        except (OSError, PermissionError, ValueError) as exc:
            raise CheckpointError(
                f"checkpoint.dir {self.root} is not writable ({type(exc).__name__}: {exc}); choose a "
                "directory this user can write, or fix its permissions") from exc

    def discard(self, step: int) -> bool:
        """Delete what a failed save of `step` left behind (never a committed checkpoint)."""
        _, inner = fsspec_fs(self.path_for(step))
        if not self.fs.exists(inner) or self.fs.exists(f"{inner}/{MARKER}"):
            return False
        try:
            self.fs.rm(inner, recursive=True)
        except OSError:
            return False
        return True

    def set_aside(self, after_step: int, label: str) -> list[str]:
        """Move every step directory newer than `after_step` (committed or not) under
        `<dir>/abandoned-<label>/`: a rewind keeps the abandoned timeline's checkpoints, but out
        of this directory, so no later restart or resume of this lineage can load them."""
        moved = []
        aside = f"{self._root}/abandoned-{label}"
        for step, name, _ in self._entries():
            if step > after_step:
                self.fs.makedirs(aside, exist_ok=True)
                self.fs.mv(f"{self._root}/{name}", f"{aside}/{name}", recursive=True)
                moved.append(f"{self.root}/abandoned-{label}/{name}")
        return moved

    def prepare(self, step: int) -> str:
        """A clean directory for step's checkpoint (a leftover of an unfinished write is removed)."""
        path = self.path_for(step)
        _, inner = fsspec_fs(path)
        if self.fs.exists(f"{inner}/{MARKER}"):
            self.fs.rm(f"{inner}/{MARKER}")  # about to be overwritten: uncommit it first
        if self.fs.exists(inner):
            self.fs.rm(inner, recursive=True)
        self.fs.makedirs(inner, exist_ok=True)
        return path

    def has_index(self, step: int) -> bool:
        """Whether DCP's .metadata of step's checkpoint is on storage (all shards written)."""
        _, inner = fsspec_fs(self.path_for(step))
        return self.fs.exists(f"{inner}/.metadata")

    def commit(self, step: int, meta: dict, files: dict[str, str] | None = None) -> Checkpoint:
        """Write the marker (whole or not at all), then delete what keep_last no longer keeps.
        `files` ({name: sha256}, from the ranks) lets a later load verify every byte."""
        path = self.path_for(step)
        _, inner = fsspec_fs(path)
        meta = {"step": step, "committed_at": time.time(), **meta}
        if files is not None:
            meta["files"] = files
        tmp = f"{inner}/{MARKER}.tmp"
        with self.fs.open(tmp, "w") as f:
            json.dump(meta, f, indent=1, sort_keys=True)
        self.fs.mv(tmp, f"{inner}/{MARKER}")
        self.prune()
        return Checkpoint(path, step, meta)

    def prune(self) -> list[str]:
        """Delete committed checkpoints beyond the newest keep_last, and unfinished writes older
        than the newest committed one (a newer unfinished one may still be in flight)."""
        entries = self._entries()
        done = [step for step, _, ok in entries if ok]
        keep = set(done[-self.keep_last:])
        newest = done[-1] if done else -1
        removed = []
        for step, name, ok in entries:
            if (ok and step not in keep) or (not ok and step < newest):
                if ok:  # uncommit first: a prune cut short must not leave a marker over missing shards
                    self.fs.rm(f"{self._root}/{name}/{MARKER}")
                self.fs.rm(f"{self._root}/{name}", recursive=True)
                removed.append(name)
        return removed
