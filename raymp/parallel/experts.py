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

from raymp.models.moe import RoutedExperts, finish_routing, moe_blocks, swiglu_experts
from raymp.parallel.pipeline import mark_weight_views

EXPERT_WEIGHTS = ("w1", "w3", "w2")


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


class ExpertParallelExperts(RoutedExperts):
    """RoutedExperts whose weights are this rank's share of the experts (DTensors sharded over
    the ep mesh). Takes and returns what RoutedExperts does: the rank's own routed tokens sorted
    by expert, and the experts' outputs in the same order."""

    ep_group: dist.ProcessGroup
    ep: int
    clock: ExchangeClock

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep, per_rank = self.ep, counts.numel() // self.ep
        # [source rank, local expert]: what every rank sends this rank's experts
        received = _exchange(counts, [per_rank] * ep, [per_rank] * ep, self.ep_group, self.clock)
        received = received.view(ep, per_rank)
        sent_splits = counts.view(ep, per_rank).sum(1).tolist()
        received_splits = received.sum(1).tolist()
        tokens = _Exchange.apply(x, received_splits, sent_splits, self.ep_group, self.clock)
        # The received rows come by source rank, then by expert: the experts need them by expert.
        expert_of_row = torch.arange(per_rank, device=x.device).repeat(ep).repeat_interleave(
            received.flatten())
        order = expert_of_row.argsort(stable=True)
        weights = [w.to_local() for w in (self.w1, self.w3, self.w2)]
        mark_weight_views(weights)
        out = run_local_experts(tokens[order], received.sum(0), weights)
        out = out.new_empty(out.shape).index_copy(0, order, out)  # back to the order they came in
        return _Exchange.apply(out, sent_splits, received_splits, self.ep_group, self.clock)


def run_local_experts(rows: torch.Tensor, counts: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """This rank's experts on the rows they received. A router can send a rank's experts no row
    at all (one that collapses onto another rank's experts), and the grouped GEMM's backward
    fails on none: one zero row is then added and cut off again, so the experts' gradients are
    zeros (every rank of the expert_data group must hold them for their all-reduce), and the
    empty rows stay in the graph: the all-to-all that brought them must run its backward on
    this rank as on every other of the group, or the group's collectives part ways."""
    if rows.shape[0]:
        return swiglu_experts(rows, counts, *weights)
    one = counts.clone()
    one[0] = 1
    return swiglu_experts(torch.cat([rows, rows.new_zeros(1, rows.shape[1])]), one, *weights)[:0]


def apply_expert_parallel(model: nn.Module, ep_mesh) -> None:
    """Shard every MoE block's routed experts of `model` (built on meta, before it is allocated)
    over `ep_mesh`. Parameter names stay those of the plain model."""
    for block in moe_blocks(model).values():
        experts = block.experts
        for name in EXPERT_WEIGHTS:
            weight = getattr(experts, name)
            sharded = distribute_tensor(weight.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
            experts.register_parameter(name, nn.Parameter(sharded))
        experts.__class__ = ExpertParallelExperts  # as fully_shard does: same module, parallel forward
        experts.ep_group, experts.ep = ep_mesh.get_group(), ep_mesh.size()
        experts.clock = ExchangeClock(timed=ep_mesh.device_type == "cpu")


def exchange_seconds(blocks: dict) -> float | None:
    """Seconds this rank's expert all-to-alls took since the last call, over every MoE block it
    holds; None where they are not timed (no expert parallelism, or CUDA: ExchangeClock)."""
    clocks = [b.experts.clock for b in blocks.values() if isinstance(b.experts, ExpertParallelExperts)]
    if not clocks or not clocks[0].timed:
        return None
    return sum(c.take() for c in clocks)


def expert_modules(module: nn.Module) -> list[ExpertParallelExperts]:
    """The expert-parallel experts of `module`: the data-parallel engines average their gradients
    over "expert_data" (FSDP2 also shards them over it)."""
    return [m for m in module.modules() if isinstance(m, ExpertParallelExperts)]


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
