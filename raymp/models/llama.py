"""A Llama-style decoder: RMSNorm, RoPE, SwiGLU, grouped-query attention, optional tied embeddings.

Plain single-device code. Parallelism is applied from outside (raymp.parallel). Layers live in a
ModuleDict keyed by index, and the embedding, final norm and head may be None, so a pipeline stage
can delete what it does not own while parameter names stay stable for checkpoints.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from raymp.models.args import ModelArgs
from raymp.models.feed_forward import FeedForward
from raymp.models.masks import causal_document_mask
from raymp.models.moe import MoEFeedForward


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the compute dtype, as Llama does.
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()  # each [max_seq_len, head_dim/2]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x [b, s, h, d] by the position's angles."""
    s = x.shape[1]
    cos = cos[:s].view(1, s, 1, -1)
    sin = sin[:s].view(1, s, 1, -1)
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


class ScaledDotProductAttention(nn.Module):
    """q, k, v [b, h, s, d] -> [b, h, s, d]: causal, or as `mask` says (boolean [b, 1, s, s],
    True: attend). A module of its own so parallelism can swap it (context parallelism puts
    an all-to-all around it) without touching the model."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.core = ScaledDotProductAttention()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """mask: a boolean [b, 1, s, s] (True: attend) in place of the plain causal mask."""
        b, s, _ = x.shape
        # -1 for the head count: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, h, s, d]
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        out = self.core(q, k, v, mask)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        moe = args.moe is not None and args.moe.is_moe_layer(layer)
        self.feed_forward = MoEFeedForward(args.dim, args.moe) if moe else FeedForward(args.dim, args.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, i) for i in range(args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.dim, args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        cos, sin = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta)
        # Not persistent: recomputed from the config, so checkpoints hold only learned state.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the head when both are here (again after `to_empty`, which
        gives every module its own tensor)."""
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Recompute the RoPE tables and start the MoE routers unbiased (after the model is
        allocated from the meta device)."""
        cos, sin = rope_tables(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        for layer in self.layers.values():
            if isinstance(layer.feed_forward, MoEFeedForward):
                layer.feed_forward.router.expert_bias.zero_()

    def forward(self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [b, s] int64 -> logits [b, s, vocab] (or hidden states on a middle stage).
        document_ids [b, s]: attend within each token's document only (see masks.py)."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        mask = None if document_ids is None else causal_document_mask(document_ids)
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin, mask)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # tied weights counted once
