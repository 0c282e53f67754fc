"""Hugging Face `transformers` causal LMs (Llama, Qwen2, Mistral and GPT-2 families, and the
mixture-of-experts Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V3), trained by raymp with dp/ZeRO,
pp, tp (dense families) and ep (MoE families) without touching their code.

The model is built from its config on the meta device, and its own submodules (embedding,
decoder layers, final norm, head) are re-hung in raymp's stageable shape (see spec.py): a
pipeline stage keeps its decoder layers, the first stage the embedding, the last the norm and
head. A little glue replaces the top-level forward (positions, rotary tables, the layer loop);
the decoder layers run as `transformers` wrote them. Weights come from a local directory's
safetensors, read tensor by tensor into each rank's own shard, and go back out the same way
(`export_hf`), so `from_pretrained` loads what raymp trained.

Inside raymp, parameters are named in the stageable shape (`layers.3.self_attn.q_proj.weight`);
`Family.hf_name` maps them to the names in the Hugging Face files.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn

from raymp.models.masks import hf_masks
from raymp.models.spec import EMBEDDING, HEAD, ModelSpec, clean_name, generic_initial_value

# Mixture-of-experts families run transformers' own sparse blocks (dropless top-k, experts as
# stacked weights); raymp pipelines and data-parallelizes them like the dense ones.
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
LLAMA_LIKE = ("llama", "qwen2", "mistral", *MOE_FAMILIES)
SUPPORTED = (*LLAMA_LIKE, "gpt2")


class HFModelError(ValueError):
    """A Hugging Face model that cannot be used as configured; says which field and the fix."""


def _transformers():
    try:
        import transformers
    except ImportError:
        raise HFModelError("model.hf / model.hf_config need the transformers package: "
                           "pip install 'raymp[hf]'") from None
    return transformers


# -- where the model comes from ---------------------------------------------------------------


def resolve_dir(name_or_path: str) -> Path:
    """A local directory, or a model already in the Hugging Face cache. raymp never downloads:
    actors on a cluster would each fetch it, and most clusters have no way out."""
    if os.path.isdir(name_or_path):
        return Path(name_or_path)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name_or_path, local_files_only=True))
    except Exception:
        raise HFModelError(
            f"model.hf {name_or_path!r} is neither a local directory nor in the Hugging Face cache, "
            "and raymp does not download models. Fetch it where there is network "
            f"(`huggingface-cli download {name_or_path} --local-dir DIR`, or save_pretrained) and "
            "set model.hf to that directory (on a cluster: a path every node can read)"
        ) from None


@lru_cache(maxsize=16)
def _config_from_json(text: str):
    data = json.loads(text)
    model_type = data.pop("model_type", None)
    if model_type not in SUPPORTED:
        raise HFModelError(
            f"model.hf_config.model_type {model_type!r} is not supported; raymp parallelizes "
            f"{', '.join(SUPPORTED)} (other nn.Modules: see model.factory in docs/models.md)")
    return _transformers().AutoConfig.for_model(model_type, **data)


def load_hf_config(hf: str | None, hf_config: dict | None):
    """The transformers config of `model.hf` (a directory) or `model.hf_config` (a dict with
    model_type, as in config.json). Cached: config validation and every build ask for it."""
    if hf_config is not None:
        return _config_from_json(json.dumps(hf_config, sort_keys=True))
    path = resolve_dir(hf) / "config.json"
    if not path.is_file():
        raise HFModelError(f"model.hf {hf!r} has no config.json; point it at a save_pretrained directory")
    return _config_from_json(path.read_text())


def shape_fields(cfg) -> dict:
    """ModelConfig's shape fields from a transformers config: what the planner, the pipeline
    balancer and the config checks reason about."""
    if cfg.model_type == "gpt2":
        inner = cfg.n_inner or 4 * cfg.n_embd
        return dict(vocab_size=cfg.vocab_size, dim=cfg.n_embd, n_layers=cfg.n_layer, n_heads=cfg.n_head,
                    n_kv_heads=cfg.n_head,
                    # Two GELU matrices of `inner` hold as many weights as three SwiGLU ones of 2/3 of it.
                    ffn_dim=max(1, round(2 * inner / 3)),
                    max_seq_len=cfg.n_positions, rope_theta=10000.0, norm_eps=cfg.layer_norm_epsilon,
                    tie_embeddings=bool(cfg.tie_word_embeddings), init_std=cfg.initializer_range)
    rope = getattr(cfg, "rope_parameters", None) or {}
    moe = {"moe": moe_fields(cfg)} if cfg.model_type in MOE_FAMILIES else {}
    return dict(
        **moe,
        vocab_size=cfg.vocab_size,
        dim=cfg.hidden_size,
        n_layers=cfg.num_hidden_layers,
        n_heads=cfg.num_attention_heads,
        n_kv_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
        ffn_dim=cfg.intermediate_size,
        max_seq_len=cfg.max_position_embeddings,
        rope_theta=float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))),
        norm_eps=cfg.rms_norm_eps,
        tie_embeddings=bool(cfg.tie_word_embeddings),
        init_std=cfg.initializer_range,
    )


def moe_fields(cfg) -> dict:
    """model.moe read off an MoE family's config: what the planner counts (every expert's state,
    the k a token runs through). Qwen2-MoE's one shared expert of its own width counts as that
    many expert widths."""
    if getattr(cfg, "output_router_logits", False):
        raise HFModelError(
            f"output_router_logits in the {cfg.model_type} config asks transformers to add its router "
            "auxiliary loss, which raymp's glue does not compute (it would be silently left out); set "
            "output_router_logits=false, or use the built-in model's model.moe.aux_loss_coef")
    expert = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    shared = getattr(cfg, "shared_expert_intermediate_size", 0) or 0
    shared = shared or (getattr(cfg, "n_shared_experts", 0) or 0) * expert  # DeepSeek-V3's
    sparse_step = getattr(cfg, "decoder_sparse_step", 1) or 1
    dense = set(getattr(cfg, "mlp_only_layers", None) or ())
    dense |= {i for i in range(cfg.num_hidden_layers) if (i + 1) % sparse_step}
    dense |= set(range(getattr(cfg, "first_k_dense_replace", 0) or 0))  # DeepSeek-V3's leading dense layers
    if dense and dense != set(range(len(dense))):
        raise HFModelError(f"{cfg.model_type}: dense MLP layers {sorted(dense)} between MoE ones are not "
                           "supported (raymp plans leading dense layers only); set mlp_only_layers=[] and "
                           "decoder_sparse_step=1 in the config")
    return dict(n_experts=getattr(cfg, experts_key(cfg)),
                top_k=cfg.num_experts_per_tok, expert_ffn_dim=expert,
                n_shared_experts=round(shared / expert),
                score="sigmoid" if cfg.model_type == "deepseek_v3" else "softmax",
                normalize_topk=bool(getattr(cfg, "norm_topk_prob", True)), aux_loss_coef=0.0,
                bias_update_rate=0.0, dense_layers=len(dense))


def experts_key(cfg) -> str:
    """The config.json key of an MoE family's routed expert count, as its published configs name it
    (transformers maps Qwen3-MoE's num_experts to num_local_experts inside)."""
    keys = {"mixtral": "num_local_experts", "deepseek_v3": "n_routed_experts"}
    return keys.get(cfg.model_type, "num_experts")


def tensor_parallel_dims(cfg) -> dict[str, int]:
    """Sizes tensor parallelism splits, by their config.json names (each must divide by tp)."""
    if cfg.model_type == "gpt2":
        return {"n_head": cfg.n_head, "n_inner": cfg.n_inner or 4 * cfg.n_embd, "vocab_size": cfg.vocab_size}
    return {"num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads or cfg.num_attention_heads,
            "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size}


# -- the stageable shape ------------------------------------------------------------------------


class LlamaLikeLM(nn.Module):
    """Llama, Qwen2, Mistral: embed_tokens -> decoder layers (RoPE tables and attention masks
    computed once per forward and handed to each, as LlamaModel does) -> norm -> lm_head."""

    def __init__(self, hf_model):
        super().__init__()
        inner = hf_model.model
        self.tok_embeddings = inner.embed_tokens
        self.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(inner.layers)})
        self.norm = inner.norm
        self.output = hf_model.lm_head
        self.rotary = inner.rotary_emb
        self.hf_config = config = hf_model.config
        # Which attention each layer (by its global index: a pipeline stage keeps its own) runs:
        # Qwen2 says per layer; Mistral slides on every layer when it has a window.
        sliding = (
            "sliding_attention"
            if config.model_type == "mistral" and config.sliding_window
            else "full_attention"
        )
        self.layer_types = list(getattr(config, "layer_types", None) or [sliding] * len(inner.layers))
        # Under sequence parallelism hidden states hold 1/tp of the sequence between layers; the
        # rotary tables and masks are for the whole of it (attention sees it gathered).
        self.sequence_shards = 1

    def forward(self, x: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        first = self.tok_embeddings is not None
        seq = x.shape[1] if first else x.shape[1] * self.sequence_shards
        h = self.tok_embeddings(x) if first else x
        positions = torch.arange(seq, device=h.device).unsqueeze(0)
        rope = self.rotary(h, positions)
        whole = h.new_empty(h.shape[0], seq, 1)  # what the mask builders read: batch, length, dtype
        masks = hf_masks(
            self.hf_config, {self.layer_types[int(i)] for i in self.layers}, whole, positions, document_ids
        )
        for index, layer in self.layers.items():
            h = layer(h, attention_mask=masks[self.layer_types[int(index)]], position_embeddings=rope,
                      position_ids=positions)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


class FusedQKV(nn.Module):
    """GPT-2's c_attn (one Conv1D producing [q | k | v]) as three Linear projections, so tensor
    parallelism can split each by heads. Returns the same concatenation: under TP, of this
    rank's heads (GPT2Attention splits it by `split_size`, set to the local width)."""

    def __init__(self, dim: int):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)


class GPT2LikeLM(nn.Module):
    """GPT-2: wte + wpe -> blocks -> ln_f -> lm_head. Its Conv1D layers (weights stored
    transposed) become nn.Linear, which torch's TP styles take; the names stay."""

    def __init__(self, hf_model):
        super().__init__()
        t = hf_model.transformer
        self.tok_embeddings, self.pos_embeddings, self.embed_dropout = t.wte, t.wpe, t.drop
        for block in t.h:
            dim = block.attn.embed_dim
            block.attn.c_attn = FusedQKV(dim)
            block.attn.c_proj = nn.Linear(dim, dim)
            inner = block.mlp.c_fc.nf
            block.mlp.c_fc = nn.Linear(dim, inner)
            block.mlp.c_proj = nn.Linear(inner, dim)
        self.layers = nn.ModuleDict({str(i): block for i, block in enumerate(t.h)})
        self.norm = t.ln_f
        self.output = hf_model.lm_head
        self.hf_config = hf_model.config

    def forward(self, x: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        if self.tok_embeddings is not None:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.embed_dropout(self.tok_embeddings(x) + self.pos_embeddings(positions))
        mask = None
        if document_ids is not None:
            mask = hf_masks(
                self.hf_config,
                {"full_attention"},
                x,
                torch.arange(x.shape[1], device=x.device).unsqueeze(0),
                document_ids,
            )["full_attention"]
        for layer in self.layers.values():
            x = layer(x, attention_mask=mask)
        if self.norm is not None:
            x = self.norm(x)
        return self.output(x) if self.output is not None else x


# -- names and layouts in Hugging Face files ------------------------------------------------------


def hf_name(model_type: str, name: str) -> str:
    """The Hugging Face name of a parameter named in the stageable shape (GPT-2's split q/k/v
    all come from `c_attn`)."""
    if model_type == "gpt2":
        top = {EMBEDDING: "transformer.wte.weight", "pos_embeddings.weight": "transformer.wpe.weight",
               HEAD: "lm_head.weight"}
        if name in top:
            return top[name]
        if name.startswith("norm."):
            return "transformer.ln_f." + name[len("norm."):]
        name = "transformer.h." + name[len("layers."):]
        for part in (".c_attn.q.", ".c_attn.k.", ".c_attn.v."):
            name = name.replace(part, ".c_attn.")
        return name
    top = {EMBEDDING: "model.embed_tokens.weight", "norm.weight": "model.norm.weight", HEAD: "lm_head.weight"}
    return top.get(name, "model." + name)


def _is_conv1d(name: str) -> bool:
    return name.endswith(("attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"))


def from_hf_layout(model_type: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A tensor as stored by transformers -> the value of raymp's parameter `name`."""
    if model_type != "gpt2":
        return tensor
    for i, part in enumerate(("c_attn.q.", "c_attn.k.", "c_attn.v.")):
        if part in name:  # Conv1D [dim, 3*dim] (or bias [3*dim]): take q, k or v, as [out, in]
            width = tensor.shape[-1] // 3
            piece = tensor[..., i * width:(i + 1) * width]
            return piece.t() if piece.dim() == 2 else piece
    return tensor.t() if _is_conv1d(name) else tensor


def to_hf_state_dict(
    model_type: str, weights: dict[str, torch.Tensor], tied: bool
) -> dict[str, torch.Tensor]:
    """Full weights named in the stageable shape -> a transformers state dict (a tied head is
    left out: from_pretrained ties it to the embedding)."""
    out: dict[str, torch.Tensor] = {}
    qkv: dict[str, list] = {}
    for name, value in weights.items():
        if tied and name == HEAD:
            continue
        target = hf_name(model_type, name)
        if model_type == "gpt2" and ".c_attn." in name:
            qkv.setdefault(target, [None] * 3)["qkv".index(name.split(".c_attn.")[1][0])] = value
            continue
        out[target] = (value.t() if model_type == "gpt2" and _is_conv1d(name) else value).contiguous()
    for target, parts in qkv.items():  # q, k, v side by side, in Conv1D's [in, out] layout
        out[target] = torch.cat([p.t() if p.dim() == 2 else p for p in parts], dim=-1).contiguous()
    return out


class SafetensorsDir:
    """Tensors of a save_pretrained directory (one model.safetensors or an index of shards),
    read one at a time: a rank reads only the tensors of its stage, and at most one whole
    tensor is in memory beside its shards."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (path / "model.safetensors").is_file():
            with safe_open(path / "model.safetensors", "pt") as f:
                weight_map = {k: "model.safetensors" for k in f.keys()}
        else:
            raise HFModelError(f"model.hf {str(path)!r} has no model.safetensors (or index); "
                               "save the model with save_pretrained(..., safe_serialization=True)")
        self.path, self.weight_map = path, weight_map

    def read(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        candidates = [name]
        if name.startswith("transformer."):  # GPT-2 files written by old transformers lack it
            candidates.append(name[len("transformer."):])
        for key in candidates:
            if key in self.weight_map:
                with safe_open(self.path / self.weight_map[key], "pt") as f:
                    return f.get_tensor(key)
        raise HFModelError(f"{self.path}: no tensor {name!r} in the weights; the directory's "
                           "weights do not match its config.json")


# -- the spec -------------------------------------------------------------------------------------


class HFSpec(ModelSpec):
    """A transformers causal LM, from a config (random init, seeded by parameter name so every
    layout starts from the same weights) or a local directory (its weights)."""

    def __init__(self, hf_config, weights_dir: Path | None, seed: int):
        if hf_config.model_type not in SUPPORTED:
            raise HFModelError(f"model_type {hf_config.model_type!r} is not supported; raymp "
                               f"parallelizes {', '.join(SUPPORTED)}")
        self.hf_config, self.seed = hf_config, seed
        self.model_type = hf_config.model_type
        self.tie_embeddings = bool(hf_config.tie_word_embeddings)
        self.num_layers = shape_fields(hf_config)["n_layers"]
        self.weights = SafetensorsDir(weights_dir) if weights_dir is not None else None
        if self.model_type == "gpt2":
            self.first_stage_modules = ("tok_embeddings", "pos_embeddings")

    @classmethod
    def from_model_config(cls, model_cfg, seed: int) -> "HFSpec":
        cfg = load_hf_config(model_cfg.hf, model_cfg.hf_config)
        weights_dir = resolve_dir(model_cfg.hf) if model_cfg.hf is not None else None
        return cls(cfg, weights_dir, seed)

    def build_meta(self) -> nn.Module:
        transformers = _transformers()
        with torch.device("meta"):
            hf_model = transformers.AutoModelForCausalLM.from_config(
                self.hf_config, attn_implementation="sdpa"
            )
        module = GPT2LikeLM(hf_model) if self.model_type == "gpt2" else LlamaLikeLM(hf_model)
        return module.train()

    def initial_value(self, name: str, shape) -> torch.Tensor:
        if self.weights is not None:
            stored = self.weights.read(hf_name(self.model_type, name))
            return from_hf_layout(self.model_type, name, stored).float()
        return generic_initial_value(self.seed, name, shape, self.hf_config.initializer_range)

    def reset_buffers(self, module: nn.Module) -> None:
        if isinstance(module, LlamaLikeLM):  # inv_freq was computed on the meta device
            device = next(module.parameters()).device
            module.rotary = type(module.rotary)(config=self.hf_config).to(device)
        # DeepSeek-V3's router bias (a buffer: transformers moves it in no training step, nor
        # does raymp): the stored one when the weights come from a directory, else zeros.
        with torch.no_grad():
            for name, bias in module.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    bias.copy_(self.weights.read(hf_name(self.model_type, clean_name(name)))
                               if self.weights is not None else torch.zeros_like(bias))

    def tensor_parallel(self, module: nn.Module, tp_mesh, sequence_parallel: bool) -> None:
        from torch.distributed.tensor.parallel import parallelize_module

        from raymp.models.hf_tp import gpt2_block_plan, llama_block_plan, top_plan

        gpt2 = self.model_type == "gpt2"
        block_plan = gpt2_block_plan() if gpt2 else llama_block_plan(sequence_parallel)
        for block in module.layers.values():
            parallelize_module(block, tp_mesh, block_plan)
            if gpt2:
                block.attn.split_size = block.attn.embed_dim // tp_mesh.size()
        parallelize_module(module, tp_mesh, top_plan(module, sequence_parallel))
        if sequence_parallel:
            module.sequence_shards = tp_mesh.size()


def export_hf(weights: dict[str, torch.Tensor], hf_config, out_dir: str | os.PathLike) -> Path:
    """Write full weights (stageable names) as a Hugging Face directory: config.json and
    model.safetensors, loadable with AutoModelForCausalLM.from_pretrained."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = to_hf_state_dict(hf_config.model_type, weights, bool(hf_config.tie_word_embeddings))
    hf_config.save_pretrained(out)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
