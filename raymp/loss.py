"""Next-token cross-entropy, computed in fp32 whatever the compute dtype, without ever holding
the whole micro-batch's logits in fp32.

A Llama-class vocabulary (128,256 entries) makes the logits the largest activation of the step:
`F.cross_entropy(logits.float())` writes an fp32 copy of them, its log-softmax another, and its
backward two more (at 4 x 2,048 tokens: 4.2 GB each, ~40 GB of memory traffic per micro-batch,
about a tenth of a 1B model's step on an H100). Here the eager loss is F.cross_entropy on fp32
copies of a block of tokens at a time, forward and again backward (the same gradient bits as the
whole, with fp32 for one block only). On CUDA with compilation on, the loss is two fused kernels
over the whole micro-batch (torch.compile of the two small functions below: a log-sum-exp per
token, then the gradient), which read the logits twice, write their gradient in the logits' dtype
once and write no fp32 copy at all; it keeps one fp32 number per token for backward.
Liger-kernel's fused linear cross-entropy also folds the output projection in; raymp's output
layer is sharded and hooked by its parallel wrappers (TP, FSDP), which a loss that takes the
weight itself would bypass, so the projection stays a module and only the loss is fused.

Under tensor parallelism the logits are a vocabulary-sharded DTensor and torch's loss_parallel
computes the loss (raymp.parallel.tensor); that path keeps F.cross_entropy.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

# fp32 values one block of the eager loss may hold (64 Mi: 256 MiB), so 523 tokens at a time
# for a 128k vocabulary and the whole micro-batch for small ones.
BLOCK_ELEMENTS = 1 << 26


def _log_sum_exp(logits: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(logits.float(), dim=-1)


def _logits_gradient(
    logits: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """(softmax - one_hot(labels)) * scale, in the logits' dtype: pointwise, so compiled it is
    one kernel that reads the logits and writes the gradient."""
    probs = torch.exp(logits.float() - lse.unsqueeze(-1))
    hit = torch.arange(logits.shape[-1], device=logits.device) == labels.unsqueeze(-1)
    return ((probs - hit.float()) * scale).to(logits.dtype)


_fused_kernels: tuple | None = None


def _fused() -> tuple:
    global _fused_kernels
    if _fused_kernels is None:  # compiled once per process, on first use
        _fused_kernels = (
            torch.compile(_log_sum_exp, dynamic=True),
            torch.compile(_logits_gradient, dynamic=True),
        )
    return _fused_kernels


class _FusedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of [tokens, vocab] logits in two compiled kernels; saves the logits
    (already held by the caller) and one fp32 log-sum-exp per token for backward."""

    @staticmethod
    def forward(ctx, logits, labels):
        lse_of, _ = _fused()
        lse = lse_of(logits)
        target = logits.gather(1, labels.unsqueeze(1)).squeeze(1).float()
        ctx.save_for_backward(logits, labels, lse)
        return (lse - target).mean()

    @staticmethod
    def backward(ctx, grad_loss):
        logits, labels, lse = ctx.saved_tensors
        _, gradient_of = _fused()
        return gradient_of(logits, lse, labels, (grad_loss / logits.shape[0]).float()), None


class _BlockwiseCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of [tokens, vocab] logits, F.cross_entropy on fp32 copies of a block of
    tokens at a time, in the forward and again in the backward: the same arithmetic, so the same
    gradient bits, as F.cross_entropy(logits.float()) (layouts are compared with the one-process
    run to the last bits of Adam's updates), with fp32 only for one block. Saves the logits."""

    @staticmethod
    def forward(ctx, logits, labels):
        rows = max(1, BLOCK_ELEMENTS // logits.shape[-1])
        if rows >= logits.shape[0]:
            loss = F.cross_entropy(logits.float(), labels)
        else:
            loss = sum(F.cross_entropy(block.float(), target, reduction="sum")
                       for block, target in zip(logits.split(rows), labels.split(rows))) / logits.shape[0]
        ctx.save_for_backward(logits, labels)
        ctx.rows = rows
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, labels = ctx.saved_tensors
        scale = grad_loss / logits.shape[0]
        blocks = range(0, logits.shape[0], ctx.rows)
        grad = torch.empty_like(logits) if len(blocks) > 1 else None  # one block: its gradient, uncopied
        for start in blocks:
            block = logits[start:start + ctx.rows].detach().float().requires_grad_()
            with torch.enable_grad():
                loss = F.cross_entropy(block, labels[start:start + ctx.rows], reduction="sum")
            (block_grad,) = torch.autograd.grad(loss, block, scale)
            if grad is None:
                return block_grad.to(logits.dtype), None
            grad[start:start + ctx.rows] = block_grad
        return grad, None


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """Mean over every token of the micro-batch (all samples are full-length: no padding).
    `fused`: two compiled kernels over the micro-batch (`loss_function` decides)."""
    if isinstance(logits, DTensor):  # vocabulary-sharded under loss_parallel
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
    with torch.autocast(logits.device.type, enabled=False):
        function = _FusedCrossEntropy if fused else _BlockwiseCrossEntropy
        return function.apply(logits.flatten(0, 1), labels.flatten())


def loss_function(compiled: bool, device_type: str):
    """The loss a rank uses: its blocks fused by torch.compile where the blocks are compiled and
    the device is a GPU (where the loss is bound by memory traffic; on CPU the eager blocks are
    as fast and compiling them costs seconds per run)."""
    return partial(lm_loss, fused=compiled and device_type == "cuda")
