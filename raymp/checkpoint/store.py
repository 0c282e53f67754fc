"""Where checkpoints live and which of them count: one directory per step, committed by a marker
file that the driver writes last, after every rank's shards are on storage.

    <dir>/step-00000040/__0_0.distcp ...   the ranks' shards (torch.distributed.checkpoint)
    <dir>/step-00000040/.metadata          DCP's index, written by its coordinator
    <dir>/step-00000040/raymp.json         the commit marker: step, data position, layout, run,
                                           lineage, a sha256 of every file above, and a sha256
                                           of the marker's own content

A directory without raymp.json is a write that never finished (a crash, a lost node, a killed
job): it is never loaded, and is deleted by the next prune. The marker itself is written to a
temporary name and renamed, so it is either whole or absent; its own checksum makes a marker
changed after the commit damaged, as a changed shard is (without it, one flipped byte in the
name of its file list would turn verification off, and one flipped digit in its data position
would resume on other samples).

Storage is a local or shared path, or any fsspec URI (s3://, gs://, file://, ...).
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass

from raymp.checkpoint.integrity import verify
from raymp.checkpoint.raw_storage import RawFileReader, RawFileWriter, RawFsspecReader, RawFsspecWriter
from raymp.storage import fsspec_fs, is_uri

MARKER = "raymp.json"
MARKER_DIGEST = "marker_sha256"  # the marker's checksum of the rest of its content
_STEP_DIR = re.compile(r"^step-(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or used; the message says which and why."""


def storage_writer(path: str):
    """DCP's writer for a path (plain files) or a URI (fsspec), tensors written raw (raw_storage.py)."""
    return RawFsspecWriter(path) if is_uri(path) else RawFileWriter(path)


def storage_reader(path: str):
    """DCP's reader for a path or a URI, for raw tensors and torch.save ones alike."""
    return RawFsspecReader(path) if is_uri(path) else RawFileReader(path)


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint: its location and what its marker says."""

    path: str
    step: int
    meta: dict

    @property
    def data_position(self) -> dict:
        return self.meta["data_position"]


def marker_digest(meta: dict) -> str:
    """sha256 of a marker's content (its own checksum left out), in one canonical form."""
    body = {k: v for k, v in meta.items() if k != MARKER_DIGEST}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def read_marker(path: str) -> Checkpoint:
    """The committed checkpoint at `path`; CheckpointError if it was never committed or its
    marker is not what was committed (unreadable, or its content does not match its checksum)."""
    fs, root = fsspec_fs(path)
    marker = f"{root.rstrip('/')}/{MARKER}"
    if not fs.exists(marker):
        state = (
            "does not exist"
            if not fs.exists(root)
            else "was never committed (no raymp.json: its write did not finish)"
        )
        raise CheckpointError(f"checkpoint {path} {state}; pass a committed one (raymp checkpoint list DIR)")
    try:
        with fs.open(marker, "r") as f:
            meta = json.load(f)
        step = int(meta["step"])
    except (ValueError, KeyError, TypeError, OSError) as exc:
        raise CheckpointError(f"checkpoint {path}: its commit marker {MARKER} is damaged "
                              f"({type(exc).__name__}: {exc}); it is never loaded") from exc
    if meta.get(MARKER_DIGEST) != marker_digest(meta):
        why = ("does not match its checksum (changed after the commit)" if MARKER_DIGEST in meta
               else "carries no checksum of its own (damaged, or written by an earlier raymp build)")
        raise CheckpointError(f"checkpoint {path}: its commit marker {MARKER} {why}; it is never loaded")
    return Checkpoint(str(path), step, meta)


@dataclass(frozen=True)
class Entry:
    """A step directory: committed (`checkpoint`), unfinished (neither), or damaged (`problem`)."""

    step: int
    path: str
    checkpoint: Checkpoint | None = None
    problem: str | None = None

    @property
    def committed(self) -> bool:
        """It has a marker (readable or damaged): not a write still in flight or cut short."""
        return self.checkpoint is not None or self.problem is not None


class CheckpointStore:
    """The checkpoints of one run, under one directory (path or URI)."""

    def __init__(self, root: str, keep_last: int = 2):
        self.root = str(root).rstrip("/")
        self.keep_last = keep_last
        self.fs, self._root = fsspec_fs(self.root)
        self._verified: dict[str, tuple[tuple, list[str]]] = {}  # path -> (file signature, problems)

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
        meta[MARKER_DIGEST] = marker_digest(meta)
        tmp = f"{inner}/{MARKER}.tmp"
        with self.fs.open(tmp, "w") as f:
            json.dump(meta, f, indent=1, sort_keys=True)
        self.fs.mv(tmp, f"{inner}/{MARKER}")
        checkpoint = Checkpoint(path, step, meta)
        if files is not None:  # the ranks hashed these files as they wrote them
            self._verified[path] = (self._file_signature(path), [])
        self.prune()
        return checkpoint

    def prune(self) -> list[str]:
        """Delete what keep_last no longer keeps: the newest keep_last *intact* checkpoints are
        kept with every damaged one newer than them (a damaged checkpoint never takes an intact
        one's place), everything older goes, and so do unfinished writes older than the newest
        committed one (a newer unfinished one may still be in flight)."""
        entries = self.scan()
        done = [e for e in entries if e.committed]
        newest = done[-1].step if done else -1
        keep, intact = set(), 0
        for e in reversed(done):
            if intact >= self.keep_last:
                break
            keep.add(e.step)
            intact += e.checkpoint is not None and not self.problems(e.checkpoint)
        removed = []
        for e in entries:
            if (e.committed and e.step not in keep) or (not e.committed and e.step < newest):
                name = e.path.rsplit("/", 1)[-1]
                # Uncommit first: a prune cut short must not leave a marker over missing shards.
                if e.committed:
                    self.fs.rm(f"{self._root}/{name}/{MARKER}")
                self.fs.rm(f"{self._root}/{name}", recursive=True)
                removed.append(name)
        return removed

    def problems(self, checkpoint: Checkpoint) -> list[str]:
        """What is wrong with a committed checkpoint's files (empty: intact). Verified again only
        when its files changed since this store last verified or committed it (names, sizes,
        modification times), so a prune reads no checkpoint it has seen unchanged: a write that
        damaged one is seen; media that rot a byte without a write are caught at the load."""
        seen = self._file_signature(checkpoint.path)
        if (cached := self._verified.get(checkpoint.path)) is not None and cached[0] == seen:
            return cached[1]
        found = verify(checkpoint.path, checkpoint.meta)
        self._verified[checkpoint.path] = (seen, found)
        return found

    def _file_signature(self, path: str) -> tuple:
        _, inner = fsspec_fs(path)
        return tuple(sorted((info["name"].rsplit("/", 1)[-1], info.get("size"),
                             str(info.get("mtime") or info.get("LastModified") or info.get("updated")))
                            for info in self.fs.ls(inner, detail=True)))
