"""The shape of the built-in model, by arithmetic: its sizes (ModelArgs, MoEArgs) and the
parameter counts the planner and the metrics reason with. No torch here: loading and checking a
config (`raymp config`, a refused `raymp train`) needs the shapes, never the model's code."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoEArgs:
    n_experts: int
    top_k: int
    expert_ffn_dim: int
    n_shared_experts: int = 0  # each of expert_ffn_dim; run on every token
    score: str = "softmax"
    normalize_topk: bool = True  # the k chosen weights are rescaled to sum to 1
    aux_loss_coef: float = 0.0  # sequence-wise balance loss (DeepSeek-V3's alpha); 0: off
    bias_update_rate: float = 0.0  # aux-loss-free balancing (DeepSeek-V3's gamma); 0: off
    dense_layers: int = 0  # the first layers keep a dense MLP (DeepSeek-V3: 3)

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.dense_layers

    def layer_params(self, dim: int) -> tuple[int, int]:
        """(total, active per token) parameters of one MoE feed-forward block."""
        expert = 3 * dim * self.expert_ffn_dim
        router, shared = dim * self.n_experts, self.n_shared_experts * expert
        return router + shared + self.n_experts * expert, router + shared + self.top_k * expert

    def saved_elements_per_token(self, dim: int, ep: int = 1) -> float:
        """Elements autograd keeps per token for one MoE block's backward, beyond its input:
        router scores (n), the k gathered copies of the token and the expert outputs before
        weighting (3k·dim), each expert's three hidden activations and their product (4k·h), the
        shared experts' (4·shared·h), and the routing indices (int64: 8k + 2 in 4-byte units).
        Fitted on ActivationMeter counts over 24 block shapes (residual < 0.01 per token). Under
        expert parallelism the experts' side (an input row and 4h per routed copy) is priced at
        the most a rank can receive (received_share)."""
        h = self.expert_ffn_dim
        return self.n_experts + 3 * self.top_k * dim + 4 * self.top_k * h + 4 * self.n_shared_experts * h \
            + 8 * self.top_k + 2 + (self.received_share(ep) - 1) * self.top_k * (dim + 4 * h)

    def received_share(self, ep: int) -> float:
        """Under expert parallelism, the most routed rows a rank's experts can receive over the
        k per token of balanced routing: each of the ep ranks' tokens can send min(k, n/ep)
        copies to them (dropless routing has no capacity to cap it). A router that collapses onto
        one rank's experts reaches it; the planner prices that, so no routing runs out of memory."""
        return 1.0 if ep == 1 else ep * min(self.top_k, self.n_experts // ep) / self.top_k


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    max_seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02
    moe: MoEArgs | None = None  # None: every block's MLP is dense

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def _attention_params(self) -> int:
        """One block's attention projections: queries and outputs of n_heads, keys and values of
        n_kv_heads."""
        return self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)

    def _mlp_params(self, active: bool, layer: int | None = None) -> float:
        """Feed-forward parameters of block `layer` (None: the mean block: MoE models keep their
        first moe.dense_layers dense); `active`: those one token runs through."""
        dense = 3 * self.dim * self.ffn_dim
        if self.moe is None:
            return dense
        if layer is not None:
            return self.moe.layer_params(self.dim)[active] if self.moe.is_moe_layer(layer) else dense
        return sum(self._mlp_params(active, i) for i in range(self.n_layers)) / self.n_layers

    def layer_params(self, layer: int | None = None) -> tuple[float, int]:
        """(linear, norm) parameters of block `layer` (None: the mean block): the linears are
        what tensor parallelism splits, the two RMSNorm weights stay whole."""
        return self._attention_params + self._mlp_params(active=False, layer=layer), 2 * self.dim

    def tp_whole_params(self, layer: int, active: bool = False) -> float:
        """Parameters of block `layer` that tensor parallelism leaves whole on every tp rank among
        its linears: an MoE block's feed-forward (router, shared and routed experts; expert
        parallelism splits those instead), 0 in a dense block (raymp.models.llama_tp).
        `active`: those one token runs through."""
        if self.moe is None or not self.moe.is_moe_layer(layer):
            return 0
        return self._mlp_params(active, layer)

    def routed_expert_params(self, layer: int) -> int:
        """Parameters of block `layer`'s routed experts (0 in a dense block): what expert
        parallelism shards."""
        if self.moe is None or not self.moe.is_moe_layer(layer):
            return 0
        return self.moe.n_experts * 3 * self.dim * self.moe.expert_ffn_dim

    def _params(self, linear: float) -> int:
        vocab = self.vocab_size * self.dim
        return round(
            self.n_layers * (linear + 2 * self.dim) + vocab * (1 if self.tie_embeddings else 2) + self.dim
        )

    @property
    def num_params(self) -> int:
        """The whole model's parameters (a tied embedding once), by arithmetic: nothing built."""
        return self._params(self._attention_params + self._mlp_params(active=False))

    @property
    def active_params(self) -> int:
        """Parameters one token runs through (MoE: its k routed experts, not all): what its
        FLOPs, and so MFU, are counted from. num_params for a dense model."""
        return self._params(self._attention_params + self._mlp_params(active=True))


def model_args(model_cfg, vocab_size: int) -> ModelArgs:
    """The shape the planner reasons about (for a Hugging Face model, its config's shape as
    the config section was filled from it); vocab_size from the tokenizer unless set."""
    return ModelArgs(
        vocab_size=model_cfg.vocab_size or vocab_size,
        dim=model_cfg.dim,
        n_layers=model_cfg.n_layers,
        n_heads=model_cfg.n_heads,
        n_kv_heads=model_cfg.n_kv_heads,
        ffn_dim=model_cfg.ffn_dim,
        max_seq_len=model_cfg.max_seq_len,
        rope_theta=model_cfg.rope_theta,
        norm_eps=model_cfg.norm_eps,
        tie_embeddings=model_cfg.tie_embeddings,
        init_std=model_cfg.init_std,
        moe=None if model_cfg.moe is None else MoEArgs(**model_cfg.moe.model_dump()),
    )
