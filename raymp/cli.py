"""`raymp` command line: train a config, or check/print a resolved config."""

from __future__ import annotations

import argparse
import gc
import json
import sys

import yaml

from raymp.errors import user_errors
from raymp.layout import Layout  # light (the config loads it anyway); the heavy modules load per command


def _parser() -> argparse.ArgumentParser:
    from raymp.version import __version__

    parser = argparse.ArgumentParser(
        prog="raymp", description="Distributed training of large models on Ray actors.",
    )
    parser.add_argument("--version", action="version", version=f"raymp {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model from a YAML config")
    train.add_argument("config", help="path to a run config, e.g. configs/tiny.yaml")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config field, e.g. --set parallel.dp=2 (repeatable)")
    train.add_argument(
        "--no-progress", action="store_true", help="no per-step output (the final summary is still printed)"
    )

    timeline = sub.add_parser(
        "timeline", help="run a few pipeline steps and draw the last one (PNG + Chrome trace)"
    )
    timeline.add_argument("config")
    timeline.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    timeline.add_argument("--steps", type=int, default=3,
                          help="steps to run; the first includes one-off warm-up (default 3)")
    timeline.add_argument("--out", default=None, help="directory for timeline.png/.json (default: run dir)")

    planner = sub.add_parser(
        "plan", help="rank the layouts that fit a model on a cluster, with per-rank memory"
    )
    planner.add_argument("config", nargs="?", help="a run config (its model, train, precision, cluster)")
    planner.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    planner.add_argument("--model", help="a model preset, e.g. llama-70b")
    planner.add_argument("--nodes", type=int)
    planner.add_argument("--gpus-per-node", type=int)
    planner.add_argument("--gpu-memory-gb", type=float)
    planner.add_argument("--global-batch", type=int, help="sequences per step")
    planner.add_argument("--seq-len", type=int)
    planner.add_argument("--top", type=int, default=5, help="how many fitting layouts to list")
    planner.add_argument(
        "--compare",
        metavar="dp=8,pp=4,tp=2,zero=2",
        help="also explain one given layout (fits or not, and why); keys dp, dp_replicate, cp, pp, tp, "
        "ep, zero, mbs, ac, sp, schedule",
    )

    data = sub.add_parser("data", help="prepare a dataset: tokenize and pack text into parquet shards")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    prep = data_sub.add_parser(
        "prepare", help="read, tokenize (in parallel on Ray Data) and pack a corpus; prints where it went",
    )
    prep.add_argument("config", nargs="?", help="a run config: its data section and train.seq_len")
    prep.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    prep.add_argument("--source", help="'kjv', or .jsonl/.txt/.parquet files: a path or URI (s3://...)")
    prep.add_argument("--tokenizer", help="byte, gpt2, or package.module:factory")
    prep.add_argument("--seq-len", type=int, help="tokens per sample (+1 for the shifted labels)")
    prep.add_argument("--cache-dir", help="where the prepared dataset goes (path or URI)")
    prep.add_argument("--text-field", help="the text column of .jsonl/.parquet files")
    prep.add_argument(
        "--skip-bad", action="store_true", help="skip and count bad records instead of stopping"
    )

    ckpt = sub.add_parser("checkpoint", help="list a run's checkpoints, or export one as a single file")
    ckpt_sub = ckpt.add_subparsers(dest="checkpoint_command", required=True)
    listing = ckpt_sub.add_parser("list", help="committed (and unfinished) checkpoints under a directory")
    listing.add_argument("dir", help="checkpoint.dir of a run: a path or URI")
    exp = ckpt_sub.add_parser(
        "export", help="consolidate a checkpoint's sharded weights into one .safetensors or .pt file")
    exp.add_argument(
        "checkpoint", help="a committed checkpoint: <dir>/step-NNNNNNNN, or <dir> for its latest"
    )
    exp.add_argument("--out", required=True, help="output file: .safetensors, or .pt/.pth for torch.save "
                     "(with --hf: a directory)")
    exp.add_argument(
        "--hf",
        action="store_true",
        help="a Hugging Face model's checkpoint: write a from_pretrained directory (config.json + "
        "model.safetensors)",
    )

    runs = sub.add_parser("runs", help="list an experiment's MLflow runs as a table, or compare some")
    runs.add_argument("config", nargs="?", help="a run config: its tracking section and output_dir")
    runs.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    runs.add_argument("--experiment", help="experiment name (default: the config's tracking.experiment)")
    runs.add_argument(
        "--tracking-uri", help="MLflow store (default: the config's, else sqlite under output_dir)"
    )
    runs.add_argument(
        "--compare", nargs="+", metavar="RUN", help="run ids, id prefixes or names to put side by side"
    )
    runs.add_argument(
        "--plot", metavar="PNG", help="with --compare: draw their loss, tokens/s and peak memory here"
    )
    runs.add_argument("--limit", type=int, default=50, help="newest runs to list (default 50)")

    sweep = sub.add_parser(
        "sweep", help="search config fields on Ray Tune: each trial a run, all nested in MLflow"
    )
    sweep.add_argument("sweep", help="path to a sweep file, e.g. configs/sweeps/tiny-lr.yaml (with "
                       "--layouts: a run config)")
    sweep.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a field of the sweep's base config, for every trial (repeatable)")
    sweep.add_argument("--layouts", type=int, metavar="N",
                       help="measure the planner's N best layouts of the run config's cluster: section, a "
                       "few steps each, pick the fastest and save the measured prices for the next plan")

    show = sub.add_parser("config", help="validate a config and print it fully resolved")
    show.add_argument("config")
    show.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)  # before any heavy import: --version, --help and typos stay fast
    from raymp.config import load_config, resolved_dict

    try:
        if args.command == "plan":
            return _plan(args)
        if args.command == "data":
            return _prepare_data(args)
        if args.command == "checkpoint":
            return _checkpoint(args)
        if args.command == "runs":
            return _runs(args)
        if args.command == "sweep":
            return _sweep(args)
        cfg = load_config(args.config, args.overrides)
        if args.command == "config":
            print(yaml.safe_dump(resolved_dict(cfg), sort_keys=False), end="")
            return 0
        from raymp.driver.stopping import stop_on_signals
        from raymp.trainer import Trainer

        if args.command == "timeline":
            return _timeline(cfg, args)
        stop_on_signals()  # from here: a stop while the run is set up too (kept across ray.init)
        with Trainer(cfg, progress=not args.no_progress) as trainer:
            trainer.setup()
            trainer.fit()
            if args.no_progress:  # the outcome and where it is recorded are not progress
                print(trainer.summary())
        return 0
    except Exception as exc:
        if not isinstance(exc, user_errors()):
            raise
        print(f"raymp: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        from raymp.driver.stopping import stop_signal

        stopped_by = stop_signal()
        print(f"raymp: stopped by {stopped_by.name}; the MLflow run is marked KILLED", file=sys.stderr)
        return 128 + stopped_by  # as a shell reports a process its signal ended: 130 SIGINT, 143 SIGTERM


def _sweep(args) -> int:
    if args.layouts is not None:
        return _search_layouts(args)
    from raymp.sweeps import sweep

    result = sweep(args.sweep, args.overrides, stop_signals=True)
    print(result.table())
    for trial in result.trials:
        if trial.error:
            print(f"trial {trial.trial_id} failed: {trial.error}")
    if result.best is None:
        print(f"raymp: error: no trial of sweep {result.name} reported {result.metric}", file=sys.stderr)
        return 1
    print(f"best: trial {result.best.trial_id}, {result.metric}={result.best.value:.4g}, "
          + ", ".join(f"{k}={v}" for k, v in result.best.params.items())
          + (f"; MLflow parent run {result.parent_run_id}" if result.parent_run_id else ""))
    return 0


def _search_layouts(args) -> int:
    from raymp.sweeps import search_layouts

    found = search_layouts(args.sweep, args.overrides, layouts=args.layouts)
    print(found.table())
    print(
        f"saved the measured prices for the next `raymp plan` / parallel: auto of this config: {found.saved}"
    )
    if found.best is None:
        print("raymp: error: no layout of the search ran to its end", file=sys.stderr)
        return 1
    print(f"fastest: {found.best.layout.text(detail=True)}, {found.best.measured_s * 1e3:.0f} ms a step; "
          f"its parallel section: {json.dumps(found.best.layout.as_parallel())}")
    return 0


def _prepare_data(args) -> int:
    from raymp.config import load_config
    from raymp.data.prepare import describe, prepare

    cfg = load_config(args.config, args.overrides)
    d = cfg.data
    source = args.source or d.source
    root, manifest = prepare(
        source, tokenizer=args.tokenizer or d.tokenizer, seq_len=args.seq_len or cfg.train.seq_len,
        cache_dir=args.cache_dir or d.cache_dir, cpu_wait_s=cfg.resources.placement_timeout_s,
        text_field=args.text_field or d.text_field,
        skip_bad=args.skip_bad or d.on_bad_data == "skip", log=lambda *_: None,
    )
    print(describe(manifest))
    print(f"dataset: {root}")
    print(f"train on it with: --set data.source={root}  (or keep data.source={source!r}: the cache is found)")
    return 0


def _runs(args) -> int:
    from raymp.config import ConfigError, load_config
    from raymp.runs import compare_runs, format_rows, list_runs, plot_comparison
    from raymp.tracking_store import check_tracking_store, tracking_uri

    cfg = load_config(args.config, args.overrides)
    uri = args.tracking_uri or tracking_uri(cfg)
    check_tracking_store(uri, cfg.tracking.connect_timeout_s, reading=True)
    experiment = args.experiment or cfg.tracking.experiment
    if args.plot and not args.compare:
        raise ConfigError("--plot draws the runs given with --compare; add --compare RUN [RUN ...]")
    if args.compare:
        print(compare_runs(uri, experiment, args.compare))
        if args.plot:
            print(
                "loss, tokens/s and peak memory by step: "
                f"{plot_comparison(uri, experiment, args.compare, args.plot)}"
            )
        return 0
    rows = list_runs(uri, experiment, args.limit)
    print(f"experiment {experiment!r} in {uri}: {len(rows)} run(s), newest first")
    print(format_rows(rows))
    return 0


def _checkpoint(args) -> int:
    from raymp.checkpoint.store import MARKER, CheckpointError, CheckpointStore
    from raymp.storage import fsspec_fs

    if args.checkpoint_command == "list":
        fs, inner = fsspec_fs(args.dir)
        if not fs.isdir(inner):
            raise CheckpointError(f"{args.dir} is not a directory; give a run's checkpoint.dir "
                                  "(runs/<run>/checkpoints by default)")
        store = CheckpointStore(args.dir)
        entries = store.scan()
        for e in entries:
            if e.problem:
                print(f"{e.path}  damaged: {e.problem}")
            elif e.checkpoint is None:
                print(f"{e.path}  unfinished (no {MARKER}): never loaded, deleted by the next save's prune")
            else:
                c = e.checkpoint
                layout, pos = c.meta["layout"], c.data_position
                problems = store.problems(c)
                state = f"damaged: {problems[0]}" if problems else "verified"
                print(f"{c.path}  step {c.step}  {Layout.from_record(layout).text()}  epoch {pos['epoch']} "
                      f"offset {pos['offset']}  {state}")
        if not any(e.checkpoint for e in entries):
            print(f"no committed checkpoint under {args.dir}")
        return 0
    from raymp.checkpoint.export import export, export_hf_dir

    path = args.checkpoint
    if args.hf:
        info = export_hf_dir(path, args.out)
        done = f"a Hugging Face {info['model_type']} directory of {info['tensors']} tensors"
    else:
        info = export(path, args.out)
        done = (f"{info['tensors']} tensors, {info['parameters'] / 1e6:.2f}M parameters, "
                f"{info['bytes'] / 2**20:.1f} MiB")
    for damaged in info["passed_over"]:
        print(f"checkpoint: passed over damaged {damaged}", file=sys.stderr)
    print(f"exported step {info['step']} of {info['source']}: {done} -> {info['path']}")
    return 0


def _plan(args) -> int:
    from raymp.config import apply_overrides, config_from_dict, read_config_file
    from raymp.models import model_args
    from raymp.models.shape import TOKENIZER_VOCAB, model_shape
    from raymp.calibration import planning_cluster
    from raymp.planner import explain, format_plan, plan

    compare = _compared_layout(args.compare) if args.compare else None  # a typo fails before any output
    data = apply_overrides(read_config_file(args.config) if args.config else {}, args.overrides)
    own = data.pop("parallel", None)  # the plan chooses it; a config's own layout is explained first
    if args.model:
        data["model"] = {"preset": args.model}
    cluster = dict(data.get("cluster") or {})
    for key in ("nodes", "gpus_per_node", "gpu_memory_gb"):
        if getattr(args, key) is not None:
            cluster[key] = getattr(args, key)
    data["cluster"] = cluster
    train = dict(data.get("train") or {})
    if args.global_batch:
        train["global_batch_size"] = args.global_batch
    if args.seq_len:
        train["seq_len"] = args.seq_len
    data["train"] = train
    data.setdefault("precision", "bf16")
    model = data.get("model") or {}
    if train.get("seq_len") and not (model.get("hf") or model.get("hf_config")):
        # Plan for the context asked for, whatever the preset's default (a Hugging Face model's
        # length is its config's max_position_embeddings, which the config checks seq_len against).
        data["model"] = {**model, "max_seq_len": train["seq_len"]}
    cfg = config_from_dict(data)
    vocab = cfg.model.vocab_size or TOKENIZER_VOCAB.get(cfg.data.tokenizer, 256)
    margs = model_args(cfg.model, vocab)
    shape = model_shape(cfg.model, vocab, cfg.data.tokenizer)
    spec, measured = planning_cluster(cfg.cluster, cfg.output_dir)
    bf16 = cfg.bf16
    print(f"{cfg.model.preset or 'model'}: {margs.num_params / 1e9:.2f}B parameters on "
          f"{spec.nodes} x {spec.gpus_per_node} devices of {spec.gpu_memory_gb:g} GB; global batch "
          f"{cfg.train.global_batch_size} x {cfg.train.seq_len} tokens; {cfg.precision}")
    if measured:
        print(measured)
    result = plan(margs, spec, cfg.train.global_batch_size, cfg.train.seq_len, bf16, shape=shape)
    if isinstance(own, dict):  # the config's own layout, then the plan's
        own_layout = config_from_dict({**data, "parallel": own}).parallel.layout
        print(explain(margs, own_layout, spec, cfg.train.global_batch_size, cfg.train.seq_len, bf16, result,
                      shape, label="This config's layout"))
    print(format_plan(result, args.top))
    if compare is not None:
        print(
            explain(margs, compare, spec, cfg.train.global_batch_size, cfg.train.seq_len, bf16, result, shape)
        )
    return 0


_COMPARE_INTS = {"dp": 1, "dp_replicate": 1, "cp": 1, "pp": 1, "tp": 1, "ep": 1, "zero": 0, "mbs": 1}
_COMPARE_BOOLS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False,
                  "0": False}


def _compared_layout(text: str):
    """`raymp plan --compare dp=8,pp=4,...` as a Layout; a key or value it does not know is an
    error naming it, never a default taken in its place."""
    from raymp.config import ConfigError

    keys = (*_COMPARE_INTS, "ac", "sp", "schedule")
    fields = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not value:
            raise ConfigError(
                f"--compare {text!r}: {item!r} is not key=value; write it as dp=8,pp=4,tp=2,zero=2"
            )
        if key not in keys:
            raise ConfigError(f"--compare {text!r}: unknown key {key!r}; the keys are {', '.join(keys)}")
        if key in _COMPARE_INTS and not value.isdigit():
            raise ConfigError(f"--compare {text!r}: {key}={value} is not a whole number")
        if key in ("ac", "sp") and value.lower() not in _COMPARE_BOOLS:
            raise ConfigError(f"--compare {text!r}: {key}={value} is not true/false (or yes/no, 1/0)")
        fields[key] = value
    ints = {k: int(fields.get(k, default)) for k, default in _COMPARE_INTS.items()}
    return Layout(
        ints["dp"],
        ints["pp"],
        ints["tp"],
        ints["zero"],
        ints["mbs"],
        _COMPARE_BOOLS[fields.get("ac", "false").lower()],
        _COMPARE_BOOLS[fields.get("sp", "false").lower()],
        fields.get("schedule", "1f1b"),
        cp=ints["cp"],
        ep=ints["ep"],
        dp_replicate=ints["dp_replicate"],
    )


def _timeline(cfg, args) -> int:
    from raymp.config import ConfigError, derived
    from raymp.trainer import Trainer

    if cfg.parallel.pp == 1:
        raise ConfigError("raymp timeline draws a pipeline: set parallel.pp > 1 (e.g. --set parallel.pp=2)")
    # A short look, not a run to keep: no MLflow run, and no more steps than asked for.
    cfg = derived(cfg, {"train.steps": max(args.steps, cfg.train.steps), "tracking.enabled": False})
    with Trainer(cfg, progress=False) as trainer:
        for _ in range(args.steps):
            metrics = trainer.step()
        paths = trainer.timeline(args.out)
    theory = metrics["bubble_fraction_theory"]
    print(f"step {metrics['step']}: bubble {metrics['bubble_fraction']:.1%}"
          + (f" (theory {theory:.1%})" if theory is not None else "")
          + f", stage busy {', '.join(f'{b * 1e3:.0f}' for b in metrics['stage_busy_s'])} ms")
    print(f"timeline: {paths['png']}\nChrome trace: {paths['trace']} (open in ui.perfetto.dev)")
    return 0


def console() -> None:
    """The `raymp` command: main(), then an exit that skips the interpreter's last garbage
    collection. That collection walks every object torch, Ray and MLflow made, frees nothing the
    process's end would not, and took seconds at the end of every run and every stop (py-spy:
    gc_collect_main after Ray's teardown). Frozen objects are left to the operating system.
    Callers of main() in a process that goes on keep their collector."""
    code = main()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    console()
