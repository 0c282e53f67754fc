"""The blockwise cross-entropy: the same loss and gradient as F.cross_entropy on fp32 logits,
in blocks that never hold the whole micro-batch's logits in fp32, and one rule for fusing it."""

import pytest
import torch
import torch.nn.functional as F

import raymp.loss as loss_module
from raymp.loss import lm_loss, loss_function


def _plain(logits, labels):
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def _case(dtype, vocab=1000, batch=3, seq=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, seq, vocab, generator=g) * 3).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    return logits, labels


def _value_and_grad(fn, logits, labels):
    x = logits.detach().clone().requires_grad_()
    loss = fn(x, labels)
    (loss * 1.7).backward()  # a scaled upstream gradient, as (loss / micro_batches).backward() gives
    return loss.detach(), x.grad


@pytest.mark.parametrize("rows_per_block", [1, 5, 21, 10**6])
def test_blocks_give_the_plain_loss_and_the_same_gradient_bits_in_fp32(monkeypatch, rows_per_block):
    """The gradient bit for bit (parity tests compare layouts with one process to the last bits of
    Adam's updates, and a near-zero gradient's rounding decides an update's sign); the loss value
    to rounding when it is summed block by block."""
    logits, labels = _case(torch.float32)
    monkeypatch.setattr(loss_module, "BLOCK_ELEMENTS", rows_per_block * logits.shape[-1])
    want, want_grad = _value_and_grad(_plain, logits, labels)
    got, got_grad = _value_and_grad(lm_loss, logits, labels)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert torch.equal(got_grad, want_grad)
    if rows_per_block >= logits.shape[0] * logits.shape[1]:
        assert torch.equal(got, want)


def test_bf16_logits_give_the_fp32_loss_of_those_logits_and_a_bf16_gradient(monkeypatch):
    logits, labels = _case(torch.bfloat16)
    monkeypatch.setattr(loss_module, "BLOCK_ELEMENTS", 4 * logits.shape[-1])
    want, want_grad = _value_and_grad(_plain, logits, labels)
    got, got_grad = _value_and_grad(lm_loss, logits, labels)
    assert got.dtype == torch.float32 and got_grad.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(got_grad, want_grad)  # bf16's own tolerance: one rounding of each


def test_no_fp32_copy_of_the_whole_logits_is_kept_or_made(monkeypatch):
    """What autograd keeps is the logits themselves (the caller holds them anyway) and the
    labels; the largest fp32 tensor the loss makes is one block's, forward and backward."""
    logits, labels = _case(torch.bfloat16, vocab=512, batch=4, seq=16)
    rows = 8
    monkeypatch.setattr(loss_module, "BLOCK_ELEMENTS", rows * 512)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = lm_loss(logits, labels)
    assert not [t for t in saved if t.dtype == torch.float32]
    sizes = []
    real = F.cross_entropy

    def spy(x, *a, **k):
        sizes.append(x.numel())
        return real(x, *a, **k)

    monkeypatch.setattr(F, "cross_entropy", spy)
    loss = lm_loss(logits, labels)
    loss.backward()
    assert len(sizes) == 2 * (4 * 16 // rows) and max(sizes) == rows * 512


def test_the_loss_is_fused_only_where_the_blocks_are_compiled_on_a_gpu():
    assert loss_function(True, "cuda").keywords == {"fused": True}
    assert loss_function(False, "cuda").keywords == {"fused": False}
    assert loss_function(True, "cpu").keywords == {"fused": False}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit inside inductor's import
def test_the_fused_kernels_compute_what_the_eager_ones_do(monkeypatch):
    """The compiled kernels (inductor's CPU backend here; Triton on a GPU), over the whole
    micro-batch at once, against the eager blocks."""
    logits, labels = _case(torch.float32, vocab=300)
    monkeypatch.setattr(loss_module, "BLOCK_ELEMENTS", 9 * 300)
    want, want_grad = _value_and_grad(lm_loss, logits, labels)
    got, got_grad = _value_and_grad(lambda x, y: lm_loss(x, y, fused=True), logits, labels)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-8)
