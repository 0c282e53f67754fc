"""Telling a collective that failed because a peer went away, and making sure it never blocks
this process (or its peers) again.

Why: under gloo a rank whose collective failed leaves its other connections open, so a
peer waiting on it (not on the dead rank) blocks until the process-group timeout; and its own
next call on the group (a step queued behind the failed one) can block the same way. Shutting every
group down closes them: the peers fail at once too, and the actor is free for the driver's next
call (keeping its state, re-forming the group)."""

from __future__ import annotations

import torch.distributed as dist

from raymp.checkpoint.writer_process import close_writer_process


def is_peer_loss(error: BaseException | None) -> bool:
    """A torch collective failed because a peer went away (gloo: connection closed or reset,
    NCCL: a communicator error, either: the process-group timeout)."""
    return isinstance(error, dist.DistError) or any(
        phrase in str(error) for phrase in ("Connection closed by peer", "Connection reset by peer",
                                            "Timed out waiting", "NCCL communicator"))


def leave_process_groups() -> None:
    """Shut every process group of this process down (they are unusable once a peer is gone).
    Measured on gloo: a peer waiting on a rank that called ProcessGroupGloo.abort() waited for the
    whole timeout; on one that destroyed its groups, it failed at once. The connections close only
    when nothing holds the group any more: drop the model (DDP's reducer, the pipeline), the
    optimizer and any cached DeviceMesh first. DCP's writer process (async_save: process) is in a
    group of its own with the old ranks, so it goes too."""
    close_writer_process()
    if dist.is_initialized():
        dist.destroy_process_group()
