"""A rank's membership of its world: the process groups it forms (the world's, the checkpoint
group, each layout's meshes and tied-embedding groups), and leaving all of them at once.

Why an object of its own: a world is formed at start, left when a peer is lost (the groups are
unusable then and must never block this rank or its peers, raymp.runtime.peer_loss) and formed
again when the survivors re-form it or a rank joins. What those need to share (the connections
tracked while groups form, the world's one gloo transport, the meshes made so far, the step
abandon armed for this world) lives here, not in the Worker's attributes."""

from __future__ import annotations

import contextlib
from datetime import timedelta

import torch.distributed as dist

from raymp import torch_compat
from raymp.parallel.mesh import device_mesh, forget_mesh_groups
from raymp.runtime.peer_loss import GroupSockets, StepAbandon, leave_process_groups
from raymp.runtime.steps import forget_tied_groups


class WorldMembership:
    """This rank's groups in the world it joined last; `broken` once it left them for a lost
    peer (no collective may run until it joins again)."""

    def __init__(self):
        self.abandon = StepAbandon()  # armed per world; requested from the control thread
        self.sockets = GroupSockets()  # what the groups connected, shut when this rank leaves them (gloo)
        self.gloo_devices: list = []  # the world's gloo devices, shared by its groups
        self.meshes: dict = {}  # a layout's mesh degrees -> its meshes by role
        self.broken = False

    def join(self, rank: int, world_size: int, addr: str, port: int, backend: str,
             timeout_s: float) -> dist.ProcessGroup:
        """Form the world's process group at the rendezvous (addr, port), and the gloo group
        checkpoints use (DCP's planning collectives run in a background thread during async
        saves: they must not share the training's group). Returns the checkpoint group."""
        self.abandon.arm((addr, port))
        self.sockets = GroupSockets(backend)  # the last world's were shut as this rank left it
        self.gloo_devices = torch_compat.new_gloo_devices()  # this world's groups' one transport
        self.broken = False
        timeout = timedelta(seconds=timeout_s)
        with self.forming():
            # An explicit timeout: a rank whose peer died must fail, not hang forever (docs/design.md).
            dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank,
                                    world_size=world_size, timeout=timeout)
            return dist.new_group(backend="gloo", timeout=timeout)

    @contextlib.contextmanager
    def forming(self):
        """Where this rank makes process groups: their connections are tracked (to be shut when it
        leaves them) and every gloo group of the world shares its devices (one polling thread)."""
        with self.sockets.tracked(), torch_compat.gloo_groups_share(self.gloo_devices):
            yield

    def mesh(self, layout, device_type: str) -> dict:
        """The layout's meshes by role, made once per layout shape in this world (call inside
        forming())."""
        key = layout.mesh_degrees
        if key not in self.meshes:
            self.meshes[key] = device_mesh(layout, device_type)
        return self.meshes[key]

    def leave(self, broken: bool) -> None:
        """Shut every group of this world down. Drop what holds them first (the model's DDP
        reducer, the pipeline, the optimizer): gloo closes a group's connections when it is
        released. `broken`: left because a peer was lost, so no step may run until join()."""
        meshes = [mesh for by_role in self.meshes.values() for mesh in by_role.values()]
        self.meshes, self.broken = {}, broken
        forget_mesh_groups()  # first: these caches hold the groups too
        forget_tied_groups()
        leave_process_groups(meshes, self.sockets)
