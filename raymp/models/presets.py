"""Model shapes by name. Tiny/small train on CPU in seconds; the Llama shapes are for planning
and GPU clusters (their published dims: Llama 3.2 1B, Llama 3.1 8B and 70B)."""

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
}
