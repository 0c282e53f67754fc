"""`raymp` command line: train a config, or check/print a resolved config."""

from __future__ import annotations

import argparse
import sys

import yaml


def _parser() -> argparse.ArgumentParser:
    from raymp import __version__

    parser = argparse.ArgumentParser(
        prog="raymp", description="Distributed training of large models on Ray actors.",
    )
    parser.add_argument("--version", action="version", version=f"raymp {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model from a YAML config")
    train.add_argument("config", help="path to a run config, e.g. configs/tiny.yaml")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config field, e.g. --set parallel.dp=2 (repeatable)")
    train.add_argument("--no-progress", action="store_true", help="no progress output")

    timeline = sub.add_parser(
        "timeline", help="run a few pipeline steps and draw the last one (PNG + Chrome trace)"
    )
    timeline.add_argument("config")
    timeline.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    timeline.add_argument("--steps", type=int, default=3,
                          help="steps to run; the first includes one-off warm-up (default 3)")
    timeline.add_argument("--out", default=None, help="directory for timeline.png/.json (default: run dir)")

    show = sub.add_parser("config", help="validate a config and print it fully resolved")
    show.add_argument("config")
    show.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    return parser


def main(argv: list[str] | None = None) -> int:
    from raymp.config import ConfigError, load_config, resolved_dict
    from raymp.data import DataError
    from raymp.runtime.actor_group import PlacementError
    from raymp.trainer import WorkerLostError

    args = _parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if args.command == "config":
            print(yaml.safe_dump(resolved_dict(cfg), sort_keys=False), end="")
            return 0
        from raymp.trainer import Trainer

        if args.command == "timeline":
            return _timeline(cfg, args)
        with Trainer(cfg, progress=not args.no_progress) as trainer:
            trainer.fit()
        return 0
    except (ConfigError, DataError, PlacementError, WorkerLostError) as exc:
        print(f"raymp: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("raymp: interrupted", file=sys.stderr)
        return 130


def _timeline(cfg, args) -> int:
    from raymp.config import ConfigError, config_from_dict, resolved_dict
    from raymp.trainer import Trainer

    if cfg.parallel.pp == 1:
        raise ConfigError("raymp timeline draws a pipeline: set parallel.pp > 1 (e.g. --set parallel.pp=2)")
    # A short look, not a run to keep: no MLflow run, and no more steps than asked for.
    cfg = config_from_dict(resolved_dict(cfg), [f"train.steps={max(args.steps, cfg.train.steps)}",
                                               "tracking.enabled=false"])
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


if __name__ == "__main__":
    sys.exit(main())
