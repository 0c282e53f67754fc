"""Telling a collective that failed because a peer went away, and making sure it never blocks
this process (or its peers) again.

Why: under gloo a rank whose collective failed leaves its other connections open, so a
peer waiting on it (not on the dead rank) blocks until the process-group timeout; and its own
next call on the group (a step queued behind the failed one) can block the same way. Shutting every
group down closes them: the peers fail at once too, and the actor is free for the driver's next
call (keeping its state, re-forming the group)."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterable

import torch.distributed as dist

from raymp.checkpoint.writer_process import close_writer_process
from raymp.torch_compat import clear_mesh_group_registry


def is_peer_loss(error: BaseException | None) -> bool:
    """A torch collective failed because a peer went away (gloo: connection closed or reset,
    NCCL: a communicator error, either: the process-group timeout), or the step was abandoned
    for that reason; also when wrapped: a pipeline stage raises a RuntimeError from its
    forward's error."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, dist.DistError) or any(
                phrase in str(error) for phrase in ("Connection closed by peer", "Connection reset by peer",
                                                    "Timed out waiting", "NCCL communicator")):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def leave_process_groups(meshes: Iterable = (), sockets: GroupSockets | None = None) -> None:
    """Shut every process group of this process down (they are unusable once a peer is gone).
    Measured on gloo: a peer waiting on a rank that called ProcessGroupGloo.abort() waited for the
    whole timeout; on one that destroyed its groups, it failed at once. The connections close only
    when nothing holds the group any more: drop the model (DDP's reducer, the pipeline) and the
    optimizer first, and let go of the groups `meshes` hold (release_mesh_groups); what C++ still
    holds after a step stopped mid-way, `sockets` closes. DCP's writer process (async_save:
    process) is in a group of its own with the old ranks, so it goes too."""
    release_mesh_groups(meshes)
    close_writer_process()
    if dist.is_initialized():
        dist.destroy_process_group()
    if sockets is not None:
        sockets.shut()


class GroupSockets:
    """The TCP connections this process opened while it formed its process groups, shut down
    when it leaves them.

    Why: a step stopped mid-way (a peer lost, the step abandoned) leaves references to its groups
    that no Python code can drop: the autograd graph of an FSDP2 forward that raised holds FSDP's
    state through its hooks, and a DTensor collective never waited on stays in torch's work
    registry. gloo has no call that closes a group's connections (ProcessGroupGloo.abort() and
    shutdown() leave them open and wake no waiting op), so a peer inside a collective with this
    rank waited out the whole timeout. Measured in two gloo processes, one raising in its second
    forward: with FSDP2 (4 of 4 parameter groups alive after a full collection) and with TP the
    peer waited 20 s of 20; with the sockets shut down it failed at once (tests/unit/test_peer_loss.py).
    An exit does the same for a process; torchft runs gloo in a child process it can kill for
    this reason. Sockets are found in /proc/self/fd (Linux; elsewhere none are tracked), and one
    is shut down only if its descriptor still names the same socket (inode): never a socket
    opened since under a reused number. Listening sockets are left alone. Only under gloo: NCCL
    has an abort, and its own threads use the sockets of its communicators."""

    def __init__(self, backend: str = "gloo"):
        self.active = backend == "gloo"
        self._opened: dict[int, int] = {}  # descriptor -> socket inode

    @contextlib.contextmanager
    def tracked(self):
        """Every connection that appears while the block runs is the groups' it forms."""
        if not self.active:
            yield
            return
        before = _connected_sockets()
        try:
            yield
        finally:
            self._opened.update(
                (fd, ino) for fd, ino in _connected_sockets().items() if before.get(fd) != ino
            )

    def shut(self) -> None:
        now = _connected_sockets()
        for fd, ino in self._opened.items():
            if now.get(fd) == ino:
                with contextlib.suppress(OSError), socket.socket(fileno=os.dup(fd)) as sock:
                    sock.shutdown(socket.SHUT_RDWR)  # the peer's read ends: "Connection closed by peer"
        self._opened.clear()


def _connected_sockets() -> dict[int, int]:
    """This process's TCP sockets that are not listening: descriptor -> inode."""
    found = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError, ValueError):
                fd = int(name)
                if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                    continue
                with socket.socket(fileno=os.dup(fd)) as sock:
                    if (sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM
                            and not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)):
                        found[fd] = os.fstat(fd).st_ino
    return found


def release_mesh_groups(meshes: Iterable) -> None:
    """Empty each DeviceMesh's (and its root's) registry of process groups. A mesh keeps its
    groups there (torch.compile looks them up by name), and DTensor's sharding-propagation and
    redistribution caches keep every mesh they saw alive, beyond the model's life: so a rank
    that left its groups under TP or FSDP2 kept their sockets open, and a peer inside a collective
    with it waited out the whole timeout. Measured in two gloo processes after one TP step: the
    peer waited 20 s of 20 with the registry kept, failed at once with it emptied. (The registry
    is private to torch: raymp.torch_compat.)"""
    for mesh in meshes:
        clear_mesh_group_registry(mesh)


class StepAbandoned(dist.DistError):
    """The driver said a peer is gone: this rank's step was dropped mid-way (a peer loss)."""


class StepAbandon:
    """A survivor's step is doomed the moment a peer is lost, but the survivor learns so only at
    its next collective with the lost rank: under DDP the gradient all-reduce, whose error shows
    at the end of backward, a whole step's compute later (0.77 s of 1.1 s recovery measured on
    the simulated cluster, model `small`). The driver knows at once: it calls request() from the
    actor's control thread (a Ray concurrency group of its own) while the step runs in the
    training thread, which calls check() at every activation autograd saves or uses, so the step
    ends within an op. The request names the process group it is about (its rendezvous address):
    one for a group this rank has already left is void, so a request that arrives late, after
    the survivors re-formed, never stops their next step."""

    def __init__(self):
        self._lock = threading.Lock()
        self._formation = None
        self._requested = False  # read without the lock in check(): a bool read is atomic

    def arm(self, formation) -> None:
        """A new process group was joined: requests about earlier ones no longer count."""
        with self._lock:
            self._formation, self._requested = formation, False

    def request(self, formation) -> bool:
        """Drop the running step (if `formation` is this rank's group); True if that holds."""
        with self._lock:
            if formation == self._formation:
                self._requested = True
            return self._requested

    def check(self) -> None:
        if self._requested:
            raise StepAbandoned("the driver abandoned this step: a peer was lost")
