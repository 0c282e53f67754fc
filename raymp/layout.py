"""The layout: how one run spreads over its actors (dp replicas x cp sequence shards x pp stages
x tp shards, experts sharded over ep of the dp replicas, the ZeRO stage, micro-batches, the
pipeline schedule).

This module is the one authority on layouts. Config validation, the planner and `parallel:
auto`, elastic re-planning, the workers and the driver all ask a `Layout` for its arithmetic
(world size, micro-batches per replica, stages per rank, each schedule's minimum), its rules
(what divides what, which combinations run), its text form and its mesh; none of them states a
layout rule of its own.
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


class LayoutError(ValueError):
    """A layout that cannot run with this model and batch. The message names the field and a fix."""


@dataclass(frozen=True)
class ModelShape:
    """What the layout rules need to know of a model (models.model_shape builds it from the
    config). `tp_sizes` holds every size tensor parallelism splits, each as (the name the user
    sets it by, its size, whether model.vocab_size may pad it)."""

    n_layers: int
    tp_sizes: tuple[tuple[str, int, bool], ...] = ()
    sequence_parallel: bool = True  # the model implements sequence parallelism
    tp_plan: bool = True  # the model has a tensor-parallel plan
    not_stageable: str = ""  # why the model cannot be cut into pipeline stages, if it cannot
    # The attention heads context parallelism spreads over its ranks (Ulysses all-to-all); None:
    # the model does not implement context parallelism.
    cp_heads: int | None = None
    experts: bool = False  # mixture-of-experts blocks (model.moe)
    # Routed experts per block that expert parallelism can shard; None: the model has no
    # expert-parallel plan (dense models, Hugging Face MoE families)
    ep_experts: int | None = None
    kind: str = "the built-in model"
    layers_field: str = "model.n_layers"  # where the layer count is set, for messages
    sizes_in: str = ""  # where the tp_sizes are set, when not in the config's model section

    @classmethod
    def of_args(cls, args, vocab_name: str = "the vocabulary") -> "ModelShape":
        """The built-in decoder of this ModelArgs shape."""
        return cls(args.n_layers, (("model.n_heads", args.n_heads, False),
                                   ("model.n_kv_heads", args.n_kv_heads, False),
                                   ("model.ffn_dim", args.ffn_dim, False),
                                   (vocab_name, args.vocab_size, True)), cp_heads=args.n_heads,
                   experts=args.moe is not None, ep_experts=args.moe.n_experts if args.moe else None)


def padded_vocab(vocab: int, tp: int) -> int:
    """The smallest multiple of 64·tp at or above `vocab`: a vocabulary every TP rank splits evenly."""
    return -(-vocab // (64 * tp)) * 64 * tp


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
        the old ep and the new dp (a checkpoint reshards the experts to it)."""
        return {"dp": dp} if self.ep == 1 else {"dp": dp, "ep": math.gcd(self.ep, dp)}

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
        """Every degree device_mesh builds its meshes from: layouts equal in these share meshes."""
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

    # -- rules ------------------------------------------------------------------------------

    def check(self, shape: ModelShape, global_batch: int, seq_len: int,
              devices_per_node: int | None = None) -> None:
        """Raise LayoutError with the first reason this layout cannot run."""
        for problem in self.problems(shape, global_batch, seq_len, devices_per_node):
            raise LayoutError(problem)

    def problems(self, shape: ModelShape, global_batch: int, seq_len: int,
                 devices_per_node: int | None = None) -> list[str]:
        """Every reason this layout cannot run this model at this batch, most basic first."""
        return [*self._data_parallel_problems(), *_expert_problems(self, shape),
                *self._tensor_problems(shape, seq_len, devices_per_node),
                *_context_problems(self, shape, seq_len), *self._pipeline_problems(shape),
                *_batch_problems(self, global_batch)]

    def _data_parallel_problems(self):
        rep = self.dp_replicate
        if rep == 1:
            return
        if self.dp % rep:
            yield (
                f"parallel.dp_replicate ({rep}) must divide parallel.dp ({self.dp}): HSDP runs dp_replicate "
                f"groups of dp / dp_replicate shards; change one of them"
            )
        elif not self.fsdp:
            yield (
                "parallel.dp_replicate > 1 (HSDP) shards with FSDP2 inside each group and needs "
                f"parallel.zero 2 or 3 (zero is {self.zero}); set parallel.zero=3, or "
                "parallel.dp_replicate=1"
            )

    def _tensor_problems(self, shape: ModelShape, seq_len: int, devices_per_node: int | None):
        tp = self.tp
        if tp > 1 and devices_per_node is not None and tp > devices_per_node:
            yield (f"parallel.tp ({tp}) exceeds the {devices_per_node} devices of a node; a TP group "
                   "stays in one")
        if tp > 1 and shape.experts:
            yield (
                "model.moe with parallel.tp > 1 is not supported (no tensor-parallel plan for expert blocks "
                "yet); set parallel.tp=1 and spread the model with parallel.pp or parallel.zero"
            )
        elif tp > 1 and not shape.tp_plan:
            yield ("parallel.tp > 1 needs a tensor-parallel plan for a model.factory model: set "
                   "model.factory_tp_plan (docs/models.md), or use parallel.tp=1")
        for name, size, paddable in shape.tp_sizes if tp > 1 else ():
            if size % tp:
                yield f"parallel.tp ({tp}) must divide {name} ({size})" + (
                    f" in {shape.sizes_in}" * bool(shape.sizes_in)
                ) + (f"; pad it: set model.vocab_size={padded_vocab(size, tp)}" if paddable else "")
        if self.sequence_parallel and tp == 1:
            yield "parallel.sequence_parallel needs parallel.tp > 1; set one or the other"
        elif self.sequence_parallel and not shape.sequence_parallel:
            yield (f"parallel.sequence_parallel is not implemented for {shape.kind} (it is for the built-in, "
                   "Llama, Qwen2 and Mistral models); it runs tensor parallel without it: set "
                   "parallel.sequence_parallel=false")
        elif self.sequence_parallel and seq_len % tp:
            yield (f"parallel.sequence_parallel splits train.seq_len ({seq_len}) over parallel.tp ({tp}): "
                   f"make it a multiple of {tp}")
        if tp > 1 and self.zero == 1:
            yield ("parallel.zero=1 (ZeroRedundancyOptimizer) does not take tensor-parallel (DTensor) "
                   "parameters; use parallel.zero=2 (same memory for optimizer state, plus sharded "
                   "gradients) or 0")

    def _pipeline_problems(self, shape: ModelShape):
        if self.schedule not in SCHEDULES:
            yield f"parallel.schedule {self.schedule!r} is not one of {', '.join(SCHEDULES)}"
        if self.virtual_stages is not None and self.schedule != "interleaved":
            yield (f"parallel.virtual_stages applies to schedule=interleaved only (schedule is "
                   f"{self.schedule!r}); remove it")
        if self.pp == 1:
            if self.stage_layers is not None:
                yield "parallel.stage_layers needs parallel.pp > 1; remove it"
            return
        if shape.not_stageable:
            yield shape.not_stageable
        stages = self.num_stages
        if stages > shape.n_layers:
            yield (f"parallel.pp={self.pp} with schedule {self.schedule} makes {stages} pipeline stages but "
                   f"{shape.layers_field} is {shape.n_layers}; every stage needs at least one layer: lower "
                   f"parallel.pp{' or parallel.virtual_stages' if self.schedule == 'interleaved' else ''}")
        if self.stage_layers is not None:
            flat = [i for layers in self.stage_layers for i in layers]
            if len(self.stage_layers) != stages or any(not layers for layers in self.stage_layers):
                yield (f"parallel.stage_layers must list {stages} non-empty stages (pp x stages per rank "
                       f"for {self.schedule}); got {len(self.stage_layers)}")
            elif flat != list(range(shape.n_layers)):
                yield (f"parallel.stage_layers must split layers 0..{shape.n_layers - 1} into consecutive "
                       f"runs, in order, each layer once; got {[list(s) for s in self.stage_layers]}")


def device_mesh(layout: Layout, device_type: str) -> dict:
    """The device mesh by role: "cp", "pp", "tp", and "data", the data-parallel ranks that
    gradients average over and ZeRO shards over: dp, or dp and cp flattened into one; under
    HSDP a 2-D mesh (replicate, shard), which FSDP2 reads as shard along the second dimension,
    replicate along the first. Under expert parallelism also "ep" (the ranks that split each
    block's experts) and "expert_data" (the ranks that hold the same expert shard)."""
    from torch.distributed.device_mesh import init_device_mesh

    from raymp.torch_compat import flatten_mesh, unflatten_mesh

    if layout.dp_replicate > 1:
        mesh = init_device_mesh(
            device_type,
            (layout.dp_replicate, layout.dp_shard * layout.cp, layout.pp, layout.tp),
            mesh_dim_names=("dp_replicate", "dp_shard_cp", "pp", "tp"),
        )
        shard_cp = unflatten_mesh(mesh["dp_shard_cp"], 0, (layout.dp_shard, layout.cp), ("dp_shard", "cp"))
        return {
            "data": mesh["dp_replicate", "dp_shard_cp"],
            "cp": shard_cp["cp"],
            "pp": mesh["pp"],
            "tp": mesh["tp"],
        }
    mesh = init_device_mesh(
        device_type, (layout.dp, layout.cp, layout.pp, layout.tp), mesh_dim_names=layout.MESH_DIMS
    )
    data = flatten_mesh(mesh["dp", "cp"], "dp_cp") if layout.cp > 1 else mesh["dp"]
    roles = {"data": data, "cp": mesh["cp"], "pp": mesh["pp"], "tp": mesh["tp"]}
    if layout.ep > 1:  # ep innermost in dp (Layout.ep_rank); "expert_data": the copies of one expert shard
        split = unflatten_mesh(mesh["dp"], 0, (layout.expert_replicas, layout.ep), ("expert_data", "ep"))
        roles.update(ep=split["ep"], expert_data=split["expert_data"])
    return roles


def _expert_problems(layout: Layout, shape: ModelShape):
    """Layout's rules on expert parallelism: what ep shards and which layouts it runs with."""
    ep = layout.ep
    if ep == 1:
        return
    if not shape.experts:
        yield (f"parallel.ep ({ep}) shards mixture-of-experts blocks, and {shape.kind} has none: set "
               "parallel.ep=1, or pick an MoE model (model.moe or model.preset tiny-moe)")
        return
    if shape.ep_experts is None:
        yield (f"parallel.ep > 1 is implemented for the built-in model's MoE blocks, not {shape.kind}: set "
               "parallel.ep=1 and spread the model with parallel.pp or parallel.zero")
        return
    if shape.ep_experts % ep:
        yield (f"parallel.ep ({ep}) must divide model.moe.n_experts ({shape.ep_experts}): each ep rank holds "
               "an equal share of every block's experts; change parallel.ep")
    if layout.dp % ep:
        yield (f"parallel.ep ({ep}) must divide parallel.dp ({layout.dp}): expert parallelism shards experts "
               f"over ep of the dp replicas; set parallel.dp to a multiple of {ep}")
    if layout.zero == 1:
        yield ("parallel.zero=1 (ZeroRedundancyOptimizer) does not take expert-parallel (DTensor) "
               "parameters; use parallel.zero=2 (same memory for optimizer state, plus sharded gradients) "
               "or 0")
    # (tp and cp with MoE blocks are refused for every MoE layout: _tensor_problems, _context_problems)
    if layout.dp_replicate > 1:
        yield ("parallel.ep > 1 with HSDP (parallel.dp_replicate > 1) is not built yet; set "
               "parallel.dp_replicate=1 (ZeRO 2/3 then shard over all of dp), or parallel.ep=1")


def _context_problems(layout: Layout, shape: ModelShape, seq_len: int):
    """Layout's rules on context parallelism: the model's heads and the sequence split over cp."""
    cp, tp = layout.cp, layout.tp
    if cp == 1:
        return
    if shape.experts:
        yield ("model.moe with parallel.cp > 1 is not supported (the sequence-wise balance loss needs each "
               "whole sequence's routing); set parallel.cp=1")
        return
    if shape.cp_heads is None:
        yield (f"parallel.cp is implemented for the built-in model only, not {shape.kind}: set parallel.cp=1 "
               "(or train shorter sequences, or use parallel.tp with sequence_parallel to cut activations)")
        return
    if shape.cp_heads % (tp * cp):
        yield (
            f"parallel.cp ({cp}) x parallel.tp ({tp}) must divide model.n_heads ({shape.cp_heads}): context "
            "parallelism gives each cp rank a share of every TP rank's heads; change parallel.cp"
        )
    split = cp * tp if layout.sequence_parallel else cp
    if seq_len % split:
        what = "parallel.cp x parallel.tp (sequence parallel)" if layout.sequence_parallel else "parallel.cp"
        yield f"{what} = {split} must divide train.seq_len ({seq_len}): make it a multiple of {split}"


def _batch_problems(layout: Layout, global_batch: int):
    """Layout's rules on the global batch: whole micro-batches per replica, as many as the schedule needs."""
    per_step = layout.dp * layout.micro_batch_size
    if global_batch % per_step:
        below, above = global_batch // per_step * per_step, (global_batch // per_step + 1) * per_step
        yield (f"train.global_batch_size ({global_batch}) must be divisible by parallel.dp * "
               f"parallel.micro_batch_size = {layout.dp}*{layout.micro_batch_size} = {per_step}; try "
               f"train.global_batch_size={f'{below} or {above}' if below else above}")
        return
    micro, need = layout.micro_batches(global_batch), layout.min_micro_batches
    if micro < need:
        yield (f"schedule {layout.schedule} with parallel.pp={layout.pp} needs at least {need} micro-batches "
               f"per replica, but train.global_batch_size / (parallel.dp * parallel.micro_batch_size) = "
               f"{micro}; raise train.global_batch_size to {need * per_step} or lower "
               "parallel.micro_batch_size")
    rounds = max(1, micro // layout.pp)
    if layout.pp > 1 and layout.schedule == "interleaved" and micro % rounds:
        yield (f"schedule interleaved needs the micro-batch count ({micro}) to be a multiple of "
               f"max(1, micro-batches // pp) = {rounds}; use a multiple of parallel.pp={layout.pp} "
               "micro-batches per replica")
