"""The planner's step-time model and the hardware it prices: FLOPs over the achievable device
FLOP/s, stretched by the pipeline bubble, plus each parallelism's communication (TP all-reduces,
CP all-to-alls, pipeline activation sends, DDP's reduction, FSDP's gathers and reduce-scatters,
HSDP's all-reduce across replicas), each priced by bytes over bandwidth plus a per-message
latency. Simple on purpose: it ranks layouts for `parallel: auto`; BENCHMARKS.md (section 9)
compares it with measured step times.

Where the bytes-over-bandwidth price is off for some hardware (on CPU actors, DTensor's per-op
dispatch and gloo running on the compute cores cost TP several times its bytes), each mechanism's
price is scaled by a cost factor measured there (`calibrate_cost_factors`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from raymp.layout import Layout

GB = 1e9


# -- the cluster and the layout ---------------------------------------------------------------


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    gpu_memory_gb: float = 80.0
    gpu_tflops: float = 989.0  # dense bf16 peak (H100 SXM)
    intra_node_gbps: float = 450.0  # GB/s per GPU inside a node (NVLink)
    inter_node_gbps: float = 50.0  # GB/s per GPU across nodes (400 Gb/s InfiniBand)
    usable_fraction: float = 0.9  # leave room for the allocator, CUDA context, fragmentation
    achievable_mfu: float = 0.5  # fraction of peak a good kernel mix reaches
    # Start-up cost of one collective or point-to-point message, whatever its size (NCCL's
    # small-message latency is ~10-30 us inside a node): what makes many small messages (deep
    # pipelines and wide TP for a small model) slower than their bytes say.
    message_latency_s: float = 20e-6
    # Measured cost of each mechanism's communication over its price here (1: as priced), by
    # COST_TERMS key; calibrate_cost_factors measures them.
    cost_factors: dict = field(default_factory=dict)

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


def cluster_from_config(c) -> Cluster:
    return Cluster(c.nodes, c.gpus_per_node, c.gpu_memory_gb, c.gpu_tflops, c.intra_node_gbps,
                   c.inter_node_gbps, cost_factors=dict(c.cost_factors))


# What each cost factor scales: the communication term of one mechanism. TP's term is "sp" when
# sequence parallelism replaces its all-reduces; data parallelism's is "ddp" at ZeRO 0/1, "fsdp" at 2/3.
COST_TERMS = {"ddp": "dp_comm_s", "fsdp": "dp_comm_s", "tp": "tp_comm_s", "sp": "tp_comm_s",
              "cp": "cp_comm_s", "pp": "pp_comm_s", "ep": "ep_comm_s"}


def cost_terms(layout: Layout) -> list[str]:
    """The COST_TERMS keys a layout pays for."""
    keys = []
    if layout.data_parallel_size > 1:
        keys.append("fsdp" if layout.fsdp else "ddp")
    if layout.tp > 1:
        keys.append("sp" if layout.sequence_parallel else "tp")
    keys += [k for k, n in (("cp", layout.cp), ("pp", layout.pp), ("ep", layout.ep)) if n > 1]
    return keys


# -- step time -----------------------------------------------------------------------------------


def step_flops(args, global_batch: int, seq_len: int) -> float:
    """Model FLOPs of one optimizer step (forward + backward, no recomputation): 6·Ψ per token
    for the weights a token runs through (an MoE model's active parameters, not all its experts),
    plus attention's 12·layers·dim·seq_len per token. The numerator of MFU."""
    tokens = global_batch * seq_len
    return 6 * args.active_params * tokens + 12 * args.n_layers * args.dim * seq_len * tokens


def _tp_whole_flops(args, tokens: int) -> float:
    """FLOPs of a step's MoE feed-forwards (6 per active parameter per token), which every tp rank
    runs whole (raymp.models.llama_tp): done tp times over, not split."""
    return 6 * tokens * sum(args.tp_whole_params(i, active=True) for i in range(args.n_layers))


def step_seconds(args, layout: Layout, cluster: Cluster, global_batch: int, seq_len: int,
                 bf16: bool = True) -> dict:
    """Compute (6·Ψ·tokens + attention, MoE feed-forwards once more per extra tp rank, x4/3 with
    recomputation) spread over every device at the achievable MFU, stretched by the pipeline
    bubble, plus exposed TP all-reduces (inside a node), context parallelism's all-to-alls,
    expert parallelism's (each routed copy of a token to its expert's rank and back, in forward
    and backward), the pipeline's activation sends between stages, and data parallelism over
    dp x cp (across nodes when it spans them): the gradient reduction (DDP: once per step; FSDP:
    a reduce-scatter per micro-batch) and FSDP's parameter gathers (ZeRO-2: once per step;
    ZeRO-3: forward and backward of every micro-batch). Activations travel in the compute dtype
    (`bf16`), gradients in fp32."""
    from raymp.parallel.pipeline import theoretical_bubble

    tokens = global_batch * seq_len
    flops = step_flops(args, global_batch, seq_len) + (layout.tp - 1) * _tp_whole_flops(args, tokens)
    if layout.activation_checkpointing:
        flops *= 4 / 3
    compute = flops / (layout.world_size * cluster.gpu_tflops * 1e12 * cluster.achievable_mfu)
    micro = layout.micro_batches(global_batch)
    bubble = (
        theoretical_bubble(layout.schedule, layout.pp, micro, layout.stages_per_rank)
        if layout.pp > 1
        else 0.0
    )
    compute /= 1 - (bubble or 0.0)
    tp_time = 0.0
    local_seq = seq_len / layout.cp
    act = 2 if bf16 else 4  # bytes per activation value
    if layout.tp > 1:  # 4 all-reduces of a micro-batch's hidden states per block (2 fwd, 2 bwd)
        volume = 4 * args.n_layers / layout.pp * layout.micro_batch_size * local_seq * args.dim * act
        tp_time = micro * volume * 2 * (layout.tp - 1) / layout.tp / (cluster.intra_node_gbps * GB)
        tp_time += micro * 4 * args.n_layers / layout.pp * cluster.message_latency_s
    spans_nodes = layout.world_size > cluster.gpus_per_node
    cp_time = 0.0
    if layout.cp > 1:  # per block: q, k, v and the output all-to-all forward, their gradients back
        exchanges = micro * 8 * args.n_layers / layout.pp
        # k, v repeated to every head:
        local = layout.micro_batch_size * local_seq * args.dim / layout.tp * act
        cp_time = exchanges * (local * (layout.cp - 1) / layout.cp / (cluster.intra_node_gbps * GB)
                               + cluster.message_latency_s)
    pp_time = 0.0
    if layout.pp > 1:  # per micro-batch and stage chunk: activations forward, their gradient back
        hidden = (
            layout.micro_batch_size
            * local_seq
            * args.dim
            * act
            / (layout.tp if layout.sequence_parallel else 1)
        )
        bw = (cluster.inter_node_gbps if spans_nodes else cluster.intra_node_gbps) * GB  # pp is outermost
        pp_time = micro * layout.stages_per_rank * 2 * (hidden / bw + cluster.message_latency_s)
    dp_time = 0.0
    if layout.data_parallel_size > 1:
        dp_time = _data_parallel_seconds(args, layout, cluster, micro, act, spans_nodes)
    ep_time = 0.0
    if layout.ep > 1:  # per MoE block: dispatch and combine all-to-all forward, both again in backward
        blocks = sum(args.routed_expert_params(i) > 0 for i in range(args.n_layers)) / layout.pp
        rows = layout.micro_batch_size * local_seq * args.moe.top_k  # routed copies a rank sends
        group_ranks = layout.ep * layout.world_size // layout.dp  # ep replicas of the other dimensions
        spans = group_ranks > cluster.gpus_per_node
        bw = (cluster.inter_node_gbps if spans else cluster.intra_node_gbps) * GB
        ep_time = micro * 4 * blocks * (rows * args.dim * act * (layout.ep - 1) / layout.ep / bw
                                         + cluster.message_latency_s)
    comm = {"tp_comm_s": tp_time, "cp_comm_s": cp_time, "pp_comm_s": pp_time, "dp_comm_s": dp_time,
            "ep_comm_s": ep_time}
    for key in cost_terms(layout):
        comm[COST_TERMS[key]] *= cluster.cost_factors.get(key, 1.0)
    total = compute + sum(comm.values())
    return {"step_s": total, "compute_s": compute, **comm, "bubble": bubble or 0.0,
            "tokens_per_s": tokens / total}


def _data_parallel_seconds(
    args, layout: Layout, cluster: Cluster, micro: int, act: int, spans_nodes: bool
) -> float:
    """DDP: one all-reduce of fp32 gradients per step (bucketed). FSDP: a reduce-scatter of them
    per micro-batch, and parameter all-gathers (ZeRO-2 once per step, ZeRO-3 in forward and
    backward of every micro-batch), inside the shard group; under HSDP the sharded gradients are
    then all-reduced across the replicas. Half is taken as hidden behind compute."""
    # this rank's stage of the model, whole but for its 1/ep of the routed experts
    experts = sum(args.routed_expert_params(i) for i in range(args.n_layers)) * (1 - 1 / layout.ep)
    values = (args.num_params - experts) / (layout.pp * layout.tp)
    ranks, shards = layout.data_parallel_size, layout.zero_shards
    bw = (cluster.inter_node_gbps if spans_nodes else cluster.intra_node_gbps) * GB
    blocks = args.n_layers / layout.pp
    if not layout.fsdp:
        return 2 * values * 4 * (ranks - 1) / ranks / bw * 0.5 + cluster.message_latency_s
    shard_bw = bw
    if layout.dp_replicate > 1 and shards * layout.pp * layout.tp <= cluster.gpus_per_node:
        shard_bw = cluster.intra_node_gbps * GB  # a shard group's ranks are consecutive: one node
    gathers = 2 * micro if layout.zero == 3 else 1
    share = (shards - 1) / shards
    seconds = (micro * values * 4 * share + gathers * values * act * share) / shard_bw * 0.5
    seconds += blocks * (micro + gathers) * cluster.message_latency_s
    if layout.dp_replicate > 1:
        rep = layout.dp_replicate
        seconds += micro * (
            2 * values / shards * 4 * (rep - 1) / rep / bw * 0.5 + blocks * cluster.message_latency_s
        )
    return seconds


def calibrate_cost_factors(samples) -> dict[str, float]:
    """Cost factors from measured steps: `samples` is (layout, step_seconds' estimate with no
    factors, measured seconds) per layout. A factor is first taken from the layouts that use its
    mechanism alone (measured time less the estimated compute, over the mechanism's price; the
    mean where several do), then from those whose other mechanisms already have one (cp2 also
    reduces gradients over dp x cp), so one mechanism's error is not charged to another. A
    factor is never below 0 (a mechanism that costs nothing)."""
    factors: dict[str, float] = {}
    while True:
        ratios: dict[str, list[float]] = {}
        for layout, est, measured in samples:
            unknown = [k for k in cost_terms(layout) if k not in factors]
            if len(unknown) != 1 or est[COST_TERMS[unknown[0]]] <= 0:
                continue
            known = sum(factors[k] * est[COST_TERMS[k]] for k in cost_terms(layout) if k in factors)
            rest = measured - est["compute_s"] - known
            ratios.setdefault(unknown[0], []).append(rest / est[COST_TERMS[unknown[0]]])
        if not ratios:
            return factors
        factors.update({k: max(0.0, sum(v) / len(v)) for k, v in ratios.items()})
