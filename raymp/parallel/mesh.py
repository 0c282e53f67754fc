"""ParallelDims: the (dp, pp, tp) sizes, rank arithmetic, and the named DeviceMesh they define."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelDims:
    dp: int = 1
    pp: int = 1
    tp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    def coords(self, rank: int) -> dict[str, int]:
        """Rank -> position in the mesh. tp varies fastest so a TP group is contiguous ranks
        (and so lands in one node when bundles are packed per node)."""
        tp = rank % self.tp
        pp = (rank // self.tp) % self.pp
        dp = rank // (self.tp * self.pp)
        return {"dp": dp, "pp": pp, "tp": tp}

    def rank_of(self, dp: int, pp: int, tp: int) -> int:
        return (dp * self.pp + pp) * self.tp + tp

    def build_mesh(self, device_type: str):
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(
            device_type, (self.dp, self.pp, self.tp), mesh_dim_names=("dp", "pp", "tp")
        )


def layout_of(parallel) -> dict:
    """A run's layout as recorded in checkpoints, restart events and MLflow (from ParallelConfig)."""
    p = parallel
    return {"dp": p.dp, "pp": p.pp, "tp": p.tp, "zero": p.zero, "world_size": p.dp * p.pp * p.tp}


def layout_text(layout: dict, short: bool = False) -> str:
    if short:
        return f"dp{layout['dp']}-pp{layout['pp']}-tp{layout['tp']}-zero{layout['zero']}"
    return f"dp={layout['dp']} pp={layout['pp']} tp={layout['tp']} zero={layout['zero']}"
