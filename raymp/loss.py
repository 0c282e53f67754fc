"""Next-token cross-entropy, computed in fp32 whatever the compute dtype, without ever holding
the whole micro-batch's logits in fp32.

A Llama-class vocabulary (128,256 entries) makes the logits the largest activation of the step:
`F.cross_entropy(logits.float())` writes an fp32 copy of them, its log-softmax another, and its
backward two more (at 4 x 2,048 tokens: 4.2 GB each, ~40 GB of memory traffic per micro-batch,
about a tenth of a 1B model's step on an H100). Here the forward keeps one fp32 number per token
(the log-sum-exp) and the backward writes the gradient in the logits' own dtype, a block of
tokens at a time; fp32 exists only for one block. On CUDA with compilation on, the loss is two
fused kernels over the whole micro-batch (torch.compile of the two small functions below: a
log-sum-exp per token, then the gradient), which read the logits twice, write their gradient
once and write no fp32 copy at all. Liger-kernel's fused linear cross-entropy also
folds the output projection in; raymp's output layer is sharded and hooked by its parallel
wrappers (TP, FSDP), which a loss that takes the weight itself would bypass, so the projection
stays a module and only the loss is fused.

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


def _logits_gradient(logits: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(softmax - one_hot(labels)) * scale, in the logits' dtype: pointwise, so compiled it is
    one kernel that reads the logits and writes the gradient."""
    probs = torch.exp(logits.float() - lse.unsqueeze(-1))
    hit = torch.arange(logits.shape[-1], device=logits.device) == labels.unsqueeze(-1)
    return ((probs - hit.float()) * scale).to(logits.dtype)


def _logits_gradient_eager(logits: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The same gradient in fewer eager passes over the block (softmax in one kernel, the rest
    in place)."""
    probs = torch.softmax(logits.float(), dim=-1)
    probs[torch.arange(labels.shape[0], device=labels.device), labels] -= 1.0
    return probs.mul_(scale).to(logits.dtype)


_fused_kernels: tuple | None = None


def _kernels(fused: bool) -> tuple:
    global _fused_kernels
    if not fused:
        return _log_sum_exp, _logits_gradient_eager
    if _fused_kernels is None:  # compiled once per process, on first use
        _fused_kernels = (torch.compile(_log_sum_exp, dynamic=True), torch.compile(_logits_gradient, dynamic=True))
    return _fused_kernels


def _rows_per_block(vocab: int, fused: bool) -> int:
    """Fused kernels write no fp32 block, so they take the whole micro-batch at once."""
    return 1 << 62 if fused else max(1, BLOCK_ELEMENTS // vocab)


class _BlockwiseCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of [tokens, vocab] logits, a block of tokens at a time; saves the
    logits (already held by the caller) and one fp32 log-sum-exp per token for backward."""

    @staticmethod
    def forward(ctx, logits, labels, fused):
        lse_of, _ = _kernels(fused)
        rows = _rows_per_block(logits.shape[-1], fused)
        lse = torch.cat([lse_of(block) for block in logits.split(rows)])
        target = logits.gather(1, labels.unsqueeze(1)).squeeze(1).float()
        ctx.save_for_backward(logits, labels, lse)
        ctx.fused, ctx.rows = fused, rows
        return (lse - target).mean()

    @staticmethod
    def backward(ctx, grad_loss):
        logits, labels, lse = ctx.saved_tensors
        _, gradient_of = _kernels(ctx.fused)
        scale = (grad_loss / logits.shape[0]).float()
        if ctx.rows >= logits.shape[0]:  # one block: its gradient is the whole one, no copy
            return gradient_of(logits, lse, labels, scale), None, None
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.rows):
            end = start + ctx.rows
            grad[start:end] = gradient_of(logits[start:end], lse[start:end], labels[start:end], scale)
        return grad, None, None


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """Mean over every token of the micro-batch (all samples are full-length: no padding).
    `fused`: each block's arithmetic compiled into one kernel (`loss_function` decides)."""
    if isinstance(logits, DTensor):  # vocabulary-sharded under loss_parallel
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
    with torch.autocast(logits.device.type, enabled=False):
        return _BlockwiseCrossEntropy.apply(logits.flatten(0, 1), labels.flatten(), fused)


def loss_function(compiled: bool, device_type: str):
    """The loss a rank uses: its blocks fused by torch.compile where the blocks are compiled and
    the device is a GPU (where the loss is bound by memory traffic; on CPU the eager blocks are
    as fast and compiling them costs seconds per run)."""
    return partial(lm_loss, fused=compiled and device_type == "cuda")
