"""Rules across config sections, checked once the schema has parsed them: each raises with the
offending field's dotted name and a fix. The layout's own rules are raymp.layout_rules' and are
asked, not restated."""

from __future__ import annotations

from raymp import layout_rules
from raymp.layout import Layout, runs_on_fsdp
from raymp.models.shape import TOKENIZER_VOCAB, model_shape
from raymp.storage import default_tracking_uri

CPU_OFFLOAD_ON_CPU = (
    "optimizer.cpu_offload needs GPU actors (FSDP2's CPUOffloadPolicy moves state off the "
    "accelerator); on CPU actors optimizer state already lives in host memory: set "
    "optimizer.cpu_offload=false"
)


def _layout_inputs(cfg) -> tuple:
    """What raymp.layout_rules needs of a config: its model's shape, global batch, sequence."""
    tokenizer = cfg.data.tokenizer
    shape = model_shape(cfg.model, TOKENIZER_VOCAB.get(tokenizer), tokenizer)
    return shape, cfg.train.global_batch_size, cfg.train.seq_len


def layout_problems(cfg, layout) -> list[str]:
    """Why `layout` cannot run the config's model at its batch and sequence (raymp.layout_rules):
    what check_run refuses a layout for."""
    return layout_rules.problems(layout, *_layout_inputs(cfg))


def check_run(cfg) -> None:
    """Cross-section checks. Each raises with the offending field's dotted name and a fix. The
    layout's own rules are raymp.layout_rules'; they are asked here, not restated."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    if ":" in cfg.data.tokenizer:  # your own: importable now, not only when the data is prepared
        from raymp.data.tokenizers import get_tokenizer

        get_tokenizer(cfg.data.tokenizer)
    layout_rules.check(p.layout, *_layout_inputs(cfg))
    devices = cfg.resources.devices
    if devices is not None and devices != p.world_size:
        raise ValueError(
            f"resources.devices ({devices}) must equal parallel.dp*cp*pp*tp = "
            f"{p.dp}*{p.cp}*{p.pp}*{p.tp} = {p.world_size}; change one of them"
        )
    if t.seq_len > m.max_seq_len:
        raise ValueError(
            f"train.seq_len ({t.seq_len}) exceeds model.max_seq_len ({m.max_seq_len}); "
            "lower train.seq_len or raise model.max_seq_len"
        )
    if cfg.elastic.keep_survivors and not survivors_keep_state(
        p.layout, p.layout.state_replicas, cfg.elastic.peer_copy_every
    ):  # asked for explicitly (unset: on only where the layout allows it, keeps_survivors)
        shards = f"parallel.ep={p.ep} shards the experts" if p.ep > 1 else f"zero={p.zero} shards it"
        raise ValueError(
            "elastic.keep_survivors needs a second whole copy of the training state, but "
            f"{shards} over every dp rank, so a loss leaves none whole; set "
            "parallel.zero=0 (each dp replica holds it; with parallel.ep, dp >= 2 x ep), HSDP with "
            "parallel.dp_replicate >= 2 "
            "(each group holds it), elastic.peer_copy_every (the survivors reload the peer copy), "
            "or elastic.keep_survivors=false (restart from the checkpoint)"
        )
    if cfg.elastic.replace_stragglers:
        _check_straggler_replacement(cfg)
    if cfg.elastic.spares:
        _check_spares(cfg)
    if cfg.optimizer.cpu_offload and not p.layout.fsdp:
        raise ValueError(
            "optimizer.cpu_offload needs parallel.zero 2 or 3 (FSDP2's offload policy); "
            "set parallel.zero=2 or optimizer.cpu_offload=false"
        )
    if cfg.optimizer.cpu_offload and cfg.resources.device == "cpu":
        raise ValueError(CPU_OFFLOAD_ON_CPU)
    if cfg.precision == "fp16":
        raise ValueError(
            "precision fp16 is not supported: it needs loss scaling, which raymp does not do; use "
            "precision=bf16 (the same speed on GPUs that have it, and no scaling needed)"
        )
    if m.moe is not None:
        _check_moe(cfg)
    if cfg.precision == "fp8":
        _check_float8(cfg)
    elif cfg.float8 != type(cfg.float8)():
        raise ValueError(
            f"float8 settings apply to precision fp8 only; set precision=fp8 or remove the float8 "
            f"section (precision is {cfg.precision})"
        )
    if cfg.data.document_mask and m.factory is not None:
        raise ValueError(
            "data.document_mask needs the built-in model or a Hugging Face one (raymp hands their "
            "forward each token's document id); a model.factory module takes tokens only: set "
            "data.document_mask=false"
        )
    if t.on_nonfinite == "restore" and not cfg.checkpoint.every:
        raise ValueError(
            "train.on_nonfinite=restore goes back to the newest checkpoint, and checkpoint.every=0 "
            "writes none (the run would start over): set checkpoint.every, or train.on_nonfinite=skip"
        )
    if t.compile and (reason := compile_unsupported(cfg)):
        raise ValueError(reason)
    tokenizer = cfg.data.tokenizer
    if problem := vocab_too_small(m.vocab_size, tokenizer, TOKENIZER_VOCAB.get(tokenizer)):
        raise ValueError(problem)
    if cfg.tracking.enabled and cfg.tracking.tracking_uri is None:
        default_tracking_uri(cfg.output_dir)  # raises when output_dir cannot hold the embedded store


def vocab_too_small(model_vocab: int | None, tokenizer: str, tokenizer_vocab: int | None) -> str:
    """Why model.vocab_size cannot hold the tokenizer's ids, or ''. Asked at config time for the
    built-in tokenizers, and by the driver once the data names the tokenizer's real vocabulary."""
    if model_vocab is None or tokenizer_vocab is None or model_vocab >= tokenizer_vocab:
        return ""
    return (f"model.vocab_size ({model_vocab}) is smaller than the {tokenizer} tokenizer's {tokenizer_vocab} "
            "tokens; leave model.vocab_size unset to take it from the tokenizer")


def _check_moe(cfg) -> None:
    """Mixture-of-experts blocks beyond the layout (whose rules, tp and cp among them, are
    raymp.layout_rules'): what else runs them unverified is refused."""
    if cfg.precision == "fp8":
        raise ValueError("precision fp8 with model.moe is not supported (the routed experts are not float8 "
                         "linears); use precision=bf16")


def _check_float8(cfg) -> None:
    """precision fp8: where torchao's float8 training runs as raymp applies it."""
    p, f8 = cfg.parallel, cfg.float8
    if cfg.resources.device != "cuda":
        raise ValueError(
            "precision fp8 needs CUDA GPUs of compute capability 8.9 or newer (H100, L40S, ...): "
            "set resources.device=cuda on such GPUs, or precision=bf16"
        )
    if cfg.model.hf is not None or cfg.model.hf_config is not None or cfg.model.factory is not None:
        raise ValueError("precision fp8 is applied to the built-in model's transformer blocks only; use a "
                         "model.preset, or precision=bf16 for a Hugging Face or factory model")
    if p.tp > 1:
        raise ValueError("precision fp8 with parallel.tp > 1 is not supported (float8 tensor-parallel plans "
                         "are not applied); set parallel.tp=1 or precision=bf16")
    if f8.fsdp_all_gather and f8.recipe != "tensorwise":
        raise ValueError("float8.fsdp_all_gather needs float8.recipe=tensorwise (torchao gathers float8 "
                         "weights with one scale per tensor); set one or the other")
    if f8.fsdp_all_gather and not runs_on_fsdp(p.zero):
        raise ValueError(
            f"float8.fsdp_all_gather gathers ZeRO 2/3 weights, but parallel.zero={p.zero} gathers "
            "none; set parallel.zero=2 or 3, or float8.fsdp_all_gather=false"
        )


def compile_unsupported(cfg) -> str | None:
    """Why the blocks of this config cannot be compiled (train.compile=true is refused with it;
    unset, compilation is left off), or None."""
    p, m = cfg.parallel, cfg.model
    if p.sequence_parallel:
        return ("train.compile with parallel.sequence_parallel is not supported: under torch 2.13 a compiled "
                "attention or MLP fed by a sequence-parallel norm gets a wrong input gradient (measured: "
                "training diverges from eager at step 1); set train.compile=false or "
                "parallel.sequence_parallel=false")
    if m.factory is not None and p.tp > 1:
        return ("train.compile with a model.factory module under parallel.tp > 1 is not supported: raymp "
                "compiles a factory module whole, and torch miscompiles a tensor-parallel module compiled "
                "whole; set train.compile=false or parallel.tp=1")
    return None


def _check_straggler_replacement(cfg) -> None:
    """elastic.replace_stragglers replaces a straggler by the survivors' path: it needs a report
    to act on, a recovery to make, and survivors that keep the state (never a restart from storage
    for a rank that was only slow)."""
    e = cfg.elastic
    if not e.straggler_factor:
        raise ValueError("elastic.replace_stragglers replaces the stragglers reported, and "
                         "elastic.straggler_factor=0 reports none; set a factor above 1 (e.g. 2) or "
                         "elastic.replace_stragglers=false")
    if not e.recovers:
        raise ValueError("elastic.replace_stragglers recovers from a straggler as from a lost rank, and "
                         "this run recovers from none (elastic.enabled=false or elastic.max_restarts=0); "
                         "enable them or set elastic.replace_stragglers=false")
    if not keeps_survivors(cfg):
        raise ValueError("elastic.replace_stragglers lets a straggler's peers go on with their state while "
                         "a new process joins, but this layout's survivors keep none (elastic.keep_survivors "
                         "is off or the layout has no second whole copy of the state): use parallel.zero=0, "
                         "HSDP or elastic.peer_copy_every, or set elastic.replace_stragglers=false")


def _check_spares(cfg) -> None:
    """A spare takes lost ranks' places from the survivors' state in memory, or, where the ranks
    hold one copy of the state, from the peer copies (Layout.spare_unit)."""
    e, lay = cfg.elastic, cfg.parallel.layout
    if not e.recovers or not e.grow_back:
        raise ValueError("elastic.spares take lost ranks' places when a run recovers and grows back, and "
                         "this run does neither (elastic.enabled, elastic.max_restarts or "
                         "elastic.grow_back is off); turn them on or set elastic.spares=0")
    if not keeps_survivors(cfg):
        raise ValueError("elastic.spares join from the survivors' state in memory, but this layout's "
                         "survivors keep none (elastic.keep_survivors is off or the layout has no second "
                         "whole copy of the state): use parallel.zero=0, HSDP or elastic.peer_copy_every, "
                         "or set elastic.spares=0")
    unit = lay.spare_unit(bool(e.peer_copy_every))
    if e.spares % unit:
        raise ValueError(f"elastic.spares ({e.spares}) take lost ranks' places in groups of {unit} ranks in "
                         "this layout (a whole copy of the state; with elastic.peer_copy_every and one "
                         f"copy of the state, a TP group); set elastic.spares to a multiple of {unit}")


def keeps_survivors(cfg) -> bool:
    """Whether the survivors of a loss go on with their state (elastic.keep_survivors): as set, or,
    unset, wherever the layout leaves them a copy of it; the fastest recovery that is safe."""
    if cfg.elastic.keep_survivors is not None:
        return cfg.elastic.keep_survivors
    p = cfg.parallel
    return survivors_keep_state(p.layout, p.layout.state_replicas, cfg.elastic.peer_copy_every)


def survivors_keep_state(layout: Layout, state_replicas: int, peer_copy_every: int | None) -> bool:
    """Whether the survivors of a node loss still hold the training state to go on from: every dp
    replica holds it under ZeRO-0 without expert parallelism; otherwise a second whole copy
    (`state_replicas`: HSDP groups, groups of ep replicas) or the peer copies
    (elastic.peer_copy_every) must. The rule elastic.keep_survivors needs, at start and at every
    resize (elastic.with_replicas, which passes the copies it resizes to)."""
    return layout.dp_replica_holds_state or state_replicas >= 2 or bool(peer_copy_every)


def compiles(cfg, device_type: str) -> bool:
    """Whether the blocks are compiled: train.compile as set; unset (None), on CUDA devices where
    compile_unsupported finds nothing against it, and never on CPU, where compiling costs a run
    more than it saves (README: the first step compiles for seconds, a step gains ~1.2x)."""
    if cfg.train.compile is not None:
        return cfg.train.compile
    return device_type == "cuda" and compile_unsupported(cfg) is None
