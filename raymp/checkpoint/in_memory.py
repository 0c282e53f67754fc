"""A rank's side of a peer copy (elastic.peer_copy_every): its part of a checkpoint as bytes in
memory, and a load from every rank's parts.

The parts are the files torch DCP writes (each rank's data file, and the coordinator's metadata),
written to a node-local scratch directory and read back, so a peer copy loads into any layout
exactly as a checkpoint on storage does (RankCheckpointer.load reshards): the one loading path
stays the one that is tested under every layout. Ray's object store carries and keeps the bytes
(raymp.elastic.peer_copies); nothing goes to the run's storage.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from raymp.checkpoint.rank_state import save_state


def save_to_bytes(checkpointer, program, engine, scheduler) -> dict[str, np.ndarray]:
    """file name -> bytes (a uint8 array) of this rank's part of a checkpoint of its state now.
    Collective on the checkpoint group: every rank calls it, with no save in flight there.
    Arrays, not bytes: Ray moves them in and out of its object store without a pickle copy."""
    with tempfile.TemporaryDirectory(prefix="raymp-peer-copy-") as path:
        sd = save_state(program, engine, scheduler, checkpointer.rank)
        # Scratch read back at once: no fsync (it cost more than the write).
        dcp.save(sd, storage_writer=FileSystemWriter(path, sync_files=False), process_group=checkpointer.group)
        return {f.name: np.fromfile(f, dtype=np.uint8) for f in Path(path).iterdir() if f.is_file()}


def load_from_bytes(checkpointer, parts, program, engine, scheduler) -> dict:
    """Fill this rank's freshly set-up state from every rank's parts (save_to_bytes)."""
    with tempfile.TemporaryDirectory(prefix="raymp-peer-load-") as path:
        for part in parts:
            for name, data in part.items():
                data.tofile(Path(path, name))
        return checkpointer.load(path, program, engine, scheduler)
