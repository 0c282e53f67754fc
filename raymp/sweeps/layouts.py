"""A layout search by measurement (`raymp sweep --layouts N CONFIG`, `raymp.search_layouts`): the
planner's N best layouts that fit, each trained for a few steps as a trial of one sweep, and the
fastest measured one picked; the planner's estimate and the measurement side by side, and what
was measured saved (raymp.calibration) so the next plan for this config prices layouts with it.

The planner prices compute from a FLOP/s it is told and communication by bytes over bandwidth,
so on other hardware its ranking can be off (4-29% per layout on CPU actors, BENCHMARKS.md
section 9). So first one actor trains the model alone: its FLOP/s is the compute rate every
estimate then uses. The layouts are chosen and estimated at that rate and measured one at a time
(trials side by side would slow each other down); each mechanism's cost factor is then the
measured time less the estimated compute, over the mechanism's price
(step_time.calibrate_cost_factors)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from typing import Any

from raymp.calibration import Calibration, save_calibration
from raymp.config import ConfigError, RunConfig
from raymp.config.loading import config_from_dict
from raymp.driver.launch import as_config
from raymp.driver.summary import steady_median
from raymp.layout import Layout
from raymp.models import model_args
from raymp.models.shape import TOKENIZER_VOCAB, model_shape
from raymp.planner import Candidate, judge, plan
from raymp.ray_connection import connect
from raymp.step_time import calibrate_cost_factors, cluster_from_config, step_flops, step_seconds
from raymp.sweeps.run import sweep, trial_cpus
from raymp.sweeps.trial import STEADY_STEP_S
from raymp.tracking_store import tracking_uri
from raymp.trainer import Trainer

DEFAULT_STEPS = 6  # per layout: the steady half of them is what is compared


@dataclass
class MeasuredLayout:
    layout: Layout
    estimate_s: float  # the planner's step time at the measured compute rate, as priced
    calibrated_s: float  # the same with the cost factors this search measured
    measured_s: float | None  # the median step time of the trial's steady half
    loss: float | None  # the trial's last loss: every layout trains the same thing
    status: str
    run_id: str


@dataclass
class LayoutSearch:
    layouts: list[MeasuredLayout]  # in the planner's order
    compute_tflops: float
    cost_factors: dict[str, float]
    saved: str  # where the calibration went
    parent_run_id: str | None

    @property
    def best(self) -> MeasuredLayout | None:
        measured = [m for m in self.layouts if m.measured_s is not None]
        return min(measured, key=lambda m: m.measured_s) if measured else None

    def table(self) -> str:
        head = ["plan", "layout", "estimate ms", "calibrated ms", "measured ms", "measured/estimate",
                "loss", "status"]
        rows = []
        for i, m in enumerate(self.layouts, 1):
            got = m.measured_s
            rows.append([str(i), m.layout.text(detail=True), f"{m.estimate_s * 1e3:.0f}",
                         f"{m.calibrated_s * 1e3:.0f}", "-" if got is None else f"{got * 1e3:.0f}",
                         "-" if got is None else f"{got / m.estimate_s:.2f}",
                         "-" if m.loss is None else f"{m.loss:.4f}",
                         m.status + (" (fastest)" if m is self.best else "")])
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
        return "\n".join([line(head), *(line(r) for r in rows)])


def search_layouts(config: RunConfig | str | dict, overrides: list[str] | None = None, *, layouts: int = 3,
                   steps: int = DEFAULT_STEPS, log=print) -> LayoutSearch:
    """Measure the planner's `layouts` best layouts of the config's `cluster:` (its nodes x
    gpus_per_node actors) for `steps` steps each, and save what was measured under the config's
    output_dir. The config's own `parallel` section is replaced by each layout in turn."""
    if layouts < 1 or steps < 2:
        raise ConfigError(f"a layout search needs at least 1 layout and 2 steps (got {layouts}, {steps})")
    cfg = as_config(config, overrides)
    if cfg.cluster is None:
        raise ConfigError("a layout search plans for the config's cluster section: cluster.nodes x "
                          "cluster.gpus_per_node actors of cluster.gpu_memory_gb each; add one, e.g. "
                          "--set cluster.gpus_per_node=4")
    dumped = cfg.model_dump(mode="json")
    world = cfg.cluster.nodes * cfg.cluster.gpus_per_node
    vocab = cfg.model.vocab_size or TOKENIZER_VOCAB.get(cfg.data.tokenizer, 256)
    args, shape = model_args(cfg.model, vocab), model_shape(cfg.model, vocab, cfg.data.tokenizer)
    gb, seq = cfg.train.global_batch_size, cfg.train.seq_len
    mbs = next(m for m in (4, 2, 1) if gb % m == 0)
    alone = Layout(1, 1, 1, 0, mbs, False)
    cluster = cluster_from_config(cfg.cluster)
    one_device = judge(args, alone, cluster, gb, seq, cfg.bf16)
    if not one_device.fits:
        raise ConfigError(
            f"a layout search measures the compute rate on one device, and this model needs "
            f"{one_device.peak_bytes / 1e9:.1f} GB there (cluster.gpu_memory_gb="
            f"{cfg.cluster.gpu_memory_gb:g}); plan with "
            "`raymp plan` and set cluster.cost_factors from BENCHMARKS.md's planner check instead"
        )
    common = [f"train.steps={steps}", "checkpoint.every=0", "train.eval_batches=0"]
    connect(cfg.resources.address, trial_cpus(cfg, world))

    seconds = _one_actor_step_s(dumped, [*common, f"parallel={json.dumps(alone.as_parallel())}"])
    rate = step_flops(args, gb, seq) / seconds
    log(f"layout search: one actor trains {cfg.model.preset or 'the model'} at "
        f"{rate / 1e9:.3g} GFLOP/s ({seconds * 1e3:.0f} ms a step)")
    priced = replace(cluster, gpu_tflops=rate / 1e12, achievable_mfu=1.0, cost_factors={})
    top = _top_candidates(plan(args, priced, gb, seq, cfg.bf16, shape=shape), layouts)
    chosen = [c.layout for c in top]
    if not chosen:
        raise ConfigError(
            f"no layout of {cfg.cluster.nodes} x {cfg.cluster.gpus_per_node} devices with "
            f"{cfg.cluster.gpu_memory_gb:g} GB fits; run `raymp plan` on this config to see why"
        )
    estimates = [c.time for c in top]  # the plan's own estimates, at the measured compute rate
    spec = {
        "name": f"{cfg.name}-layouts",
        "space": {"parallel": {"grid": [lay.as_parallel() for lay in chosen]}},
        "metric": "step_time_s",
        "mode": "min",
        "asha": None,
        "max_concurrent": 1,
    }
    result = sweep(spec, common, base={**dumped, "parallel": chosen[0].as_parallel()}, log=log)
    by_layout = {_key(t.params.get("parallel")): t for t in result.trials}
    trials = [by_layout.get(_key(lay.as_parallel())) for lay in chosen]
    measured = [
        t.last.get(STEADY_STEP_S) if t is not None and t.status == "completed" else None for t in trials
    ]
    factors = calibrate_cost_factors([(lay, est, got) for lay, est, got in zip(chosen, estimates, measured)
                                      if got is not None])
    calibrated = replace(priced, cost_factors=factors)
    rows = [
        MeasuredLayout(
            lay,
            est["step_s"],
            step_seconds(args, lay, calibrated, gb, seq, cfg.bf16)["step_s"],
            got,
            t.last.get("loss") if t else None,
            t.status if t else "not run",
            t.run_id if t else "",
        )
        for lay, est, got, t in zip(chosen, estimates, measured, trials)
    ]
    saved = save_calibration(cfg.output_dir, Calibration(
        cfg.cluster.nodes, cfg.cluster.gpus_per_node, rate / 1e12, factors,
        time.strftime("%Y-%m-%d %H:%M:%S"), [lay.text(detail=True) for lay in chosen]))
    found = LayoutSearch(rows, rate / 1e12, factors, saved, result.parent_run_id)
    if result.parent_run_id:
        _record_in_parent(cfg, result.parent_run_id, found)
    return found


def _record_in_parent(cfg: RunConfig, run_id: str, found: LayoutSearch) -> None:
    """The table (each estimate beside its measurement) and the pick, on the sweep's MLflow
    parent run: the trials beneath it are the measurements."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri(cfg))
    client.log_text(run_id, found.table() + "\n", "layouts.txt")
    if found.best is not None:
        client.set_tag(run_id, "raymp.fastest_layout", found.best.layout.text(detail=True))


def _one_actor_step_s(dumped: dict, overrides: list[str]) -> float:
    """The steady step time of the model trained by one actor (no MLflow run of its own)."""
    cfg = config_from_dict(dumped, [*overrides, "tracking.enabled=false"])
    with Trainer(cfg, progress=False) as trainer:
        history = trainer.fit()
    return steady_median(history, "step_time_s")


def _top_candidates(result, n: int) -> list[Candidate]:
    """The planner's n fastest layouts that fit, one per split of the devices and ZeRO stage (its
    best micro-batch size and recomputation choice): n variants of one layout would measure one
    thing n times."""
    chosen, seen = [], set()
    for candidate in result.feasible:
        lay = candidate.layout
        split = (lay.dp, lay.dp_replicate, lay.cp, lay.pp, lay.tp, lay.zero)
        if split not in seen:
            seen.add(split)
            chosen.append(candidate)
        if len(chosen) == n:
            break
    return chosen


def _key(parallel: Any) -> str:
    return json.dumps(parallel, sort_keys=True)
