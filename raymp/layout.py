"""The layout: how one run spreads over its actors (dp replicas x cp sequence shards x pp stages
x tp shards, experts sharded over ep of the dp replicas, the ZeRO stage, micro-batches, the
pipeline schedule).

A `Layout` is the one authority on a layout's arithmetic (world size, micro-batches per replica,
stages per rank, each schedule's minimum, a rank's coordinates, what survives a loss) and its
text form; config validation, the planner, elastic re-planning, the workers and the driver ask
it and state none of that themselves. Whether a layout can run a given model is
raymp.layout_rules'; its torch device meshes are raymp.parallel.mesh's.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import TypedDict

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbv", "dualpipev")
V_SHAPED = ("zbv", "dualpipev")  # two stages per rank, placed as a V


def runs_on_fsdp(zero: int) -> bool:
    """ZeRO 2 and 3 shard with FSDP2 (fully_shard); 0 and 1 run on DDP (1 with
    ZeroRedundancyOptimizer). Engines, cost model, rules and precision all follow this."""
    return zero >= 2


def runs_under_autocast(zero: int, bf16: bool) -> bool:
    """bf16 on the DDP engines (ZeRO 0/1) is autocast over fp32 weights: matmuls in bf16, norms
    and the residual stream in fp32. FSDP2 (ZeRO 2/3) casts the weights themselves instead."""
    return bf16 and not runs_on_fsdp(zero)


class LayoutRecord(TypedDict):
    """A layout as JSON keeps it (checkpoint markers, restart events, MLflow): its degrees only,
    which is what resharding a checkpoint or re-planning after a loss reads back."""

    dp: int
    dp_replicate: int
    cp: int
    pp: int
    tp: int
    zero: int
    world_size: int
    ep: int


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    pp: int = 1
    tp: int = 1
    zero: int = 0
    micro_batch_size: int = 1
    activation_checkpointing: bool = False
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    virtual_stages: int | None = None
    stage_layers: tuple[tuple[int, ...], ...] | None = None
    cp: int = 1  # context parallel (last: layouts are also built positionally)
    dp_replicate: int = 1  # HSDP: dp = dp_replicate x dp_shard; ZeRO shards inside each replica group
    ep: int = 1  # expert parallel: each block's routed experts sharded over ep consecutive dp replicas

    @classmethod
    def of(cls, parallel) -> "Layout":
        """The layout a config's `parallel` section describes."""
        values = {f.name: getattr(parallel, f.name) for f in fields(cls)}
        if values["stage_layers"] is not None:
            values["stage_layers"] = tuple(tuple(s) for s in values["stage_layers"])
        return cls(**values)

    # -- arithmetic ---------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.pp * self.tp

    @property
    def data_parallel_size(self) -> int:
        """Ranks that hold the same parameters and average their gradients: the dp replicas
        times the cp ranks of each (each saw a different slice of the same sequences)."""
        return self.dp * self.cp

    @property
    def dp_shard(self) -> int:
        """dp replicas per HSDP shard group (all of dp without HSDP)."""
        return self.dp // self.dp_replicate

    @property
    def fsdp(self) -> bool:
        return runs_on_fsdp(self.zero)

    @property
    def zero_shards(self) -> int:
        """Ranks ZeRO splits a stage's model state over: the data-parallel ranks of one shard
        group (every one of them without HSDP)."""
        return self.data_parallel_size // self.dp_replicate

    @property
    def stages_per_rank(self) -> int:
        """Interleaved holds v stages per rank (default 2); the V-shaped schedules hold 2."""
        if self.pp == 1:
            return 1
        if self.schedule == "interleaved":
            return self.virtual_stages or 2
        return 2 if self.schedule in V_SHAPED else 1

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def expert_replicas(self) -> int:
        """Copies of each expert shard: the dp replicas over ep (the ranks an expert's gradient
        averages over, each holding the same experts)."""
        return self.dp // self.ep

    @property
    def dp_replica_holds_state(self) -> bool:
        """Each dp replica holds the whole training state: ZeRO-0 without expert parallelism."""
        return self.zero == 0 and self.ep == 1

    @property
    def state_replicas(self) -> int:
        """Whole copies of the training state the ranks hold: under ZeRO-0 each group of ep dp
        replicas (each replica without expert parallelism), each HSDP group (ZeRO shards inside
        it) under dp_replicate, else one."""
        return self.expert_replicas if self.zero == 0 else self.dp_replicate

    @property
    def ranks_per_copy(self) -> int:
        """How many ranks hold one whole copy of the state together (replica_of)."""
        return self.world_size // self.state_replicas

    def spare_unit(self, peer_copies: bool) -> int:
        """How many ranks warm spares (elastic.spares) come in. Where the ranks hold one copy of
        the state and peer copies hold its parts, a TP group: a lost group's place is taken by a
        spare group and every rank reloads the peer copy. Otherwise a whole copy of the state
        (ranks_per_copy): spares join live and take a surviving copy from its ranks."""
        return self.tp if peer_copies and self.state_replicas == 1 else self.ranks_per_copy

    def copy_source(self, rank: int) -> int:
        """The rank in `rank`'s place of the first whole copy of the state: the one a rank that
        joins in that place takes its copy from."""
        return rank % self.ranks_per_copy

    def replica_of(self, rank: int) -> list[int]:
        """The ranks that hold one whole copy of the state with `rank`: contiguous, as dp (and
        dp_replicate in it) is the outermost mesh dimension."""
        per = self.ranks_per_copy
        return list(range(rank // per * per, rank // per * per + per))

    def whole_replicas(self, ranks) -> list[list[int]]:
        """The ranks of each whole copy of the state (replica_of) that are all among `ranks`, in order."""
        alive, per = set(ranks), self.ranks_per_copy
        return [reps for r in range(0, self.world_size, per) if alive.issuperset(reps := self.replica_of(r))]

    def whole_tp_groups(self, ranks) -> list[int]:
        """The ranks among `ranks` whose whole TP group (contiguous ranks, see coords) is too, in order."""
        alive = set(ranks)
        return [r for start in range(0, self.world_size, self.tp)
                if alive.issuperset(group := range(start, start + self.tp)) for r in group]

    def settings_keeping(self, replicas: int) -> dict[str, int]:
        """The parallel settings that go on with `replicas` of its state replicas (the survivors')."""
        return (
            {"dp": replicas * self.ep} if self.zero == 0
            else {"dp": replicas * self.dp_shard, "dp_replicate": replicas}
        )

    def settings_at_dp(self, dp: int) -> dict[str, int]:
        """The parallel settings of this layout re-planned to `dp` replicas (a restart after a
        loss, a resize): under expert parallelism ep becomes the largest degree that divides both
        the old ep and the new dp, under HSDP the new dp of each group (a checkpoint reshards the
        experts to it)."""
        if self.ep == 1:
            return {"dp": dp}
        group = dp // self.dp_replicate if dp % self.dp_replicate == 0 else dp  # else refused by the rules
        return {"dp": dp, "ep": math.gcd(self.ep, group)}

    def micro_batches(self, global_batch: int) -> int:
        """Micro-batches each replica runs per optimizer step."""
        return global_batch // (self.dp * self.micro_batch_size)

    @property
    def min_micro_batches(self) -> int:
        """What torch's schedule needs per replica: 1F1B one per stage, the V shapes one per
        stage of the V, GPipe and interleaved (whose rounds are checked apart) one."""
        if self.pp == 1:
            return 1
        return {"1f1b": self.pp, "zbv": 2 * self.pp, "dualpipev": 2 * self.pp}.get(self.schedule, 1)

    MESH_DIMS = ("dp", "cp", "pp", "tp")  # outermost first

    @property
    def mesh_degrees(self) -> tuple[int, ...]:
        """Every degree parallel.mesh.device_mesh builds its meshes from: layouts equal in these
        share meshes."""
        return (self.dp, self.dp_replicate, self.cp, self.pp, self.tp, self.ep)

    def coords(self, rank: int) -> dict[str, int]:
        """Rank -> position in the mesh (dp, cp, pp, tp). tp varies fastest so a TP group is
        contiguous ranks (and so lands in one node when bundles are packed per node); cp sits
        next to dp so the two flatten into the one data-parallel dimension gradients average over."""
        return {"dp": rank // (self.tp * self.pp * self.cp), "cp": rank // (self.tp * self.pp) % self.cp,
                "pp": (rank // self.tp) % self.pp, "tp": rank % self.tp}

    def ep_rank(self, rank: int) -> int:
        """Which shard of each block's experts `rank` holds: ep is the innermost part of dp, so
        an expert-parallel group is ep consecutive dp replicas (and a whole copy of the state
        stays contiguous ranks, replica_of)."""
        return self.coords(rank)["dp"] % self.ep

    def local_batch(self, global_batch: int) -> int:
        """Sequences each dp replica reads per step (the ranks of one replica read the same)."""
        return global_batch // self.dp

    def rank_of(self, dp: int, pp: int, tp: int, cp: int = 0) -> int:
        return ((dp * self.cp + cp) * self.pp + pp) * self.tp + tp

    def ranks_where(self, **coords: int) -> list[int]:
        """Ranks whose mesh coordinates match, e.g. ranks_where(pp=0) (the first stage)."""
        return [r for r in range(self.world_size)
                if all(self.coords(r)[k] == v for k, v in coords.items())]

    # -- text and records ---------------------------------------------------------------------

    def text(self, detail: bool = False) -> str:
        """The layout as people read it; `detail` adds micro-batch size, schedule and options."""
        hsdp = f" ({self.dp_replicate}x{self.dp_shard} HSDP)" * (self.dp_replicate > 1)
        ep = f" (ep={self.ep})" * (self.ep > 1)
        cp = f" cp={self.cp}" * (self.cp > 1)
        core = f"dp={self.dp}{hsdp}{ep}{cp} pp={self.pp} tp={self.tp} zero={self.zero}"
        if not detail:
            return core
        extra = [f"mbs={self.micro_batch_size}"] + ([self.schedule] if self.pp > 1 else [])
        extra += ["+AC"] * self.activation_checkpointing + ["+SP"] * self.sequence_parallel
        return " ".join([core, *extra])

    def replica_text(self) -> str:
        """One data-parallel replica's shape, e.g. "pp=2 x tp=2"."""
        return f"{f'cp={self.cp} x ' * (self.cp > 1)}pp={self.pp} x tp={self.tp}"

    def tag(self) -> str:
        """The layout as an identifier (MLflow tag, run name)."""
        hsdp = f"-hsdp{self.dp_replicate}" * (self.dp_replicate > 1)
        ep = f"-ep{self.ep}" * (self.ep > 1)
        cp = f"-cp{self.cp}" * (self.cp > 1)
        return f"dp{self.dp}{hsdp}{ep}{cp}-pp{self.pp}-tp{self.tp}-zero{self.zero}"

    def record(self) -> LayoutRecord:
        """What checkpoints, restart events and MLflow record: enough to reshard from."""
        return LayoutRecord(dp=self.dp, dp_replicate=self.dp_replicate, cp=self.cp, pp=self.pp, tp=self.tp,
                            zero=self.zero, world_size=self.world_size, ep=self.ep)

    @classmethod
    def from_record(cls, record: LayoutRecord) -> "Layout":
        """A record read back (a checkpoint's marker, a restart event); one written before cp,
        dp_replicate and ep existed has none of them (1)."""
        return cls(record["dp"], record["pp"], record["tp"], record["zero"], cp=record.get("cp", 1),
                   dp_replicate=record.get("dp_replicate", 1), ep=record.get("ep", 1))

    def as_parallel(self) -> dict:
        """The config's `parallel` section for this layout."""
        out = asdict(self)
        if self.stage_layers is not None:
            out["stage_layers"] = [list(s) for s in self.stage_layers]
        return out
