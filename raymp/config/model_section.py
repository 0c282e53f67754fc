"""The `model` section of the run configuration: which model, its shape, its MoE blocks. Its
own module because a model is chosen three ways (preset, Hugging Face, factory) with rules of
their own; the run's other sections are raymp.config.schema."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from raymp.models.presets import PRESETS

__all__ = ["ModelConfig", "MoEConfig", "Strict"]


class Strict(BaseModel):
    # Unknown keys are typos far more often than intent: reject them.
    model_config = ConfigDict(extra="forbid")


class MoEConfig(Strict):
    """Mixture-of-experts feed-forward blocks: the built-in model's (raymp.models.moe: dropless
    token-choice top-k routing, SwiGLU experts; a preset's values fill what is not set), or read
    off a Hugging Face MoE family's config (what the planner counts; not set by hand)."""

    n_experts: int = Field(8, ge=2, description="routed experts per MoE block")
    top_k: int = Field(2, ge=1, description="experts each token is sent to")
    expert_ffn_dim: int = Field(128, gt=0, description="hidden width of one expert (SwiGLU)")
    n_shared_experts: int = Field(0, ge=0, description="experts every token also runs through")
    score: Literal["softmax", "sigmoid"] = Field(
        "softmax", description="router score: softmax (Mixtral, Qwen) " "or sigmoid (DeepSeek-V3)"
    )
    normalize_topk: bool = Field(True, description="rescale the k chosen experts' weights to sum to 1")
    aux_loss_coef: float = Field(0.0, ge=0, description="sequence-wise load-balancing loss weight; 0: off")
    bias_update_rate: float = Field(0.0, ge=0, description="auxiliary-loss-free balancing (DeepSeek-V3): the "
                                    "router bias moves this much per step towards balance; 0: off")
    dense_layers: int = Field(0, ge=0, description="the first layers keep a dense MLP (model.ffn_dim)")

    @model_validator(mode="after")
    def _check(self) -> "MoEConfig":
        if self.top_k > self.n_experts:
            raise ValueError(
                f"model.moe.top_k ({self.top_k}) exceeds model.moe.n_experts ({self.n_experts}); "
                "lower top_k or add experts"
            )
        return self


class ModelConfig(Strict):
    """Which model: the built-in Llama-style decoder (shape from `preset`, any field overridable),
    a Hugging Face causal LM (`hf`: a local save_pretrained directory; `hf_config`: a config.json
    as a mapping, random init), or any nn.Module (`factory`). For the last two the shape fields
    are read off the model by raymp.config.loading before validation (the planner reasons about
    them) and must not be set by hand: the schema itself loads nothing."""

    preset: str | None = "tiny"
    hf: str | None = Field(None, description="local Hugging Face model directory (config.json + safetensors)")
    hf_config: dict[str, Any] | None = Field(
        None, description="a transformers config (with model_type): random init"
    )
    factory: str | None = Field(None, description="'package.module:function' returning an nn.Module")
    factory_tp_plan: str | None = Field(
        None, description="'package.module:function' giving the factory model's tensor-parallel plan")
    vocab_size: int | None = Field(None, gt=0, description="None: taken from the tokenizer")
    dim: int | None = Field(None, gt=0)
    n_layers: int | None = Field(None, gt=0)
    n_heads: int | None = Field(None, gt=0)
    n_kv_heads: int | None = Field(None, gt=0)
    ffn_dim: int | None = Field(None, gt=0)
    max_seq_len: int | None = Field(None, gt=0)
    rope_theta: float | None = Field(None, gt=0)
    norm_eps: float | None = Field(None, gt=0)
    tie_embeddings: bool | None = None
    init_std: float | None = Field(None, gt=0)
    moe: MoEConfig | None = Field(
        None,
        description="mixture-of-experts blocks (built-in model); None: dense, "
        "or the preset's (a Hugging Face MoE family's are read off its config)",
    )

    @model_validator(mode="before")
    @classmethod
    def _moe_over_preset(cls, data: Any) -> Any:
        """model.moe fields set by hand override the preset's one by one, not as a whole section."""
        if isinstance(data, dict) and isinstance(data.get("moe"), dict):
            preset = PRESETS.get(data.get("preset", "tiny") or "", {}).get("moe")
            if preset is not None:
                data = {**data, "moe": {**preset, **data["moe"]}}
        return data

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, v: str | None) -> str | None:
        if v is not None and v not in PRESETS:
            raise ValueError(f"unknown preset {v!r}; choose one of {', '.join(sorted(PRESETS))}")
        return v

    @model_validator(mode="after")
    def _fill_from_preset(self) -> "ModelConfig":
        sources = [k for k in ("hf", "hf_config", "factory") if getattr(self, k) is not None]
        if len(sources) > 1:
            raise ValueError(f"set one of model.{' or model.'.join(sources)}, not several")
        if self.factory_tp_plan is not None and self.factory is None:
            raise ValueError("model.factory_tp_plan needs model.factory; remove it")
        if sources and (sources[0] != "factory" or self.preset is None):
            missing = [k for k in _MODEL_SHAPE_FIELDS if getattr(self, k) is None and k != "vocab_size"]
            if missing:  # raymp.config.loading fills them from the model before validation
                raise ValueError(f"model.{sources[0]}: its shape was not read; load the config with "
                                 "raymp.config.load_config or config_from_dict")
            return self
        if self.preset is None:
            missing = [k for k in _MODEL_SHAPE_FIELDS if getattr(self, k) is None and k != "vocab_size"]
            if missing:
                raise ValueError(f"without a preset, set model.{', model.'.join(missing)}")
            return self
        for key, value in PRESETS[self.preset].items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, MoEConfig(**value) if key == "moe" else value)
        return self

    @property
    def is_hf(self) -> bool:
        return self.hf is not None or self.hf_config is not None

    @model_validator(mode="after")
    def _check_shape(self) -> "ModelConfig":
        if self.moe is not None and self.factory is not None:
            raise ValueError(
                "model.moe builds the built-in model's MoE blocks; a model.factory module brings "
                "its own: remove model.moe"
            )
        if self.moe is not None and self.moe.dense_layers >= self.n_layers:
            raise ValueError(f"model.moe.dense_layers ({self.moe.dense_layers}) leaves none of the "
                             f"{self.n_layers} layers an MoE block; lower it below model.n_layers")
        if self.is_hf or self.factory is not None:
            return self  # transformers validated its own config; a factory's module is what it is
        if self.dim % self.n_heads:
            raise ValueError(f"model.dim ({self.dim}) must be divisible by model.n_heads ({self.n_heads})")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(
                f"head dim model.dim/model.n_heads = {self.dim // self.n_heads} must be even for RoPE"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_heads ({self.n_heads}) must be a multiple of model.n_kv_heads "
                f"({self.n_kv_heads}) for grouped-query attention"
            )
        return self


_MODEL_SHAPE_FIELDS = [
    "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len",
    "rope_theta", "norm_eps", "tie_embeddings", "init_std",
]
