"""Expert parallelism, and mixture-of-experts routing statistics across ranks.

Expert parallelism borrows the data-parallel ranks (torchtitan's choice; docs/design.md): ep
consecutive dp replicas split each block's routed experts, each holding n/ep of them as the
local piece of a DTensor sharded along the expert dimension, so checkpoints reshard across ep
degrees like any other sharded tensor. The router, attention and shared experts stay replicated.
Each rank routes its own tokens as before, then an all-to-all sends every routed copy of a token
to the rank holding its expert, the experts run on what they received, and a second all-to-all
brings the results back in the order the block expects (autograd runs both in reverse).

The expert weights' gradients then hold the contributions of every token of the ep group; the
data-parallel engine averages them over the ranks holding the same shard ("expert_data") and
divides by dp, as every other gradient is averaged over dp (raymp.parallel.zero).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from raymp.models.moe import RoutedExperts, expert_matmul, finish_routing, moe_blocks, swiglu_experts
from raymp.parallel.pipeline import mark_weight_views

EXPERT_WEIGHTS = ("w1", "w3", "w2")
STACKED_WEIGHTS = ("gate_up_proj", "down_proj")  # transformers' experts modules


class ExchangeClock:
    """Seconds one block's all-to-alls took on this rank since it was last read (forward and
    backward). Kept where the exchange blocks the host until the data is there (gloo, CPU); on
    CUDA the host sees only NCCL's launch, so nothing is kept there (`timed` False)."""

    def __init__(self, timed: bool):
        self.timed, self.seconds = timed, 0.0

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group, clock: ExchangeClock):
    start = time.perf_counter()
    out = x.new_empty(sum(out_splits), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    if clock.timed:
        clock.seconds += time.perf_counter() - start
    return out


class _Exchange(torch.autograd.Function):
    """all_to_all_single of rows, differentiable (its backward is the reverse exchange of the
    gradients) and timed by the block's clock both ways. torch.distributed.nn's differentiable
    all_to_all_single does the same exchange but cannot say what its backward took."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, clock):
        ctx.splits, ctx.group, ctx.clock = (out_splits, in_splits), group, clock
        return _exchange(x, out_splits, in_splits, group, clock)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group, ctx.clock), None, None, None, None


def _exchange_and_run(x: torch.Tensor, counts: torch.Tensor, shard: "ExpertShard", run_local) -> torch.Tensor:
    """Send this rank's routed rows (sorted by expert, counts[e] each) to the ranks holding their
    experts, run `run_local(rows sorted by local expert, rows per local expert)` on what arrives,
    and bring the outputs back in the order the rows were sent."""
    ep, per_rank = shard.ep, counts.numel() // shard.ep
    # [source rank, local expert]: what every rank sends this rank's experts
    received = _exchange(counts, [per_rank] * ep, [per_rank] * ep, shard.ep_group, shard.clock)
    received = received.view(ep, per_rank)
    sent_splits = counts.view(ep, per_rank).sum(1).tolist()
    received_splits = received.sum(1).tolist()
    tokens = _Exchange.apply(x, received_splits, sent_splits, shard.ep_group, shard.clock)
    # The received rows come by source rank, then by expert: the experts need them by expert.
    expert_of_row = torch.arange(per_rank, device=x.device).repeat(ep).repeat_interleave(received.flatten())
    order = expert_of_row.argsort(stable=True)
    out = run_local_experts(tokens[order], received.sum(0), run_local)
    out = out.new_empty(out.shape).index_copy(0, order, out)  # back to the order they came in
    return _Exchange.apply(out, sent_splits, received_splits, shard.ep_group, shard.clock)


def _local_weights(*weights) -> list[torch.Tensor]:
    local = [w.to_local() for w in weights]
    mark_weight_views(local)
    return local


class ExpertShard(nn.Module):
    """What every expert-parallel experts module has: its ep group, the group's size, and the
    clock of its all-to-alls. The data-parallel engines find the experts by this class."""

    ep_group: dist.ProcessGroup
    ep: int
    clock: ExchangeClock


class ExpertParallelExperts(ExpertShard, RoutedExperts):
    """RoutedExperts whose weights are this rank's share of the experts (DTensors sharded over
    the ep mesh). Takes and returns what RoutedExperts does: the rank's own routed tokens sorted
    by expert, and the experts' outputs in the same order."""

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        weights = _local_weights(self.w1, self.w3, self.w2)
        return _exchange_and_run(x, counts, self, lambda rows, n: swiglu_experts(rows, n, *weights))


class StackedExpertParallel(ExpertShard):
    """transformers' experts module (Mixtral, Qwen2-MoE, Qwen3-MoE: `gate_up_proj` [n, 2·ffn, dim]
    and `down_proj` [n, dim, ffn], called with the hidden states, each token's top-k experts and
    their weights) holding this rank's share of the experts. Its routed rows go through the same
    all-to-alls as the built-in model's; each expert computes what transformers' own forward
    does for it (gate and up from one product, act(gate) * up, down, times the token's weight),
    and each token's outputs are summed in transformers' order (by expert)."""

    num_experts: int
    act_fn: nn.Module

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        chosen = top_k_index.flatten()
        counts = torch.bincount(chosen, minlength=self.num_experts)
        order = chosen.argsort(stable=True)
        token_of = order // top_k_index.shape[-1]
        gate_up, down = (w.transpose(1, 2) for w in _local_weights(self.gate_up_proj, self.down_proj))

        def run_local(rows: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
            gate, up = expert_matmul(rows, gate_up, n).chunk(2, dim=-1)
            return expert_matmul(self.act_fn(gate) * up, down, n)

        routed = _exchange_and_run(hidden_states[token_of], counts, self, run_local)
        routed = routed * top_k_weights.flatten()[order, None].to(routed.dtype)
        return torch.zeros_like(hidden_states).index_add_(0, token_of, routed.to(hidden_states.dtype))


def run_local_experts(rows: torch.Tensor, counts: torch.Tensor, run) -> torch.Tensor:
    """`run(rows, counts)`: this rank's experts on the rows they received. A router can send a
    rank's experts no row at all (one that collapses onto another rank's experts), and the
    grouped GEMM's backward fails on none: one zero row is then added and cut off again, so the
    experts' gradients are zeros (every rank of the expert_data group must hold them for their
    all-reduce), and the empty rows stay in the graph: the all-to-all that brought them must run
    its backward on this rank as on every other of the group, or the group's collectives part
    ways."""
    if rows.shape[0]:
        return run(rows, counts)
    one = counts.clone()
    one[0] = 1
    return run(torch.cat([rows, rows.new_zeros(1, rows.shape[1])]), one)[:0]


# transformers' experts layouts the stacked forward above computes (use_experts_implementation's
# flags): gate and up concatenated, [out, in] weights, no biases.
_STACKED_LAYOUT = {"is_concatenated": True, "is_transposed": False, "has_bias": False, "has_gate": True}


def stacked_experts(model: nn.Module) -> list[nn.Module]:
    """transformers' experts modules in `model` (stacked `gate_up_proj` and `down_proj`). A layout
    StackedExpertParallel does not compute is refused, never run wrong."""
    found = [m for m in model.modules() if isinstance(getattr(m, "gate_up_proj", None), nn.Parameter)
             and getattr(m, "gate_up_proj").ndim == 3]
    for m in found:
        other = {k: getattr(m, k) for k, v in _STACKED_LAYOUT.items() if getattr(m, k, v) != v}
        if other:
            raise ValueError(f"parallel.ep > 1: {type(m).__name__} stores its experts as {other}, which "
                             "raymp's expert parallelism does not compute; set parallel.ep=1")
    return found


def _shard(experts: nn.Module, names: tuple[str, ...], parallel_class: type, ep_mesh) -> None:
    for name in names:
        weight = getattr(experts, name)
        sharded = distribute_tensor(weight.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
        experts.register_parameter(name, nn.Parameter(sharded))
    experts.__class__ = parallel_class  # as fully_shard does: same module, parallel forward
    experts.ep_group, experts.ep = ep_mesh.get_group(), ep_mesh.size()
    experts.clock = ExchangeClock(timed=ep_mesh.device_type == "cpu")


def apply_expert_parallel(model: nn.Module, ep_mesh) -> None:
    """Shard the routed experts of every MoE block of `model` (built on meta, before it is
    allocated) over `ep_mesh`: the built-in model's blocks, or transformers' experts modules.
    Parameter names stay those of the plain model."""
    for block in moe_blocks(model).values():
        _shard(block.experts, EXPERT_WEIGHTS, ExpertParallelExperts, ep_mesh)
    for experts in stacked_experts(model):
        _shard(experts, STACKED_WEIGHTS, StackedExpertParallel, ep_mesh)


def exchange_seconds(shards: list[ExpertShard]) -> float | None:
    """Seconds this rank's expert all-to-alls took since the last call, over every experts module
    it holds (expert_modules); None where they are not timed (no expert parallelism, or CUDA:
    ExchangeClock)."""
    if not shards or not shards[0].clock.timed:
        return None
    return sum(s.clock.take() for s in shards)


def expert_modules(module: nn.Module) -> list[ExpertShard]:
    """The expert-parallel experts of `module`: the data-parallel engines average their gradients
    over "expert_data" (FSDP2 also shards them over it)."""
    return [m for m in module.modules() if isinstance(m, ExpertShard)]


def finish_expert_step(blocks: dict, data_mesh) -> dict:
    """finish_routing with the counts summed over `data_mesh` (every rank that holds a share of
    the batch; under HSDP a 2-D mesh, summed along each dimension in turn)."""
    if not blocks:
        return {}
    replicas = data_mesh.size()

    def sum_over_replicas(t: torch.Tensor) -> None:
        on_device = t.to(data_mesh.device_type)  # NCCL reduces device tensors only
        for dim in range(data_mesh.ndim):
            dist.all_reduce(on_device, group=data_mesh.get_group(dim))
        t.copy_(on_device)

    return finish_routing(blocks, sum_over_replicas if replicas > 1 else None, replicas)
