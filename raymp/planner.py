"""Planner: how much memory a layout needs per rank, how fast it should run, and which layouts fit.

Two memory models live here:
- `zero_model_states`: the ZeRO paper's per-rank formulas (16Ψ; 4Ψ+12Ψ/N; 2Ψ+14Ψ/N; 16Ψ/N with
  mixed-precision Adam), a reference point for readers and for the seed's 7B example.
- `estimate`: what raymp itself allocates for a (model, layout): the stage's share of parameters
  after pipeline and tensor sharding, ZeRO as raymp implements it (FSDP2 keeps a full working copy
  under ZeRO-2), activations per schedule, and communication buffers. This is the number checked
  against measured runs.

How fast a layout should run is raymp.step_time's (the hardware description, `Cluster`, lives
there too); the search here ranks the layouts that fit by it.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from raymp import layout_rules
from raymp.layout import Layout, runs_on_fsdp, runs_under_autocast
from raymp.layout_rules import ModelShape
from raymp.step_time import GB, Cluster, step_seconds


# -- the ZeRO paper ---------------------------------------------------------------------------


def zero_model_states(psi: float, stage: int, n: int, param_bytes: int = 2, grad_bytes: int = 2,
                      optimizer_bytes: int = 12) -> dict[str, float]:
    """Per-rank bytes of parameters, gradients and optimizer state for Ψ parameters over N
    data-parallel ranks (ZeRO paper, section 5). Defaults: mixed-precision Adam (fp16 params and
    grads, K=12 bytes of fp32 master weights + momentum + variance). For fp32 Adam pass 4, 4, 8."""
    p, g, o = psi * param_bytes, psi * grad_bytes, psi * optimizer_bytes
    if stage >= 1:
        o /= n
    if stage >= 2:
        g /= n
    if stage >= 3:
        p /= n
    return {"params": p, "grads": g, "optimizer": o, "total": p + g + o}


# -- model arithmetic ---------------------------------------------------------------------------


def stage_params(args, layers: list[int], first: bool, last: bool, tp: int, ep: int = 1) -> float:
    """Parameters one rank holds for a stage: routed experts divided by ep, the rest of an MoE
    feed-forward whole, the other linears divided by tp."""
    total = 0.0
    for layer in layers:
        linear, replicated = args.layer_params(layer)
        whole, experts = args.tp_whole_params(layer), args.routed_expert_params(layer)
        total += (linear - whole) / tp + (whole - experts) + experts / ep + replicated
    vocab = args.vocab_size * args.dim / tp
    if first:
        total += vocab
    if last:
        total += args.dim + (0 if (first and args.tie_embeddings) else vocab)
    return total


def activation_elements_per_token(args, tp: int, sequence_parallel: bool,
                                  layer: int | None = None, ep: int = 1) -> tuple[float, float, float]:
    """(elements of attention and the MLP, elements of the norms and the residual stream, elements
    of a block's input) that autograd keeps per token per block. Counted from what this model's
    block saves for backward (ActivationMeter on blocks of several shapes): 10·dim + 4·ffn_dim +
    n_heads + 2 per token, of which 6·dim + 2 belong to the two norms and the residual stream (not
    split by TP, split by SP) and the rest to attention and the MLP (split by TP). An MoE block's
    MLP keeps MoEArgs.saved_elements_per_token (at expert-parallel degree `ep`) in place of
    4·ffn_dim, not split by TP (every tp rank runs it whole). `layer`: that block's (None: the
    mean block)."""
    norms = 6 * args.dim + 2
    layers = range(args.n_layers) if layer is None else [layer]
    moe = [args.moe is not None and args.moe.is_moe_layer(i) for i in layers]
    dense_mlp = sum(0 if m else 4 * args.ffn_dim for m in moe) / len(moe)
    moe_mlp = sum(args.moe.saved_elements_per_token(args.dim, ep) if m else 0 for m in moe) / len(moe)
    inner = (4 * args.dim + dense_mlp + args.n_heads) / tp + moe_mlp
    stream = norms / tp + 2 * args.dim if sequence_parallel else norms
    return inner, stream, args.dim / (tp if sequence_parallel else 1)


def in_flight(schedule: str, pp: int, stage: int, micro_batches: int) -> int:
    """Micro-batches whose activations a stage holds at its peak."""
    if pp == 1:
        return 1  # gradient accumulation: one micro-batch's graph at a time
    if schedule == "gpipe":
        return micro_batches
    return min(micro_batches, pp - stage)  # 1F1B warm-up depth (an estimate for the others)


@functools.lru_cache(maxsize=256)
def _balanced(args, stages: int) -> list[list[int]]:
    from raymp.parallel.pipeline import balance_stages

    return balance_stages(args, stages)


# -- the estimate ---------------------------------------------------------------------------------


@dataclass
class RankEstimate:
    stage: int
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    buffer_bytes: float

    @property
    def model_state_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes

    @property
    def measured_part_bytes(self) -> float:
        """Model state + saved activations, without transient buffers: the part a rank's step
        measures (RankReport.measured_bytes)."""
        return self.model_state_bytes + self.activation_bytes

    @property
    def total_bytes(self) -> float:
        return self.model_state_bytes + self.activation_bytes + self.buffer_bytes


def peer_copy_bytes(estimate: RankEstimate) -> float:
    """Host memory (Ray's object store) elastic.peer_copy_every costs per rank: its part of the
    state (parameters and optimizer state) on its node and a peer's part there too, each twice
    while a newer copy is taken (the older one is dropped once the newer is whole)."""
    return 4 * (estimate.params_bytes + estimate.optimizer_bytes)


def _model_state(psi: float, zero: int, dp: int, bf16: bool) -> tuple[float, float, float, float]:
    """raymp's own ZeRO per rank (fp32 master weights and AdamW state throughout):
    (params, grads, optimizer, full working copy that FSDP2 holds through the step under ZeRO-2)."""
    if zero == 0:
        return 4 * psi, 4 * psi, 8 * psi, 0.0
    if zero == 1:
        return 4 * psi, 4 * psi, 8 * psi / dp, 0.0
    working = (2 if bf16 else 4) * psi if zero == 2 else 0.0
    return 4 * psi / dp, 4 * psi / dp, 8 * psi / dp, working


def estimate(args, layout: Layout, global_batch: int, seq_len: int, bf16: bool,
             stage_layers: list[list[int]] | None = None) -> list[RankEstimate]:
    """Per-rank memory of every pipeline stage (one entry per pp rank; the dp/tp ranks of a
    stage are alike). `activation_bytes` is what autograd keeps from forward for backward (what
    raymp's ActivationMeter measures); transient memory (ZeRO-3 gathers, ZeRO-2's working copy
    when a pipeline drops it after backward, the block being recomputed under activation
    checkpointing) is in `buffer_bytes`."""
    from raymp.parallel.pipeline import local_stages

    pp, tp = layout.pp, layout.tp
    stage_layers = stage_layers or ([list(s) for s in layout.stage_layers] if layout.stage_layers else None)
    layers = stage_layers or (_balanced(args, layout.num_stages) if pp > 1 else [list(range(args.n_layers))])
    micro = layout.micro_batches(global_batch)
    act_bytes = 2 if bf16 else 4
    # Under autocast the matmuls save bf16, but the norms and the residual stream stay fp32, and
    # each matmul saves a bf16 copy of its weight (per micro-batch graph).
    autocast = runs_under_autocast(layout.zero, bf16)
    stream_bytes = 4 if autocast else act_bytes
    tokens = layout.micro_batch_size * seq_len / layout.cp  # a cp rank holds its slice of every sequence

    def per_block(layer: int | None = None) -> float:  # bytes per token
        inner, stream, _ = activation_elements_per_token(args, tp, layout.sequence_parallel, layer, layout.ep)
        return inner * act_bytes + stream * stream_bytes

    def block_copy(layer: int) -> float:  # a block's matrices in bf16 (under autocast)
        return 2 * stage_params(args, [layer], False, False, tp, layout.ep) if autocast else 0.0

    block_input = activation_elements_per_token(args, tp, layout.sequence_parallel)[2]
    largest = max(range(args.n_layers), key=lambda i: args.layer_params(i)[0])
    out = []
    for rank in range(pp):
        mine = local_stages(rank, pp, len(layers), layout.schedule) if pp > 1 else [0]
        first, last = 0 in mine, len(layers) - 1 in mine
        psi = sum(stage_params(args, layers[s], s == 0, s == len(layers) - 1, tp, layout.ep) for s in mine)
        # ZeRO shards a rank's share of the routed experts over the ranks holding the same ones,
        # except ZeRO-1 under ep, whose experts keep a plain AdamW (raymp.parallel.zero)
        experts = sum(args.routed_expert_params(layer) for s in mine for layer in layers[s]) / layout.ep
        experts_zero = 0 if layout.zero == 1 and layout.ep > 1 else layout.zero
        p, g, o, working = (dense + routed for dense, routed in zip(
            _model_state(psi - experts, layout.zero, layout.zero_shards, bf16),
            _model_state(experts, experts_zero, layout.zero_shards // layout.ep, bf16)))
        held = [layer for s in mine for layer in layers[s]]
        n_blocks = len(held)
        per_mb = (n_blocks * block_input * stream_bytes if layout.activation_checkpointing
                  else sum(per_block(layer) for layer in held))
        if first:
            per_mb += 8  # token ids
        if last:  # final norm, then log-softmax over this rank's vocabulary shard in fp32
            per_mb += (3 * args.dim + 1) * stream_bytes + args.vocab_size / tp * 4
        # Checkpointed blocks keep no copies (they are made again in the recompute).
        weight_copies = (
            0 if layout.activation_checkpointing else sum(block_copy(layer) for layer in held)
        ) + (2 * args.vocab_size * args.dim / tp if autocast and last else 0)
        activations = in_flight(layout.schedule, pp, rank, micro) * (per_mb * tokens + weight_copies)
        buffers = 0.0
        if layout.zero == 3:  # one block gathered, one prefetched
            buffers += 2 * stage_params(args, [largest], False, False, tp, layout.ep) * (2 if bf16 else 4)
        if layout.zero == 2 and pp > 1:  # the pipeline reshards after backward: transient
            buffers += working
        else:
            p += working
        if layout.activation_checkpointing:  # the one block being recomputed in backward
            buffers += per_block(largest) * tokens + block_copy(largest)
        out.append(RankEstimate(rank, p, g, o, activations, buffers))
    return out


# -- search -------------------------------------------------------------------------------------


@dataclass
class Candidate:
    layout: Layout
    ranks: list[RankEstimate]
    time: dict
    fits: bool
    reason: str = ""

    @property
    def peak_bytes(self) -> float:
        return max(r.total_bytes for r in self.ranks)


@dataclass
class Plan:
    candidates: list[Candidate] = field(default_factory=list)

    @property
    def feasible(self) -> list[Candidate]:
        """The layouts that fit, fastest first; among equally fast ones the larger micro-batch first:
        the time model prices FLOPs and bytes, not kernel efficiency, and a larger micro-batch
        gives larger matmuls and fewer launches (on a GPU, the difference between mbs 1 and 4)."""
        return sorted((c for c in self.candidates if c.fits),
                      key=lambda c: (-c.time["tokens_per_s"], -c.layout.micro_batch_size))

    @property
    def best(self) -> Candidate | None:
        feasible = self.feasible
        return feasible[0] if feasible else None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_problem(args, layout: Layout, global_batch: int, seq_len: int, cluster: Cluster,
                   shape: ModelShape | None = None) -> str:
    """Why a layout cannot run at all (before memory), or '': the layout's own rules
    (raymp.layout_rules), for `shape` (default: the built-in model of `args`' shape)."""
    problems = layout_rules.problems(
        layout, shape or ModelShape.of_args(args), global_batch, seq_len, cluster.gpus_per_node
    )
    return problems[0] if problems else ""


def proposals(cluster: Cluster, shape: ModelShape, seq_len: int, micro_batch_sizes=(1, 2, 4)):
    """The layouts worth judging on `cluster`: no no-ops (ZeRO at dp=1 changes nothing), and
    sequence parallelism wherever the model and sequence length allow it with tp > 1; context
    parallelism over ranks the data dimension would otherwise take (what makes a long sequence
    fit); on several nodes, FSDP also as HSDP (a replica per node); for MoE models, experts
    sharded over ep of the dp replicas. The layout rules drop what cannot run (a cp the sequence
    or the model does not divide by, an ep the experts do not divide into)."""
    world = cluster.world
    for tp in _divisors(cluster.gpus_per_node):
        sp = tp > 1 and shape.sequence_parallel and seq_len % tp == 0
        for pp in _divisors(world // tp):
            for cp in _divisors(world // (tp * pp)):
                dp = world // (tp * pp * cp)
                for zero in ((1, 2, 3) if dp * cp > 1 else (0,)):
                    hsdp = (
                        runs_on_fsdp(zero)
                        and cluster.nodes > 1
                        and dp % cluster.nodes == 0
                        and dp > cluster.nodes
                    )
                    for replicate, ep in _data_splits(cluster, shape, dp, hsdp):
                        for mbs in micro_batch_sizes:
                            for ac in (False, True):
                                yield Layout(
                                    dp,
                                    pp,
                                    tp,
                                    zero,
                                    mbs,
                                    ac,
                                    sequence_parallel=sp,
                                    dp_replicate=replicate,
                                    cp=cp,
                                    ep=ep,
                                )


def _data_splits(cluster: Cluster, shape: ModelShape, dp: int, hsdp: bool):
    """(dp_replicate, ep) pairs to try for `dp` replicas: HSDP's replica per node where it applies,
    and for a model whose experts expert parallelism can shard, every ep that divides dp."""
    yield 1, 1
    if hsdp:
        yield cluster.nodes, 1
    for ep in _divisors(dp)[1:] if shape.ep_experts else ():
        yield 1, ep


def usable_bytes(cluster: Cluster) -> float:
    """A device's memory a layout may fill (the rest: allocator, CUDA context, fragmentation)."""
    return cluster.gpu_memory_gb * GB * cluster.usable_fraction


def judge(args, layout: Layout, cluster: Cluster, global_batch: int, seq_len: int, bf16: bool) -> Candidate:
    """One layout estimated: its ranks' memory, its step time, and whether it fits (why not)."""
    ranks = estimate(args, layout, global_batch, seq_len, bf16)
    peak, limit = max(r.total_bytes for r in ranks), usable_bytes(cluster)
    fits = peak <= limit
    reason = "" if fits else f"needs {peak / GB:.1f} GB per GPU > {limit / GB:.1f} GB usable"
    return Candidate(
        layout, ranks, step_seconds(args, layout, cluster, global_batch, seq_len, bf16), fits, reason
    )


def plan(args, cluster: Cluster, global_batch: int, seq_len: int, bf16: bool = True,
         micro_batch_sizes=(1, 2, 4), shape: ModelShape | None = None) -> Plan:
    """Every layout of the cluster's devices that runs (by the layout rules), estimated;
    feasible ones ranked by throughput."""
    shape = shape or ModelShape.of_args(args)
    result = Plan()
    for layout in proposals(cluster, shape, seq_len, micro_batch_sizes):
        if not layout_problem(args, layout, global_batch, seq_len, cluster, shape):
            result.candidates.append(judge(args, layout, cluster, global_batch, seq_len, bf16))
    return result


def breakdown(c: Candidate) -> str:
    worst = max(c.ranks, key=lambda r: r.total_bytes)
    return (f"params {worst.params_bytes / GB:.1f} + grads {worst.grads_bytes / GB:.1f} + optimizer "
            f"{worst.optimizer_bytes / GB:.1f} + activations {worst.activation_bytes / GB:.1f} + buffers "
            f"{worst.buffer_bytes / GB:.1f} = {worst.total_bytes / GB:.1f} GB (pp rank {worst.stage})")


def format_plan(p: Plan, top: int = 5) -> str:
    lines = []
    feasible = p.feasible
    if feasible:
        lines.append(f"{len(feasible)} of {len(p.candidates)} layouts fit. Best first:")
        for c in feasible[:top]:
            t = c.time
            lines.append(f"  {c.layout.text(detail=True):<40} ~{t['tokens_per_s']:,.0f} tokens/s, step "
                         f"{t['step_s']:.2f}s (bubble {t['bubble']:.0%}); {breakdown(c)}")
    else:
        lines.append(f"none of {len(p.candidates)} layouts fit.")
    misses = sorted((c for c in p.candidates if not c.fits), key=lambda c: c.peak_bytes)
    if misses:
        lines.append("Closest that do not fit:")
        for c in misses[:3]:
            lines.append(f"  {c.layout.text(detail=True):<40} {c.reason}; {breakdown(c)}")
    return "\n".join(lines)


def explain(args, layout: Layout, cluster: Cluster, global_batch: int, seq_len: int, bf16: bool,
            result: Plan | None = None, shape: ModelShape | None = None,
            label: str = "Compared layout") -> str:
    """One layout, judged: can it run, does it fit (and what would make it fit), and how it
    compares with the plan's best. `label` says whose layout it is (a config's own, or --compare's)."""
    problem = layout_problem(args, layout, global_batch, seq_len, cluster, shape)
    if problem:
        return f"{label} {layout.text(detail=True)}: cannot run: {problem}."
    limit = usable_bytes(cluster)
    c = judge(args, layout, cluster, global_batch, seq_len, bf16)
    verdict = "fits" if c.fits else "does NOT fit"
    lines = [f"{label} {layout.text(detail=True)}: {verdict} in {limit / GB:.1f} GB usable per GPU; "
             f"{breakdown(c)}; ~{c.time['tokens_per_s']:,.0f} tokens/s."]
    if not c.fits:
        fixes = []
        for change in ({"zero": 3}, {"activation_checkpointing": True},
                       {"zero": 3, "activation_checkpointing": True}):
            variant = judge(args, dataclasses.replace(layout, **change), cluster, global_batch, seq_len, bf16)
            if layout_problem(args, variant.layout, global_batch, seq_len, cluster, shape) == "":
                fixes.append(
                    f"{', '.join(f'{k}={v}' for k, v in change.items())}: "
                    f"{variant.peak_bytes / GB:.1f} GB ({'fits' if variant.fits else 'still too big'})"
                )
        lines.append("  With changes: " + "; ".join(fixes) + ".")
    best = (result or plan(args, cluster, global_batch, seq_len, bf16, shape=shape)).best
    if best is not None:
        lines.append(
            f"  The plan's best, {best.layout.text(detail=True)}, needs {best.peak_bytes / GB:.1f} "
            f"GB per GPU at ~{best.time['tokens_per_s']:,.0f} tokens/s."
        )
    return "\n".join(lines)
