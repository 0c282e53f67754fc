"""Small Hugging Face model configs (built offline from their config dicts) and the run config
the layout tests train them with."""

from __future__ import annotations

import torch

LLAMA = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
# Dropout off: parity is exact only without random masks (their RNG differs per layout).
GPT2 = dict(model_type="gpt2", vocab_size=256, n_embd=64, n_layer=4, n_head=4, n_positions=128,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
FAMILIES = {"llama": LLAMA, "gpt2": GPT2}
# Sliding windows shorter than the sequences below (32): Mistral slides on every layer, Qwen2 on
# the layers from max_window_layers on.
SLIDING = {"mistral": {**LLAMA, "model_type": "mistral", "sliding_window": 16},
           "qwen2": {**LLAMA, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 16,
                     "max_window_layers": 2}}
# TP sums partial products in another order than one process; Adam's normalised update turns
# that into up to a few 1e-4 on a rare near-zero-gradient weight over 5 steps (as for the built-in
# model; seen here: 1.3e-4 on 1 of 16384 GPT-2 c_fc weights with transformers 5.x earlier, 2.7e-4
# on 1 of 16384 c_proj weights with 5.24). A weight that missed its updates would be ~1e-2 off
# (lr 1e-2, 5 steps). Losses are held to 1e-5.
WEIGHT_ATOL = 5e-4
# Three MoE families at the tiny size: top-2 of 4 experts; Qwen2-MoE adds a shared expert.
_MOE_BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)

MOE_FAMILIES = {
    "mixtral": dict(_MOE_BASE, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(
        _MOE_BASE,
        model_type="qwen2_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
    ),
    "qwen3_moe": dict(
        _MOE_BASE,
        model_type="qwen3_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        head_dim=16,
    ),
    # Latent attention, sigmoid routing limited to 1 of 2 expert groups, a shared expert, the
    # first layer dense: DeepSeek-V3's shape, small.
    "deepseek_v3": dict(
        _MOE_BASE,
        model_type="deepseek_v3",
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        moe_intermediate_size=32,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
    ),
}


def hf_run(tiny_cfg, model: dict, parallel: dict, steps=5, **sections):
    cfg = tiny_cfg(parallel=parallel, train={"steps": steps, "global_batch_size": 8, "seq_len": 32,
                                             "log_every": 1}, **sections)
    cfg["model"] = {"preset": None, **model}  # not merged with the tiny preset's fields
    return cfg


def hf_model(model_dir) -> torch.nn.Module:
    """transformers' own model from an exported directory, to compare raymp's logits against."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    return model.eval()


def tokens(batch=2, seq=16, seed=0):
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))


def hf_reference(spec, model: torch.nn.Module) -> torch.nn.Module:
    """transformers' own model for `spec` holding `model`'s weights (raymp's built model of it)."""
    import transformers

    from raymp.models.hf import to_hf_state_dict

    reference = transformers.AutoModelForCausalLM.from_config(spec.hf_config, attn_implementation="sdpa")
    reference.eval()
    reference.load_state_dict(to_hf_state_dict(spec.model_type, model.state_dict(), spec.tie_embeddings),
                              strict=False)
    return reference
