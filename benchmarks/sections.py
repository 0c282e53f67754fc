"""The comparisons BENCHMARKS.md is made of, one function each. A section returns a dict:
title, what was run (setup), a table (columns, rows), notes, and the raw per-repetition numbers
behind every median (raw), so each number in the report can be traced to the runs it came from.

Each section runs in a process of its own (run_all.py), with its own Ray instance."""

from __future__ import annotations

import os
import tempfile

import ray

from benchmarks.common import global_batches, median, run_config, spread, steady, window

GIB = 2**30
MIB = 2**20


def _raymp_fit(cfg_dict: dict, group) -> dict:
    from raymp.config import config_from_dict
    from raymp.trainer import Trainer

    with Trainer(config_from_dict(cfg_dict), actor_group=group, progress=False) as trainer:
        history = trainer.fit()
    return {"step_times": [m["step_time_s"] for m in history], "losses": [m["loss"] for m in history],
            "history": history}


COMPILED, COMPILED_PEER = "raymp zero=0, compiled + fused AdamW", "Ray Train DDP, compiled + fused AdamW"
# Each raymp row and the peers it is compared with: (Ray Train's row, the plain processes' row).
PEERS = {"raymp zero=0 (DDP)": ("Ray Train DDP", "plain torch DDP"),
         "raymp zero=3 (FSDP2)": ("Ray Train FSDP2", "plain torch FSDP2"),
         COMPILED: (COMPILED_PEER, None)}


def _interleaved(variants: dict, reps: int) -> dict[str, list]:
    """Each variant once per round, rounds one after another: slow drift of a shared machine
    (another job, thermal state) lands on every variant alike instead of on whichever ran last."""
    runs = {name: [] for name in variants}
    for _ in range(reps):
        for name, fn in variants.items():
            runs[name].append(fn())
    return runs


def _max_loss_gap(losses: list[float], reference: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference))


# -- 1. data parallel: raymp vs Ray Train ---------------------------------------------------------


def data_parallel(opts) -> dict:
    """raymp at ZeRO 0 and 3 (and compiled) vs Ray Train TorchTrainer with DDP and FSDP2 and vs the
    same loop in plain torch processes, at dp=2 and dp=4 (GPU mode: every GPU), interleaved rounds."""
    gpu = opts.gpu
    worlds = [opts.gpus] if gpu else [2, 4]
    ray.init(
        address="local",
        num_cpus=None if gpu else 2 * max(worlds),
        include_dashboard=False,
        log_to_driver=False,
    )
    rows, raw = [], {}
    for world in worlds:
        section_rows, raw[f"dp{world}"] = _data_parallel_at(world, opts)
        rows += section_rows
    ray.shutdown()
    cpus = 4 if gpu else 0.5
    columns = ["dp", "run", "tokens/s (mean)", "step mean (ms)", "step median (ms)", "p95 / median",
               "max loss gap vs raymp zero=0", "raymp / Ray Train", "raymp / plain"]
    if gpu:
        columns.append("MFU")
    shape = _dp_shape(opts, worlds[0])
    return {
        "title": "1. Data parallel: raymp vs Ray Train TorchTrainer" + (" (GPU)" if gpu else ""),
        "setup": (
            f"dp={' and '.join(map(str, worlds))}, model `{shape['preset']}`, seq_len {shape['seq_len']}, "
            f"{shape['global_batch'] // worlds[0]} sequences per rank per step (one micro-batch), {opts.steps} "
            f"steps per run, the first two dropped, {opts.reps} interleaved rounds pooled; "
            + (
                "bf16, NCCL."
                if gpu
                else f"fp32, gloo, ranks x 1 thread, {cpus} CPU each (oversubscribed at dp=4 " "on 2 cores)."
            )
        ),
        "columns": columns,
        "rows": rows,
        "raw": raw,
        "notes": [
            "Every ratio is of mean step times over the whole timed window (slow steps included), as throughput: "
            "> 1 means raymp trained faster. raymp's step time is the driver's (one remote call per rank per step, "
            "results gathered, data streamed by Ray Data); the peers' is the slowest rank's own loop.",
            "Same model builder, seed, data order, AdamW and clipping on every side; the loss column is the "
            "largest relative gap to raymp zero=0 over every step of every round, so it shows the peers "
            "trained the same thing.",
            "The peers' loop (benchmarks/plain_loop.py) is written as torch's DDP and FSDP2 tutorials write "
            "it; Ray Train runs it in TorchTrainer's workers, the plain peer in spawned interpreters with a "
            "TCP rendezvous, as torchrun launches a script.",
            "Compiled rows: `train.compile` and `optimizer.fused` on raymp's side; on Ray Train's, each decoder "
            "block's `module.compile()` before DDP and the same fused AdamW. The first step (compilation) is "
            "outside the window on both sides.",
        ],
    }


def _dp_shape(opts, world: int) -> dict:
    return (
        dict(preset=opts.gpu_preset, seq_len=1024, global_batch=8 * world, device="cuda", precision="bf16")
        if opts.gpu
        else dict(preset="small", seq_len=128, global_batch=8 * world)
    )


def _data_parallel_at(world: int, opts) -> tuple[list[list], dict]:
    from raymp.runtime.actor_group import ActorGroup

    from benchmarks.peers_plain import run_plain_dp
    from benchmarks.peers_ray_train import run_dp

    gpu = opts.gpu
    cpus = 4 if gpu else 0.5  # CPU: single-threaded ranks on the machine's cores (oversubscribed on 2)
    shape = _dp_shape(opts, world)
    out = tempfile.mkdtemp(prefix="raymp-bench-dp-")
    configs = {
        z: run_config(
            f"dp{world}-zero{z}", out, dp=world, zero=z, steps=opts.steps, cpus_per_actor=cpus, **shape
        )
        for z in (0, 3)
    }
    # Both sides compiled the same way (each block, torchtitan's regional compile) with fused AdamW.
    configs["compiled"] = run_config(
        f"dp{world}-compiled",
        out,
        dp=world,
        zero=0,
        steps=opts.steps,
        cpus_per_actor=cpus,
        train={"compile": True},
        optimizer={"fused": True},
        **shape,
    )
    batches, vocab = global_batches(configs[0])
    group = ActorGroup(world, "cuda" if gpu else "cpu", cpus_per_actor=cpus)
    storage = os.path.join(out, "ray-train")
    variants = {
        "raymp zero=0 (DDP)": lambda: _raymp_fit(configs[0], group),
        "Ray Train DDP": lambda: run_dp(configs[0], batches, vocab, "ddp", world, cpus, storage, gpu),
        "raymp zero=3 (FSDP2)": lambda: _raymp_fit(configs[3], group),
        "Ray Train FSDP2": lambda: run_dp(configs[3], batches, vocab, "fsdp2", world, cpus, storage, gpu),
        COMPILED: lambda: _raymp_fit(configs["compiled"], group),
        COMPILED_PEER: lambda: run_dp(configs["compiled"], batches, vocab, "ddp", world, cpus, storage, gpu),
    }
    if not gpu:  # the plain peers run gloo on CPU ranks
        variants["plain torch DDP"] = lambda: run_plain_dp(configs[0], batches, vocab, "ddp", world)
        variants["plain torch FSDP2"] = lambda: run_plain_dp(configs[3], batches, vocab, "fsdp2", world)
    runs = _interleaved(variants, opts.reps)
    group.shutdown()
    tokens = shape["global_batch"] * shape["seq_len"]
    reference = runs["raymp zero=0 (DDP)"][0]["losses"]
    stats = {
        name: window([t for r in rs for t in steady(r["step_times"])], skip=0) for name, rs in runs.items()
    }
    rows, raw = [], {}
    for name in variants:
        st = stats[name]
        row = [
            str(world),
            name,
            f"{tokens / st['mean']:,.0f}",
            f"{st['mean'] * 1e3:.0f}",
            f"{st['median'] * 1e3:.0f}",
            f"{st['tail']:.2f}",
            f"{max(_max_loss_gap(r['losses'], reference) for r in runs[name]):.1e}",
        ]
        for peer in PEERS.get(name, (None, None)):
            row.append(f"{stats[peer]['mean'] / st['mean']:.2f}x" if peer in stats else "")
        if gpu:
            row.append(f"{_mfu(configs[0], vocab, shape, st['mean'], world, opts):.1%}")
        rows.append(row)
        raw[name] = {
            "step_times_s": [r["step_times"] for r in runs[name]],
            "losses": [r["losses"] for r in runs[name]],
        }
    return rows, raw


def _mfu(cfg_dict, vocab, shape, step_s, world, opts) -> float:
    from raymp.config import config_from_dict
    from raymp.models import model_args
    from raymp.step_time import step_flops

    args = model_args(config_from_dict(cfg_dict).model, vocab)
    return (
        step_flops(args, shape["global_batch"], shape["seq_len"]) / step_s / (opts.peak_tflops * 1e12 * world)
    )


# -- 2. orchestration overhead: raymp vs the same code as plain processes ------------------------


def orchestration(opts) -> dict:
    """raymp dp=2 x pp=2 1F1B vs raymp's own rank code launched as plain spawned processes."""
    from raymp.runtime.actor_group import ActorGroup

    from benchmarks.peers_plain import run_plain

    out = tempfile.mkdtemp(prefix="raymp-bench-orch-")
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    cfg = run_config("dp2-pp2-1f1b", out, dp=2, pp=2, steps=opts.steps, global_batch=16, seq_len=128,
                     parallel={"schedule": "1f1b"})
    batches, vocab = global_batches(cfg)
    group = ActorGroup(4, "cpu", cpus_per_actor=0.5)
    variants = {"raymp (Ray actors, driver)": lambda: _raymp_fit(cfg, group),
                "plain processes (torchrun-style, no Ray)": lambda: run_plain(cfg, batches, vocab)}
    runs = _interleaved(variants, opts.reps)
    group.shutdown()
    ray.shutdown()
    step = {name: [median(steady(r["step_times"])) for r in rs] for name, rs in runs.items()}
    reference = runs["raymp (Ray actors, driver)"][0]["losses"]
    plain = median(step["plain processes (torchrun-style, no Ray)"])
    rows = [
        [
            name,
            f"{median(v) * 1e3:.0f}",
            spread([x * 1e3 for x in v]),
            f"{median(v) / plain:.2f}x",
            f"{max(_max_loss_gap(r['losses'], reference) for r in runs[name]):.1e}",
        ]
        for name, v in step.items()
    ]
    return {
        "title": "2. Orchestration overhead: raymp vs the same code without Ray",
        "setup": (
            f"dp=2 x pp=2, 1F1B, 4 micro-batches of 4, model `small`, seq_len 128, global batch 16, fp32, "
            f"gloo, 4 ranks x 1 thread; {opts.steps} steps per run, median of steps 3..{opts.steps}, "
            f"{opts.reps} interleaved rounds. The peer runs raymp's `Worker` class (the code inside "
            "each actor) in 4 spawned interpreters with a TCP rendezvous, each looping over its steps."
        ),
        "columns": ["run", "step (ms)", "rounds (ms)", "vs plain", "max loss gap vs raymp"],
        "rows": rows,
        "raw": {
            name: {"step_times_s": [r["step_times"] for r in rs], "losses": [r["losses"] for r in rs]}
            for name, rs in runs.items()
        },
        "notes": [
            "The difference is what the single controller costs per step: one Ray call per rank, "
            "the driver gathering results (losses, pipeline events, memory), and Ray Data streaming "
            "the batches instead of a local array."
        ],
    }


# -- 3. pipeline bubble vs theory ----------------------------------------------------------------


def pipeline(opts) -> dict:
    from raymp.runtime.actor_group import ActorGroup
    from raymp.parallel.pipeline import theoretical_bubble

    from benchmarks.pipeline_bubble import measure_bubble

    pp, schedules, micro_batches = 4, ("gpipe", "1f1b", "interleaved", "zbv", "dualpipev"), (8, 16)
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    group = ActorGroup(pp, "cpu", cpus_per_actor=1, placement_timeout_s=120, collective_timeout_s=300)
    rows, raw, gaps = [], {}, []
    with tempfile.TemporaryDirectory() as out:
        for m in micro_batches:
            for schedule in schedules:
                r = measure_bubble(group, schedule, m, pp, "small", 128, opts.pipeline_steps, out)
                theory = theoretical_bubble(schedule, pp, m, 2 if schedule == "interleaved" else 1)
                rows.append([schedule, str(m), f"{theory:.1%}" if theory is not None else "no closed form",
                             f"{r['bubble']:.1%}", spread([100 * b for b in r["bubbles"]]) + " %",
                             f"{r['step_s'] * 1e3:.0f}", f"{max(r['act_mib']):.1f}"])
                raw[f"{schedule} m={m}"] = r
                if theory is not None:
                    gaps.append(r["bubble"] - theory)
    group.shutdown()
    ray.shutdown()
    return {
        "title": "3. Pipeline bubble: measured vs theory, per schedule",
        "setup": (
            f"p={pp} pipeline ranks, model `small` (8 layers), seq_len 128, micro-batch 1, fp32, "
            f"{pp} CPU actors x 1 thread on {os.cpu_count()} cores; interleaved: 2 stages per rank; "
            f"zbv/dualpipev: 2 stages per rank in a V. Bubble = idle / (ranks x makespan) from the "
            f"stages' own clocks, median of steps 2..{opts.pipeline_steps}."
        ),
        "columns": ["schedule", "m", "theory", "measured", "per step", "step (ms)", "peak activations (MiB)"],
        "rows": rows,
        "raw": raw,
        "notes": [
            "Theory is the ideal (p-1)/(m+p-1) ((p-1)/(v*m+p-1) interleaved): equal stages, free communication. "
            + _gap_note(gaps),
            "What theory leaves out and this run has: point-to-point sends through gloo between processes, "
            "unequal stages (the first holds the embedding, the last the head and the loss), and "
            f"{pp} single-threaded ranks time-sharing {os.cpu_count()} cores, so a rank can wait on a peer "
            "that is descheduled. The order between schedules (more micro-batches, interleaving, "
            "zero-bubble) is what carries over to real clusters.",
        ],
    }


def _gap_note(gaps: list[float]) -> str:
    if not gaps:
        return ""
    lo, hi = min(gaps) * 100, max(gaps) * 100
    side = "above" if lo > 0 else "below" if hi < 0 else "around"
    return f"Measured minus theory, where theory exists: {lo:+.1f} to {hi:+.1f} points ({side} theory)."


# -- 4. memory: measured model state vs the ZeRO formulas ---------------------------------------


def memory(opts) -> dict:
    from raymp.planner import zero_model_states
    from raymp.runtime.actor_group import ActorGroup

    n = 4
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    group = ActorGroup(n, "cpu", cpus_per_actor=0.5)
    rows, raw = [], {}
    out = tempfile.mkdtemp(prefix="raymp-bench-mem-")
    for precision, sizes in (("fp32", (4, 4, 8)), ("bf16", (2, 2, 12))):
        for zero in range(4):
            cfg = run_config(f"mem-z{zero}-{precision}", out, dp=n, zero=zero, steps=2, precision=precision)
            run = _raymp_fit(cfg, group)
            per_rank = run["history"][-1]["per_rank"]
            psi = _num_params(cfg)
            formula = zero_model_states(psi, zero, n, *sizes)
            state = lambda r: r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"]  # noqa: E731
            worst = max(per_rank, key=state)
            rows.append(
                [
                    precision,
                    str(zero),
                    _mib(worst["param_bytes"]),
                    _mib(formula["params"]),
                    _mib(worst["grad_bytes"]),
                    _mib(formula["grads"]),
                    _mib(worst["optim_bytes"]),
                    _mib(formula["optimizer"]),
                    _mib(state(worst)),
                    _mib(formula["total"]),
                    f"{state(worst) / formula['total']:.2f}",
                ]
            )
            raw[f"{precision} zero={zero}"] = {"psi": psi, "per_rank": [
                {k: r[k] for k in ("rank", "param_bytes", "grad_bytes", "optim_bytes")} for r in per_rank],
                "formula": formula}
    group.shutdown()
    ray.shutdown()
    return {
        "title": "4. Memory: per-rank model state vs the ZeRO formulas",
        "setup": (f"dp={n}, model `small`, measured on every rank after optimizer.step (bytes of the "
                  "parameters, gradients and optimizer state tensors it holds, shared storage counted once); "
                  "the largest rank shown. Formulas: ZeRO paper, params/grads/optimizer = "
                  "(p, g, k) x Psi, divided by N for what the stage shards; fp32: p=g=4, k=8 (Adam m, v); "
                  "bf16: p=g=2, k=12 (fp32 master copy + m + v)."),
        "columns": ["precision", "zero", "params", "formula", "grads", "formula", "optimizer", "formula",
                    "total (MiB)", "formula", "measured / formula"],
        "rows": rows, "raw": raw,
        "notes": [
            "Measured / formula above 1 is memory raymp holds beyond the paper's accounting; the causes, "
            "row by row: fp32 ZeRO-2 keeps the whole parameters gathered for compute (FSDP2 without "
            "resharding) next to the 1/N shard the optimizer updates, one copy more than the paper's fp32 "
            "count (+4 Psi/N).",
            "bf16: raymp keeps no 2-byte copy of the model state: parameters stay fp32 and are the ones the "
            "optimizer updates (cast per op by autocast at ZeRO 0/1; FSDP2 gathers each block in bf16 at "
            "2/3, and at ZeRO-2 keeps that bf16 gather), so the optimizer holds m and v only (8 bytes, no "
            "separate master copy). At ZeRO 0 and 3 the totals are the paper's; at ZeRO 1 whole fp32 "
            "parameters and gradients (8 Psi) outweigh the paper's bf16 ones (4 Psi), the cost of not "
            "keeping a master copy in the optimizer shard.",
        ],
    }


def _num_params(cfg_dict) -> int:
    from raymp.config import config_from_dict
    from raymp.models import model_spec

    cfg = config_from_dict(cfg_dict)
    return model_spec(cfg.model, 256, cfg.seed).num_params()


def _mib(b: float) -> str:
    return f"{b / MIB:.1f}"
