"""A mixture-of-experts feed-forward block for the built-in decoder: a token-choice top-k router,
routed SwiGLU experts, optional shared experts, a sequence-wise load-balancing loss and the
auxiliary-loss-free bias of DeepSeek-V3.

Routing is dropless: every token reaches its k experts whatever the load (no capacity factor,
so no token is ever dropped and `dropped_tokens` is always 0). Plain single-device code, like
llama.py; how the routing statistics are summed over ranks is the caller's (raymp.parallel.experts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from raymp.models.args import MoEArgs
from raymp.models.feed_forward import FeedForward
from raymp.models.spec import clean_name
from raymp.torch_compat import recomputing


def uses_grouped_mm(x: torch.Tensor) -> bool:
    """The one rule for how experts multiply: torch's grouped GEMM where this build runs it for
    x's device and dtype (CPU: any float; CUDA: bf16 on compute capability 8.0+), else one
    matmul per expert. Both give the same numbers (tests/unit/test_moe.py)."""
    if not hasattr(F, "grouped_mm"):
        return False
    if x.device.type == "cpu":
        return True
    return (
        x.device.type == "cuda"
        and x.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(x.device)[0] >= 8
    )


def expert_matmul(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x [tokens sorted by expert, in] @ weight[e] [in, out] for each expert's rows."""
    if uses_grouped_mm(x):
        return F.grouped_mm(x, weight.to(x.dtype), offs=counts.cumsum(0).to(torch.int32))
    parts = x.split(counts.tolist())
    return torch.cat([part @ w.to(x.dtype) for part, w in zip(parts, weight)])


class RoutedExperts(nn.Module):
    """n SwiGLU experts as three stacked weights [n, in, out], so they multiply as one grouped
    GEMM and shard along the expert dimension."""

    def __init__(self, n: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n, hidden, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: tokens sorted by expert; counts: tokens per expert."""
        return swiglu_experts(x, counts, self.w1, self.w3, self.w2)


def swiglu_experts(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                   w2: torch.Tensor) -> torch.Tensor:
    """SwiGLU of each expert's rows of x (sorted by expert, counts[e] rows each) with its weights."""
    h = F.silu(expert_matmul(x, w1, counts)) * expert_matmul(x, w3, counts)
    return expert_matmul(h, w2, counts)


class Router(nn.Module):
    """Token-choice top-k. The bias (not learned by gradients) shifts which experts are chosen,
    never the weights they are given (DeepSeek-V3's auxiliary-loss-free balancing)."""

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.gate = nn.Linear(dim, args.n_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(args.n_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [tokens, dim] -> (chosen experts [tokens, k], their weights [tokens, k], all
        scores [tokens, n] in fp32)."""
        logits = self.gate(x).float()
        scores = logits.softmax(-1) if self.args.score == "softmax" else logits.sigmoid()
        chosen = (scores.detach() + self.expert_bias).topk(self.args.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if self.args.normalize_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        return chosen, weights, scores


class _AddAuxGradient(torch.autograd.Function):
    """Returns `out` unchanged and, in backward, starts `aux`'s own gradient (1): the balance loss
    trains the router without travelling to the loss function, so it works on every pipeline
    stage (Megatron-Core's and torchtitan's device for the same problem)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad, torch.ones_like(aux)


class MoEFeedForward(nn.Module):
    """Dropless token-choice MoE. Each training forward adds its routing to `routing`
    (tokens per expert, the balance loss): the statistics the bias update and the metrics read."""

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.router = Router(dim, args)
        self.experts = RoutedExperts(args.n_experts, dim, args.expert_ffn_dim)
        self.shared = (
            FeedForward(dim, args.n_shared_experts * args.expert_ffn_dim) if args.n_shared_experts else None
        )
        # The balance loss's gradient is scaled like the language-model loss it sits beside: the
        # step runner sets it (1/micro-batches where each micro-batch's loss is divided so).
        self.aux_grad_scale = 1.0
        self.routing = RoutingStats()
        # Off where forwards run that are not the step's micro-batches (a pipeline schedule's
        # metadata inference): the caller turns it on around the ones that are.
        self.count_routing = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        flat = x.reshape(-1, d)
        chosen, weights, scores = self.router(flat)
        counts = torch.bincount(chosen.flatten(), minlength=self.args.n_experts)
        order = chosen.flatten().argsort(stable=True)
        token_of = order // self.args.top_k
        routed = self.experts(flat[token_of], counts) * weights.flatten()[order, None].to(flat.dtype)
        out = torch.zeros_like(flat).index_add_(0, token_of, routed)
        if self.shared is not None:
            out = out + self.shared(flat)
        out = out.view(b, s, d)
        if torch.is_grad_enabled():
            aux = (
                self._balance_loss(chosen.view(b, s, -1), scores.view(b, s, -1))
                if self.args.aux_loss_coef > 0
                else torch.zeros((), device=x.device)  # off: nothing to compute
            )
            if self.count_routing and not recomputing():  # activation checkpointing runs the forward again
                self.routing.add(counts, aux)
            if self.args.aux_loss_coef > 0:
                out = _AddAuxGradient.apply(out, aux * self.aux_grad_scale)
        return out

    def _balance_loss(self, chosen: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V3's sequence-wise balance loss, averaged over the micro-batch's sequences:
        per sequence, alpha * sum_i f_i P_i, f_i the share of its k*s choices that went to expert
        i (times n), P_i expert i's mean normalised score. Defined per sequence, so its sum over a
        global batch does not depend on how the batch is split into micro-batches or replicas."""
        n, k = self.args.n_experts, self.args.top_k
        s = chosen.shape[1]
        picks = torch.zeros(chosen.shape[0], n, device=chosen.device).scatter_add_(
            1, chosen.flatten(1), torch.ones(chosen.shape[0], s * k, device=chosen.device))
        f = picks * n / (k * s)
        p = (scores / scores.sum(-1, keepdim=True)).mean(1)
        return self.args.aux_loss_coef * (f * p).sum(-1).mean()


class RoutingStats:
    """What one MoE block routed since the last optimizer step: tokens per expert (summed over
    micro-batches; summed over replicas by the caller before use) and the balance loss per
    forward. A plain attribute, not a buffer: it is no model state and no wrapper may broadcast it."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.counts: torch.Tensor | None = None
        self.aux_losses: list[torch.Tensor] = []

    def add(self, counts: torch.Tensor, aux: torch.Tensor) -> None:
        counts = counts.detach().to(torch.float64)
        self.counts = counts if self.counts is None else self.counts + counts
        self.aux_losses.append(aux.detach())


def moe_blocks(module: nn.Module) -> dict[str, MoEFeedForward]:
    """Every MoE feed-forward block in `module` (a whole model or a stage) by its name in the
    whole model, so pipeline stages' blocks merge without clashes."""
    return {clean_name(name): m for name, m in module.named_modules() if isinstance(m, MoEFeedForward)}


@torch.no_grad()
def finish_routing(blocks: dict[str, MoEFeedForward], sum_over_replicas=None, replicas: int = 1) -> dict:
    """After an optimizer step: sum each block's tokens per expert over the global batch
    (`sum_over_replicas(tensor)` all-reduces in place across the `replicas` ranks that split the
    batch; None in one process), move the router bias towards balance (DeepSeek-V3: +rate for an
    under-loaded expert, -rate for an over-loaded one), and return the step's routing: per block,
    tokens per expert and the balance loss (the global batch's mean)."""
    if not blocks:
        return {}
    parts = list(blocks.values())
    counts = torch.stack([b.routing.counts.cpu() if b.routing.counts is not None
                          else torch.zeros(b.args.n_experts, dtype=torch.float64) for b in parts])
    aux = torch.stack([torch.stack(b.routing.aux_losses).double().mean().cpu() if b.routing.aux_losses
                       else torch.zeros((), dtype=torch.float64) for b in parts])
    if sum_over_replicas is not None:
        sum_over_replicas(counts)
        sum_over_replicas(aux)
    aux /= replicas  # the replicas' means over equally many sequences: the global batch's mean
    mean = counts.mean(-1, keepdim=True)
    for block, load, avg in zip(parts, counts, mean):
        rate = block.args.bias_update_rate
        if rate > 0:
            bias = block.router.expert_bias
            bias += (rate * torch.sign(avg - load)).to(bias.device, bias.dtype)
        block.routing.reset()
    return {name: {"tokens_per_expert": [int(c) for c in load], "aux_loss": float(a)}
            for name, load, a in zip(blocks, counts, aux)}


def reset_routing(blocks: dict[str, MoEFeedForward]) -> None:
    """Forget what was routed since the last optimizer step (a step abandoned half-way, or a
    forward run for inspection only), so the next step counts only its own batch."""
    for block in blocks.values():
        block.routing.reset()


def set_counting(blocks: dict[str, MoEFeedForward], on: bool) -> None:
    """Whether the blocks' forwards count their routing (see MoEFeedForward.count_routing)."""
    for block in blocks.values():
        block.count_routing = on


def set_aux_grad_scale(blocks: dict[str, MoEFeedForward], scale: float) -> None:
    """The factor each micro-batch's language-model loss gets before backward (1/micro-batches
    when each is divided so; 1 where the pipeline schedule scales the gradients after)."""
    for block in blocks.values():
        block.aux_grad_scale = scale


def imbalance(tokens_per_expert: list[int]) -> float:
    """Load imbalance of one block: the busiest expert's tokens over the mean (1.0: balanced)."""
    mean = sum(tokens_per_expert) / len(tokens_per_expert)
    return max(tokens_per_expert) / mean if mean else 1.0
