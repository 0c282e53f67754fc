"""9. The planner's step-time estimates against measured step times, on this machine's CPU actors.

The planner (raymp/step_time.py: step_seconds) prices a layout from three measurements, none of
them a layout it is then judged on: the FLOP/s of one actor training `small` alone (its compute
rate), and gloo's bandwidth and per-message latency between two actors (all-reduces of 16 MiB and
of 4 bytes). Calibrated, it also scales each mechanism's price by a cost factor measured on the
same layouts at a smaller global batch. It then estimates every world-2 layout below at the
judged batch; each is trained and timed on the same actors. The table gives the error per layout
and whether the estimates rank the layouts as the measurements do (Spearman's rank correlation),
priced and calibrated."""

from __future__ import annotations

import tempfile
import time

import ray
import torch
import torch.distributed as dist

from benchmarks.common import median, run_config, steady
from benchmarks.sections import _raymp_fit

LAYOUTS = {
    "dp2 ZeRO-0": dict(dp=2, zero=0),
    "dp2 ZeRO-3": dict(dp=2, zero=3),
    "dp2 ZeRO-1 + AC": dict(dp=2, zero=1, activation_checkpointing=True),
    "pp2 GPipe": dict(pp=2, schedule="gpipe", micro_batch_size=2),
    "pp2 1F1B": dict(pp=2, schedule="1f1b", micro_batch_size=2),
    "tp2": dict(tp=2),
    "tp2 + SP": dict(tp=2, sequence_parallel=True),
    "cp2": dict(cp=2),
}
GLOBAL_BATCH, SEQ_LEN = 16, 128
CALIBRATION_BATCH = 8  # the cost factors are measured at this global batch, the judged runs at GLOBAL_BATCH


@ray.remote(num_cpus=1)
class _LinkProbe:
    """Two of these measure gloo between actors as the training ranks see it."""

    def address(self):
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def measure(self, rank: int, addr: str, port: int) -> tuple[float, float]:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=2)
        times = {}
        for name, numel in (("big", 4 * 2**20), ("small", 1)):
            x = torch.ones(numel)
            for _ in range(3):
                dist.all_reduce(x)
            t0 = time.perf_counter()
            for _ in range(10):
                dist.all_reduce(x)
            times[name] = (time.perf_counter() - t0) / 10
        dist.destroy_process_group()
        # A ring all-reduce moves 2 (n-1)/n of the buffer per rank: with n = 2, the buffer itself.
        return 16 * 2**20 / times["big"] / 1e9, times["small"]


def _link() -> tuple[float, float]:
    probes = [_LinkProbe.remote() for _ in range(2)]
    addr, port = ray.get(probes[0].address.remote())
    results = ray.get([p.measure.remote(r, addr, port) for r, p in enumerate(probes)])
    for p in probes:
        ray.kill(p)
    return min(r[0] for r in results), max(r[1] for r in results)


def _measured_step(cfg: dict, group) -> tuple[float, float]:
    run = _raymp_fit(cfg, group)
    return median(steady(run["step_times"])), run["losses"][-1]


def _layouts(out: str, common: dict, global_batch: int):
    """(name, run config, layout) of every judged layout at this global batch."""
    from raymp.config import config_from_dict

    for name, parallel in LAYOUTS.items():
        extra = {k: v for k, v in parallel.items() if k not in ("dp", "pp", "zero", "micro_batch_size")}
        run = run_config(
            f"planner-{name}-{global_batch}",
            out,
            **{**common, "global_batch": global_batch, "micro_batch": parallel.get("micro_batch_size", 4)},
            dp=parallel.get("dp", 1),
            pp=parallel.get("pp", 1),
            zero=parallel.get("zero", 0),
            parallel=extra,
        )
        yield name, run, config_from_dict(run).parallel.layout


def _ranks(values: list[float]) -> list[int]:
    order = sorted(range(len(values)), key=values.__getitem__)
    return [order.index(i) + 1 for i in range(len(values))]


def _spearman(a: list[float], b: list[float]) -> float:
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(_ranks(a), _ranks(b))) / (n * (n * n - 1))


def measure(opts) -> dict:
    from dataclasses import replace

    from raymp.config import config_from_dict
    from raymp.models import model_args
    from raymp.runtime.actor_group import ActorGroup
    from raymp.step_time import Cluster, calibrate_cost_factors, step_flops, step_seconds

    out = tempfile.mkdtemp(prefix="raymp-bench-planner-")
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    steps = max(6, opts.steps)
    common = dict(steps=steps, global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN, micro_batch=4, cpus_per_actor=1)
    gbps, latency = _link()
    one = ActorGroup(1, "cpu", cpus_per_actor=1)
    single_cfg = run_config("planner-dp1", out, **common)
    single_s, _ = _measured_step(single_cfg, one)
    one.shutdown()
    args = model_args(config_from_dict(single_cfg).model, 256)
    flops_per_s = step_flops(args, GLOBAL_BATCH, SEQ_LEN) / single_s
    priced = Cluster(nodes=1, gpus_per_node=2, gpu_tflops=flops_per_s / 1e12, achievable_mfu=1.0,
                     intra_node_gbps=gbps, inter_node_gbps=gbps, message_latency_s=latency)
    group = ActorGroup(2, "cpu", cpus_per_actor=1)
    samples = []
    for _, run, layout in _layouts(out, common, CALIBRATION_BATCH):
        samples.append((layout, step_seconds(args, layout, priced, CALIBRATION_BATCH, SEQ_LEN, bf16=False),
                        _measured_step(run, group)[0]))
    factors = calibrate_cost_factors(samples)
    calibrated = replace(priced, cost_factors=factors)
    rows, est_priced, est_cal, measured = [], [], [], []
    for name, run, layout in _layouts(out, common, GLOBAL_BATCH):
        before = step_seconds(args, layout, priced, GLOBAL_BATCH, SEQ_LEN, bf16=False)["step_s"]
        est = step_seconds(args, layout, calibrated, GLOBAL_BATCH, SEQ_LEN, bf16=False)
        got, loss = _measured_step(run, group)
        est_priced.append(before)
        est_cal.append(est["step_s"])
        measured.append(got)
        comm = est["step_s"] - est["compute_s"]
        rows.append(
            [
                name,
                f"{before * 1e3:.0f}",
                f"{est['step_s'] * 1e3:.0f}",
                f"{comm * 1e3:.0f}",
                f"{got * 1e3:.0f}",
                f"{(before - got) / got:+.0%}",
                f"{(est['step_s'] - got) / got:+.0%}",
                f"{loss:.4f}",
            ]
        )
    group.shutdown()
    ray.shutdown()
    for row, a, b, c in zip(rows, _ranks(est_priced), _ranks(est_cal), _ranks(measured)):
        row[7:7] = [str(a), str(b), str(c)]

    def summary(estimated):
        errors = [abs(e - m) / m for e, m in zip(estimated, measured)]
        return f"median error {median(errors):.0%}, worst {max(errors):.0%}, rank agreement (Spearman) " \
               f"{_spearman(estimated, measured):.2f}"

    factor_text = ", ".join(f"{k} {v:.1f}" for k, v in factors.items())
    return {
        "title": "9. Planner: estimated vs measured step time, world-2 layouts",
        "setup": (
            f"model `small`, global batch {GLOBAL_BATCH} x {SEQ_LEN} tokens, fp32, 2 CPU actors x 1 thread, "
            f"median of steps 3..{steps}. Priced: one actor alone trains at {flops_per_s / 1e9:.1f} GFLOP/s "
            f"({single_s * 1e3:.0f} ms per step); gloo between two actors: {gbps:.2f} GB/s, "
            f"{latency * 1e6:.0f} us per small message. Calibrated: the same, with each mechanism's cost "
            f"factor measured on the same layouts at global batch {CALIBRATION_BATCH} (not the judged runs): "
            f"{factor_text}. Priced: {summary(est_priced)}. Calibrated: {summary(est_cal)}."
        ),
        "columns": [
            "layout",
            "priced estimate (ms)",
            "calibrated estimate (ms)",
            "of which communication (ms)",
            "measured (ms)",
            "error priced",
            "error calibrated",
            "rank priced",
            "rank calibrated",
            "rank measured",
            "final loss",
        ],
        "rows": rows,
        "raw": {
            "priced_s": dict(zip(LAYOUTS, est_priced)),
            "calibrated_s": dict(zip(LAYOUTS, est_cal)),
            "measured_s": dict(zip(LAYOUTS, measured)),
            "calibration": {
                "flops_per_s": flops_per_s,
                "gbps": gbps,
                "latency_s": latency,
                "single_step_s": single_s,
                "cost_factors": factors,
                "calibration_steps_s": {n: m for n, (_, _, m) in zip(LAYOUTS, samples)},
            },
        },
        "notes": [
            "Priced is the planner as it prices any cluster: compute as FLOPs at one rate for every layout, the "
            "pipeline bubble by schedule, each collective by bytes over bandwidth plus a per-message latency. "
            "What a CPU actor pays besides (DTensor's per-op dispatch under TP and FSDP2, smaller matrices per "
            "rank under TP, gloo's collectives on the same cores as the compute, no overlap) is what the cost "
            "factors measure. `cluster.cost_factors` in a config gives them to `raymp plan` and `parallel: auto`.",
            "Each factor is taken from the layouts that use its mechanism alone (measured less estimated "
            "compute, over the mechanism's price), cp's after ddp's (cp2 also reduces gradients over its ranks).",
            "The judged runs differ from the calibration runs in their batch only (twice the micro-batches per "
            "rank), so this shows the factors carry over to another batch on this machine and model; across "
            "model sizes and world sizes they are not measured here. Calibrate on the cluster and model you plan for.",
        ],
    }
