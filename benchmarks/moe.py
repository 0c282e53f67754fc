"""Mixture-of-experts models on CPU actors: each MoE preset against the dense preset with the same
attention (what routing and experts cost per token), over the layouts raymp runs MoE in (dp,
pp), with the routing measured (load imbalance, balance loss) and the one-process loss beside
it; and the planner's memory estimate against the measured one for three MoE layouts."""

from __future__ import annotations

import statistics
import tempfile

import ray

from benchmarks.common import run_config, spread, window

LAYOUTS = {"dp1": dict(dp=1), "dp2 ZeRO-1": dict(dp=2, zero=1), "pp2 1F1B": dict(dp=1, pp=2)}
MODELS = (("tiny", "tiny-moe"), ("small", "small-moe"))
PLANNED = {"dp2 ZeRO-1": dict(dp=2, zero=1), "pp2 1F1B": dict(dp=1, pp=2),
           "dp2 ZeRO-3 + AC": dict(dp=2, zero=3, activation_checkpointing=True)}


def _cfg(name: str, out: str, preset: str, steps: int, layout: dict) -> dict:
    layout = dict(layout)
    dp, pp, zero = layout.pop("dp"), layout.pop("pp", 1), layout.pop("zero", 0)
    cfg = run_config(
        name, out, preset=preset, steps=steps, global_batch=16, seq_len=128, dp=dp, pp=pp, zero=zero
    )
    cfg["parallel"].update(layout)
    return cfg


def _fit(cfg: dict, group) -> dict:
    from raymp.config import config_from_dict
    from raymp.trainer import Trainer

    with Trainer(config_from_dict(cfg), actor_group=group, progress=False) as trainer:
        history = trainer.fit()
    return {"step_times": [m["step_time_s"] for m in history], "losses": [m["loss"] for m in history],
            "imbalance": [m.get("moe_imbalance_max") for m in history],
            "aux": [m.get("moe_aux_loss") for m in history],
            "measured_bytes": history[-1]["memory_measured_bytes_max"],
            "estimate_bytes": history[-1]["memory_estimate_bytes_max"]}


def measure(opts) -> dict:
    from raymp.config import config_from_dict
    from raymp.models import model_args
    from raymp.reference import train_single_process
    from raymp.runtime.actor_group import ActorGroup

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    groups = {1: ActorGroup(1, "cpu", cpus_per_actor=1), 2: ActorGroup(2, "cpu", cpus_per_actor=1)}
    out = tempfile.mkdtemp(prefix="raymp-bench-moe-")
    steps = opts.steps + 2  # two warm-up steps outside the timed window
    rows, raw = [], {}
    for dense, moe in MODELS:
        for layout_name, layout in LAYOUTS.items():
            world = layout["dp"] * layout.get("pp", 1)
            runs = {dense: [], moe: []}
            for _ in range(opts.reps):  # interleaved rounds: drift lands on both alike
                for preset in (dense, moe):
                    runs[preset].append(
                        _fit(_cfg(f"{preset}-{layout_name}", out, preset, steps, layout), groups[world])
                    )
            ref = train_single_process(config_from_dict(_cfg("ref", out, moe, steps, layout)))[0]
            tokens = 16 * 128
            mean = {
                p: statistics.median(window(r["step_times"])["mean"] for r in rs) for p, rs in runs.items()
            }
            last = runs[moe][-1]
            args = model_args(config_from_dict(_cfg("args", out, moe, steps, layout)).model, 256)
            dense_args = model_args(config_from_dict(_cfg("args", out, dense, steps, layout)).model, 256)
            gap = max(abs(a - b) / abs(b) for a, b in zip(last["losses"], ref))
            rows.append(
                [
                    moe,
                    f"{args.num_params / 1e6:.2f}M / {args.active_params / 1e6:.2f}M",
                    f"{args.active_params / dense_args.num_params:.2f}",
                    layout_name,
                    f"{tokens / mean[dense]:,.0f}",
                    f"{tokens / mean[moe]:,.0f}",
                    f"{mean[moe] / mean[dense]:.2f}x",
                    f"{last['imbalance'][0]:.2f} -> {last['imbalance'][-1]:.2f}",
                    f"{last['aux'][-1]:.4f}",
                    f"{last['losses'][-1]:.4f}",
                    f"{gap:.1e}",
                ]
            )
            raw[f"{moe} {layout_name}"] = {
                "runs": runs,
                "reference_losses": ref,
                "step_mean_s": {
                    p: spread(window(r["step_times"])["mean"] for r in rs) for p, rs in runs.items()
                },
            }
    planned = []
    for name, layout in PLANNED.items():
        run = _fit(_cfg(f"plan-{name}", out, "small-moe", 2, layout), groups[2])
        planned.append([f"small-moe {name}", f"{run['measured_bytes'] / 2**20:.1f}",
                        f"{run['estimate_bytes'] / 2**20:.1f}",
                        f"{(run['estimate_bytes'] - run['measured_bytes']) / run['measured_bytes']:+.1%}"])
        raw[f"planned {name}"] = run
    for group in groups.values():
        group.shutdown()
    ray.shutdown()
    return {
        "title": "11. Mixture of experts: cost per token, routing, planner memory",
        "setup": (
            f"Each MoE preset and the dense preset with its attention, global batch 16 x 128 byte tokens, "
            f"fp32, {opts.steps} timed steps after 2 warm-up ones, {opts.reps} interleaved rounds (median of "
            "the rounds' mean step), 1 CPU per actor. Routing is the MoE run's last round: the worst "
            "block's busiest expert over the mean (1.00 = balanced) at the first and last step, and the "
            "summed balance loss at the last. Loss gap: the MoE run against one process "
            "(`raymp.reference`), largest relative difference over the steps."
        ),
        "columns": [
            "MoE model",
            "params / active",
            "active / dense params",
            "layout",
            "dense tok/s",
            "MoE tok/s",
            "MoE step / dense step",
            "imbalance (max/mean)",
            "balance loss",
            "final loss",
            "loss gap vs one process",
        ],
        "rows": rows,
        "extra_tables": [
            {
                "caption": "Planner memory estimate against measured (model state + saved "
                "activations, largest rank, small-moe, 2 steps)",
                "columns": ["run", "measured (MiB)", "planner (MiB)", "planner - measured"],
                "rows": planned,
            }
        ],
        "raw": raw,
        "notes": [
            "Every rank here holds all experts of its stage; expert parallelism (ep 1 / 2 / 4) is measured by "
            "`python -m benchmarks.run_all --only ep` (section 13).",
            "Active / dense params: the MoE model's parameters a token runs through over the dense preset's "
            "(its FLOPs per token, to first order); the step-time ratio beside it adds what routing costs: "
            "the router, sorting tokens by expert, the grouped GEMM over uneven groups, the scatter back.",
        ],
    }
