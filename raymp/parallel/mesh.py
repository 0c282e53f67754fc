"""The torch device meshes of a layout, by role: what the engines, plans and collectives of one
rank run over. The layout's degrees and rank arithmetic are raymp.layout's."""

from __future__ import annotations

from torch.distributed.device_mesh import init_device_mesh

from raymp.layout import Layout
from raymp.torch_compat import flatten_mesh, mesh_groups_from, unflatten_mesh


# This process's mesh process groups, reused by every layout it sets up (torch_compat.mesh_groups_from),
# until it leaves them (forget_mesh_groups).
_GROUPS: dict = {}


def forget_mesh_groups() -> None:
    """The process groups are gone (the rank left them): the next mesh makes its own, in the new
    world."""
    _GROUPS.clear()


def device_mesh(layout: Layout, device_type: str) -> dict:
    """The device mesh by role (_device_mesh), its process groups reused from any layout this
    process set up before: a rank that trains one layout after another keeps a bounded number
    of groups, not every layout's."""
    with mesh_groups_from(_GROUPS):
        return _device_mesh(layout, device_type)


def _device_mesh(layout: Layout, device_type: str) -> dict:
    """The device mesh by role: "cp", "pp", "tp", and "data", the data-parallel ranks that
    gradients average over and ZeRO shards over: dp, or dp and cp flattened into one; under
    HSDP a 2-D mesh (replicate, shard), which FSDP2 reads as shard along the second dimension,
    replicate along the first. Under expert parallelism also "ep" (the ranks that split each
    block's experts: ep consecutive dp replicas at one cp rank) and "expert_data" (the ranks that
    hold the same expert shard: its dp replicas and, under cp, every cp rank of theirs; under
    HSDP a 2-D mesh too: the groups, and the ranks of one group that hold the same experts)."""
    if layout.dp_replicate > 1:
        mesh = init_device_mesh(
            device_type,
            (layout.dp_replicate, layout.dp_shard * layout.cp, layout.pp, layout.tp),
            mesh_dim_names=("dp_replicate", "dp_shard_cp", "pp", "tp"),
        )
        shard_cp = unflatten_mesh(mesh["dp_shard_cp"], 0, (layout.dp_shard, layout.cp), ("dp_shard", "cp"))
        roles = {"data": mesh["dp_replicate", "dp_shard_cp"], "cp": shard_cp["cp"], "pp": mesh["pp"],
                 "tp": mesh["tp"]}
        if layout.ep > 1:  # inside each HSDP group (ep with cp refused): experts HSDP-sharded over the groups
            split = unflatten_mesh(mesh, 1, (layout.dp_shard // layout.ep, layout.ep), ("expert_shard", "ep"))
            roles.update(ep=split["ep"], expert_data=split["dp_replicate", "expert_shard"])
        return roles
    mesh = init_device_mesh(
        device_type, (layout.dp, layout.cp, layout.pp, layout.tp), mesh_dim_names=layout.MESH_DIMS
    )
    data = flatten_mesh(mesh["dp", "cp"], "dp_cp") if layout.cp > 1 else mesh["dp"]
    roles = {"data": data, "cp": mesh["cp"], "pp": mesh["pp"], "tp": mesh["tp"]}
    if layout.ep > 1 and layout.cp == 1:  # ep innermost in dp (Layout.ep_rank)
        split = unflatten_mesh(mesh["dp"], 0, (layout.expert_replicas, layout.ep), ("expert_data", "ep"))
        roles.update(ep=split["ep"], expert_data=split["expert_data"])
    elif layout.ep > 1:  # and each cp rank's experts see its slice: the copies span cp too
        split = unflatten_mesh(mesh, 0, (layout.expert_replicas, layout.ep), ("expert_data", "ep"))
        roles.update(ep=split["ep"], expert_data=flatten_mesh(split["expert_data", "cp"], "expert_data_cp"))
    return roles
