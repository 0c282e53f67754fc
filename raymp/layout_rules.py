"""The layout rules: whether a layout can run a model at a batch and sequence length, and if not,
every reason why, each naming the field to change and a fix.

Config validation, the planner and `parallel: auto`, elastic re-planning and the driver's launch
all ask `problems` (or `check`) here; none of them states a layout rule of its own. The layout's
arithmetic and text forms are raymp.layout's; what the rules need of a model is a `ModelShape`
(raymp.models.shape builds it from a config).
"""

from __future__ import annotations

from dataclasses import dataclass

from raymp.layout import SCHEDULES, Layout


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
    # A balance loss over each whole sequence's routing (model.moe.aux_loss_coef > 0)
    sequence_balance_loss: bool = False
    # Routed experts per block that expert parallelism can shard; None: the model has no
    # expert-parallel plan (dense models)
    ep_experts: int | None = None
    expert_tp_plan: bool = True  # tensor parallelism has a plan for the expert blocks
    kind: str = "the built-in model"
    layers_field: str = "model.n_layers"  # where the layer count is set, for messages
    experts_field: str = "model.moe.n_experts"  # where the expert count is set, for messages
    sizes_in: str = ""  # where the tp_sizes are set, when not in the config's model section

    @classmethod
    def built_in(cls, n_layers: int, n_heads: int, n_kv_heads: int, ffn_dim: int, vocab: tuple,
                 moe) -> "ModelShape":
        """The built-in decoder's shape. `vocab`: its (field, size, padded) entries; `moe`: its MoE
        settings (ModelArgs' or the config's section: both name n_experts and aux_loss_coef), None
        for a dense model."""
        return cls(n_layers, (("model.n_heads", n_heads, False), ("model.n_kv_heads", n_kv_heads, False),
                              ("model.ffn_dim", ffn_dim, False), *vocab), cp_heads=n_heads,
                   experts=moe is not None, ep_experts=moe.n_experts if moe is not None else None,
                   sequence_balance_loss=moe is not None and moe.aux_loss_coef > 0)

    @classmethod
    def of_args(cls, args, vocab_name: str = "the vocabulary") -> "ModelShape":
        """The built-in decoder of this ModelArgs shape."""
        return cls.built_in(args.n_layers, args.n_heads, args.n_kv_heads, args.ffn_dim,
                            ((vocab_name, args.vocab_size, True),), args.moe)


def padded_vocab(vocab: int, tp: int) -> int:
    """The smallest multiple of 64·tp at or above `vocab`: a vocabulary every TP rank splits evenly."""
    return -(-vocab // (64 * tp)) * 64 * tp


def check(layout: Layout, shape: ModelShape, global_batch: int, seq_len: int,
          devices_per_node: int | None = None) -> None:
    """Raise LayoutError with the first reason this layout cannot run."""
    for problem in problems(layout, shape, global_batch, seq_len, devices_per_node):
        raise LayoutError(problem)


def problems(layout: Layout, shape: ModelShape, global_batch: int, seq_len: int,
             devices_per_node: int | None = None) -> list[str]:
    """Every reason this layout cannot run this model at this batch, most basic first."""
    return [*_data_parallel_problems(layout), *_expert_problems(layout, shape),
            *_tensor_problems(layout, shape, seq_len, devices_per_node),
            *_context_problems(layout, shape, seq_len), *_pipeline_problems(layout, shape),
            *_batch_problems(layout, global_batch)]


def _data_parallel_problems(layout: Layout):
    """The rules on HSDP: dp_replicate groups of FSDP2 shards."""
    rep = layout.dp_replicate
    if rep == 1:
        return
    if layout.dp % rep:
        yield (
            f"parallel.dp_replicate ({rep}) must divide parallel.dp ({layout.dp}): HSDP runs dp_replicate "
            f"groups of dp / dp_replicate shards; change one of them"
        )
    elif not layout.fsdp:
        yield (
            "parallel.dp_replicate > 1 (HSDP) shards with FSDP2 inside each group and needs "
            f"parallel.zero 2 or 3 (zero is {layout.zero}); set parallel.zero=3, or "
            "parallel.dp_replicate=1"
        )


def _tensor_problems(layout: Layout, shape: ModelShape, seq_len: int, devices_per_node: int | None):
    """The rules on tensor and sequence parallelism: what tp splits, and where it runs."""
    tp = layout.tp
    if tp > 1 and devices_per_node is not None and tp > devices_per_node:
        yield (f"parallel.tp ({tp}) exceeds the {devices_per_node} devices of a node; a TP group "
               "stays in one")
    if tp > 1 and shape.experts and not shape.expert_tp_plan:
        yield (
            f"parallel.tp > 1 with {shape.kind}'s mixture-of-experts blocks is not supported (raymp's "
            "tensor-parallel plan for expert blocks is the built-in model's); set parallel.tp=1 and "
            "spread the model with parallel.pp or parallel.zero"
        )
    elif tp > 1 and not shape.tp_plan:
        yield ("parallel.tp > 1 needs a tensor-parallel plan for a model.factory model: set "
               "model.factory_tp_plan (docs/models.md), or use parallel.tp=1")
    for name, size, paddable in shape.tp_sizes if tp > 1 else ():
        if size % tp:
            yield f"parallel.tp ({tp}) must divide {name} ({size})" + (
                f" in {shape.sizes_in}" * bool(shape.sizes_in)
            ) + (f"; pad it: set model.vocab_size={padded_vocab(size, tp)}" if paddable else "")
    if layout.sequence_parallel and tp == 1:
        yield "parallel.sequence_parallel needs parallel.tp > 1; set one or the other"
    elif layout.sequence_parallel and not shape.sequence_parallel:
        yield (f"parallel.sequence_parallel is not implemented for {shape.kind} (it is for the built-in, "
               "Llama, Qwen2 and Mistral models); it runs tensor parallel without it: set "
               "parallel.sequence_parallel=false")
    elif layout.sequence_parallel and seq_len % tp:
        yield (f"parallel.sequence_parallel splits train.seq_len ({seq_len}) over parallel.tp ({tp}): "
               f"make it a multiple of {tp}")
    if tp > 1 and layout.zero == 1:
        yield ("parallel.zero=1 (ZeroRedundancyOptimizer) does not take tensor-parallel (DTensor) "
               "parameters; use parallel.zero=2 (same memory for optimizer state, plus sharded "
               "gradients) or 0")


def _pipeline_problems(layout: Layout, shape: ModelShape):
    """The rules on pipelines: the schedule, and a stage's layers."""
    if layout.schedule not in SCHEDULES:
        yield f"parallel.schedule {layout.schedule!r} is not one of {', '.join(SCHEDULES)}"
    if layout.virtual_stages is not None and layout.schedule != "interleaved":
        yield (f"parallel.virtual_stages applies to schedule=interleaved only (schedule is "
               f"{layout.schedule!r}); remove it")
    if layout.pp == 1:
        if layout.stage_layers is not None:
            yield "parallel.stage_layers needs parallel.pp > 1; remove it"
        return
    if shape.not_stageable:
        yield shape.not_stageable
    stages = layout.num_stages
    if stages > shape.n_layers:
        yield (f"parallel.pp={layout.pp} with schedule {layout.schedule} makes {stages} pipeline stages but "
               f"{shape.layers_field} is {shape.n_layers}; every stage needs at least one layer: lower "
               f"parallel.pp{' or parallel.virtual_stages' if layout.schedule == 'interleaved' else ''}")
    if layout.stage_layers is not None:
        flat = [i for layers in layout.stage_layers for i in layers]
        if len(layout.stage_layers) != stages or any(not layers for layers in layout.stage_layers):
            yield (f"parallel.stage_layers must list {stages} non-empty stages (pp x stages per rank "
                   f"for {layout.schedule}); got {len(layout.stage_layers)}")
        elif flat != list(range(shape.n_layers)):
            yield (f"parallel.stage_layers must split layers 0..{shape.n_layers - 1} into consecutive "
                   f"runs, in order, each layer once; got {[list(s) for s in layout.stage_layers]}")


def _expert_problems(layout: Layout, shape: ModelShape):
    """The rules on expert parallelism: what ep shards and which layouts it runs with."""
    ep = layout.ep
    if ep == 1:
        return
    if not shape.experts:
        yield (f"parallel.ep ({ep}) shards mixture-of-experts blocks, and {shape.kind} has none: set "
               "parallel.ep=1, or pick an MoE model (model.moe or model.preset tiny-moe)")
        return
    if shape.ep_experts is None:
        yield (f"parallel.ep > 1 is not implemented for {shape.kind}'s experts: set parallel.ep=1 and "
               "spread the model with parallel.pp or parallel.zero")
        return
    if shape.ep_experts % ep:
        yield (f"parallel.ep ({ep}) must divide {shape.experts_field} ({shape.ep_experts}): each ep rank "
               "holds an equal share of every block's experts; change parallel.ep")
    if layout.dp % ep:
        yield (f"parallel.ep ({ep}) must divide parallel.dp ({layout.dp}): expert parallelism shards experts "
               f"over ep of the dp replicas; set parallel.dp to a multiple of {ep}")
    if layout.dp_replicate > 1 and layout.dp % layout.dp_replicate == 0 and layout.dp_shard % ep:
        yield (f"parallel.ep ({ep}) must divide each HSDP group's ranks (parallel.dp / parallel.dp_replicate "
               f"= {layout.dp_shard}): every group holds all the experts; change parallel.ep or "
               "parallel.dp_replicate")


def _context_problems(layout: Layout, shape: ModelShape, seq_len: int):
    """The rules on context parallelism: the model's heads and the sequence split over cp."""
    cp, tp = layout.cp, layout.tp
    if cp == 1:
        return
    if shape.sequence_balance_loss:
        yield ("model.moe.aux_loss_coef > 0 with parallel.cp > 1 is not supported (the sequence-wise balance "
               "loss needs each whole sequence's routing, and cp splits sequences); set parallel.cp=1, or "
               "model.moe.aux_loss_coef=0 (the router bias alone balances the experts)")
        return
    if layout.ep > 1 and layout.dp_replicate > 1:
        yield ("parallel.ep with parallel.cp > 1 under HSDP (parallel.dp_replicate > 1) is not supported; "
               "set parallel.dp_replicate=1, parallel.ep=1 or parallel.cp=1")
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
    """The rules on the global batch: whole micro-batches per replica, as many as the schedule needs."""
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
