"""Model shapes by name. Tiny/small (and their MoE forms) train on CPU in seconds; the Llama
shapes are for planning and GPU clusters (their published dims: Llama 3.2 1B, Llama 3.1 8B and
70B), as are the MoE classes (Mixtral 8x7B, Qwen3-30B-A3B, DeepSeek-V3: their published widths,
depths, experts and routing, with raymp's grouped-query attention of head_dim = dim / n_heads in
place of Qwen3's 128-wide heads and DeepSeek-V3's latent attention, so their attention parameter
counts are near, not equal, to the published ones)."""

PRESETS: dict[str, dict] = {
    # vocab_size None: taken from the tokenizer (256 for bytes, 50257 for gpt2).
    "tiny": dict(vocab_size=None, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=176,
                 max_seq_len=256, rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=True,
                 init_std=0.02),
    "small": dict(vocab_size=None, dim=256, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=688,
                  max_seq_len=512, rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=True,
                  init_std=0.02),
    # GPT-2 small's shape (12 x 768, 12 heads) with a SwiGLU MLP of the same size (3 x 768 x 2048)
    # and the GPT-2 vocabulary padded to a multiple of 64.
    "gpt2-124m": dict(vocab_size=50304, dim=768, n_layers=12, n_heads=12, n_kv_heads=12,
                      ffn_dim=2048, max_seq_len=1024, rope_theta=10000.0, norm_eps=1e-5,
                      tie_embeddings=True, init_std=0.02),
    "llama-1b": dict(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                     ffn_dim=8192, max_seq_len=8192, rope_theta=500000.0, norm_eps=1e-5,
                     tie_embeddings=True, init_std=0.02),
    "llama-8b": dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                     ffn_dim=14336, max_seq_len=8192, rope_theta=500000.0, norm_eps=1e-5,
                     tie_embeddings=False, init_std=0.02),
    "llama-70b": dict(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                      ffn_dim=28672, max_seq_len=8192, rope_theta=500000.0, norm_eps=1e-5,
                      tie_embeddings=False, init_std=0.02),
    # GPT-3 175B's shape (96 layers, d=12288, 96 heads) with a SwiGLU MLP of the same size
    # (3 x d x 32768 = 8d^2 per layer) and the GPT-2 vocabulary padded to a multiple of 64.
    "gpt3-175b": dict(vocab_size=50304, dim=12288, n_layers=96, n_heads=96, n_kv_heads=96,
                      ffn_dim=32768, max_seq_len=2048, rope_theta=10000.0, norm_eps=1e-5,
                      tie_embeddings=True, init_std=0.02),
    # Mixture-of-experts classes, for planning (see the module docstring).
    "mixtral-8x7b": dict(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                         ffn_dim=14336, max_seq_len=32768, rope_theta=1e6, norm_eps=1e-5,
                         tie_embeddings=False, init_std=0.02,
                         moe=dict(n_experts=8, top_k=2, expert_ffn_dim=14336, n_shared_experts=0,
                                  score="softmax", normalize_topk=True, aux_loss_coef=0.02,
                                  bias_update_rate=0.0, dense_layers=0)),
    "qwen3-30b-a3b": dict(vocab_size=151936, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4,
                          ffn_dim=6144, max_seq_len=40960, rope_theta=1e6, norm_eps=1e-6,
                          tie_embeddings=False, init_std=0.02,
                          moe=dict(n_experts=128, top_k=8, expert_ffn_dim=768, n_shared_experts=0,
                                   score="softmax", normalize_topk=True, aux_loss_coef=0.001,
                                   bias_update_rate=0.0, dense_layers=0)),
    "deepseek-v3": dict(vocab_size=129280, dim=7168, n_layers=61, n_heads=128, n_kv_heads=128,
                        ffn_dim=18432, max_seq_len=4096, rope_theta=10000.0, norm_eps=1e-6,
                        tie_embeddings=False, init_std=0.006,
                        moe=dict(n_experts=256, top_k=8, expert_ffn_dim=2048, n_shared_experts=1,
                                 score="sigmoid", normalize_topk=True, aux_loss_coef=0.0001,
                                 bias_update_rate=0.001, dense_layers=3)),
}

# Mixture-of-experts forms of tiny and small: their attention with dropless top-2 routing over 8 /
# 16 SwiGLU experts and one shared expert; the first layer stays dense (model.ffn_dim).
_SMALL_ROUTING = dict(n_shared_experts=1, score="softmax", normalize_topk=True, aux_loss_coef=0.01,
                      bias_update_rate=0.001, dense_layers=1)
PRESETS["tiny-moe"] = dict(
    PRESETS["tiny"], moe=dict(n_experts=8, top_k=2, expert_ffn_dim=64, **_SMALL_ROUTING)
)
PRESETS["small-moe"] = dict(
    PRESETS["small"], moe=dict(n_experts=16, top_k=2, expert_ffn_dim=256, **_SMALL_ROUTING)
)
