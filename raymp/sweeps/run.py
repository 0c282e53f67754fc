"""Running a sweep on Ray Tune: the search space in Tune's terms, how many trials run at once,
the MLflow parent run, and the result (every trial, the best one) as a table.

Each trial's actors are reserved by raymp's own placement groups, not by Tune's per-trial
placement group: raymp re-places bundles after a node loss and grows into free ones, which a
placement group Tune owns would not allow. So the trial itself holds no CPU, and the sweep limits
how many trials run at once to what the cluster holds."""

from __future__ import annotations

import importlib.util
import logging
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray import tune
from ray.tune import PlacementGroupFactory
from ray.tune.schedulers import ASHAScheduler
from ray.tune.search.optuna import OptunaSearch  # imports optuna only when it is installed

from raymp.config import ConfigError, RunConfig
from raymp.driver.launch import as_config
from raymp.driver.stopping import stop_on_signals
from raymp.logs import quiet_loggers
from raymp.ray_connection import connect, starts_local
from raymp.sweeps.parent import ParentRun
from raymp.sweeps.spec import SweepSpec, check_spec, load_sweep, spec_from_dict
from raymp.sweeps.trial import RUN_ID, STEPS_DONE, RaympTrial


@dataclass
class Trial:
    trial_id: str
    params: dict[str, Any]
    value: float | None  # the metric at the trial's last step
    steps: int
    status: str  # completed | stopped early | failed
    run_id: str
    error: str = ""
    last: dict[str, Any] = field(default_factory=dict)  # its last result: the step's metrics and ours


@dataclass
class SweepResult:
    name: str
    metric: str
    mode: str
    trials: list[Trial]
    parent_run_id: str | None
    best: Trial | None = field(init=False)

    def __post_init__(self) -> None:
        scored = [t for t in self.trials if t.value is not None and not math.isnan(t.value)]
        pick = min if self.mode == "min" else max
        self.best = pick(scored, key=lambda t: t.value) if scored else None

    def table(self) -> str:
        fields = list(self.trials[0].params) if self.trials else []
        head = ["trial", *fields, self.metric, "steps", "status", "mlflow run"]
        rows = [[t.trial_id, *(_fmt(t.params.get(f)) for f in fields), _fmt(t.value), str(t.steps),
                 t.status + (" (best)" if t is self.best else ""), t.run_id] for t in self.trials]
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
        return "\n".join([line(head), *(line(r) for r in rows)])


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


# The trial's own process (a Tune actor that only drives): a sliver of a CPU, because Ray refuses
# a placement group bundle of none. Its second bundle, 1 CPU, is where the tasks it starts (Ray
# Data's, which Tune's placement group captures) run.
TRIAL_CPU = 0.01


def trial_cpus(cfg: RunConfig, world: int | None = None) -> float:
    """What one trial holds: its actors (`world` of them, default the config's layout's), its
    driver and one CPU for the Ray Data tasks that feed them."""
    world = cfg.parallel.layout.world_size if world is None else world
    return world * cfg.resources.cpus_per_actor + 1 + TRIAL_CPU


def concurrency(spec: SweepSpec, cfg: RunConfig, cluster_cpus: float | None) -> int:
    """Trials at once: what the sweep asks, checked against the cluster (None: a local Ray the
    sweep starts, sized for the asked number, one by default)."""
    per_trial = trial_cpus(cfg)
    if cluster_cpus is None:
        return spec.max_concurrent or 1
    fits = int(cluster_cpus // per_trial)
    if fits < 1:
        raise ConfigError(f"one trial needs {per_trial:g} CPUs ({cfg.parallel.layout.world_size} actors x "
                          f"resources.cpus_per_actor + 1 for data) and the cluster has {cluster_cpus:g}; "
                          "lower the base config's layout or add nodes")
    if spec.max_concurrent is not None and spec.max_concurrent > fits:
        raise ConfigError(f"sweep max_concurrent={spec.max_concurrent} trials need "
                          f"{spec.max_concurrent * per_trial:g} CPUs ({per_trial:g} each); the cluster has "
                          f"{cluster_cpus:g}: set max_concurrent to at "
                          f"most {fits}")
    return spec.max_concurrent or fits


def search_space(spec: SweepSpec) -> dict[str, Any]:
    make = {"grid": tune.grid_search, "choice": tune.choice, "uniform": lambda v: tune.uniform(*v),
            "loguniform": lambda v: tune.loguniform(*v), "randint": lambda v: tune.randint(v[0], v[1] + 1)}
    return {f: make[kind](values) for f, how in spec.space.items() for kind, values in how.items()}


def sweep(sweep: str | Path | SweepSpec | dict, overrides: list[str] | None = None, *,
          base: RunConfig | str | Path | dict | None = None, log=print, trial_cls: type | None = None,
          stop_signals: bool = False) -> SweepResult:
    """Run a sweep: every trial a raymp run nested under one MLflow parent run. `sweep` is a
    SWEEP.yaml, or (from a notebook) a SweepSpec or its dict with the run config as `base`.
    `trial_cls` replaces the trial class (fault tests kill a trial this way). `stop_signals` (the
    CLI): SIGTERM stops the sweep as Ctrl-C does, its MLflow runs marked KILLED."""
    if isinstance(sweep, (str, Path)):
        spec, cfg = load_sweep(sweep, overrides)
    else:
        spec = sweep if isinstance(sweep, SweepSpec) else spec_from_dict(sweep)
        base = base if base is not None else spec.base
        if base is None:
            raise ConfigError("raymp.sweep(spec) needs the run config: base=RunConfig, a path or a dict")
        cfg = check_spec(spec, as_config(base, [*spec.set, *(overrides or [])]))

    local = starts_local(cfg.resources.address)
    held = concurrency(spec, cfg, None if local else _cluster_cpus(cfg))
    connect(cfg.resources.address, trial_cpus(cfg) * held)
    parent = ParentRun(spec, cfg) if cfg.tracking.enabled else None
    log(f"sweep {spec.name}: {spec.trials()} trials of {cfg.name} over {', '.join(spec.space)}, "
        f"{held} at a time, ranked by {spec.mode} {spec.metric}"
        + (f"; MLflow parent run {parent.run_id}" if parent else ""))
    trainable = tune.with_resources(
        tune.with_parameters(trial_cls or RaympTrial, base=cfg.model_dump(mode="json"), sweep_name=spec.name,
                             parent_run_id=parent.run_id if parent else None, metric=spec.metric),
        PlacementGroupFactory([{"CPU": TRIAL_CPU}, {"CPU": 1}]))
    scheduler = None if spec.asha is None else ASHAScheduler(
        time_attr="training_iteration", max_t=cfg.train.steps, grace_period=spec.asha.grace_period,
        reduction_factor=spec.asha.reduction_factor)
    storage = (Path(cfg.output_dir) / "sweeps").resolve()
    # Tune saves a trial where raymp does (checkpoint.every), so a restarted trial goes on from
    # the raymp checkpoint Tune names; a trial is restarted `retries` times. No save of Tune's at
    # a trial's end: it wrote a checkpoint of every trial, the stopped ones too, even where the
    # run config asks for none.
    started = _Started()
    run_config = tune.RunConfig(
        name=spec.name, storage_path=str(storage), verbose=0, callbacks=[started],
        checkpoint_config=tune.CheckpointConfig(checkpoint_frequency=cfg.checkpoint.every,
                                                checkpoint_at_end=False),
        failure_config=tune.FailureConfig(max_failures=spec.retries))
    tuner = tune.Tuner(
        trainable, param_space=search_space(spec), run_config=run_config,
        tune_config=tune.TuneConfig(metric=spec.metric, mode=spec.mode, num_samples=spec.samples,
                                    search_alg=_searcher(spec, cfg), scheduler=scheduler,
                                    max_concurrent_trials=held, reuse_actors=True))
    if stop_signals:
        stop_on_signals()  # after Ray connected (see there); Tune's own handler is off (_TUNE_QUIET)
    try:
        with _quiet_tune():
            grid = tuner.fit()
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM: the trials' actors end with this driver
        if parent is not None:
            parent.stopped()
        raise
    trials = []
    for res in grid:
        m = res.metrics or {}
        steps = int(m.get(STEPS_DONE, 0))
        status = ("failed" if res.error else "completed" if steps >= cfg.train.steps else "stopped early")
        trial_id, params = started.trials.get(Path(res.path).name, (Path(res.path).name, res.config or {}))
        trials.append(Trial(trial_id, params, m.get(spec.metric), steps, status, str(m.get(RUN_ID, "")),
                            _reason(res.error), dict(m)))
    trials.sort(key=lambda t: t.trial_id)
    result = SweepResult(spec.name, spec.metric, spec.mode, trials, parent.run_id if parent else None)
    if parent is not None:
        parent.finish(result)
    return result


class _Started(tune.Callback):
    """Each trial's id and params as it starts: a trial that fails before its first result has
    neither in Tune's result (its config is None there)."""

    def __init__(self):
        self.trials: dict[str, tuple[str, dict]] = {}  # trial directory's name -> (id, params)

    def on_trial_start(self, iteration, trials, trial, **info) -> None:
        self.trials[Path(trial.path).name] = (trial.trial_id, dict(trial.config))

    on_trial_error = on_trial_start  # a trial that failed in its set-up never started


def _searcher(spec: SweepSpec, cfg: RunConfig):
    """None (Tune's variant generator: grid and random draws), or Optuna's TPE sampler."""
    if spec.search == "random":
        return None
    if importlib.util.find_spec("optuna") is None:
        raise ConfigError("sweep search: optuna needs the optuna package (pip install optuna), or use "
                          "search: random")
    return OptunaSearch(metric=spec.metric, mode=spec.mode, seed=cfg.seed)


def _reason(error: BaseException | None) -> str:
    """A failed trial's reason: the last line of Tune's error, which is the trial's own exception
    (a ConfigError's one line when a sampled value is refused), not the traceback above it."""
    lines = [line.strip() for line in str(error or "").splitlines() if line.strip()]
    return lines[-1] if lines else ""


@contextmanager
def _quiet_tune():
    """Tune's progress tables, its file loggers and its log lines off: the sweep prints its own
    table, and a failed trial's reason in it (Tune's traceback stays in the trial's error.txt)."""
    saved = {k: os.environ.get(k) for k in _TUNE_QUIET}
    os.environ.update(_TUNE_QUIET)
    try:
        with quiet_loggers("ray.tune", "ray.train", level=logging.CRITICAL):
            yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# Tune's SIGINT handler is off too: it ended the sweep as if it had finished (the trials it
# stopped looked stopped by ASHA, the exit status 0); a Ctrl-C now interrupts the sweep.
_TUNE_QUIET = {"RAY_AIR_NEW_OUTPUT": "0", "TUNE_DISABLE_AUTO_CALLBACK_LOGGERS": "1",
               "TUNE_DISABLE_SIGINT_HANDLER": "1"}


def _cluster_cpus(cfg: RunConfig) -> float:
    connect(cfg.resources.address, 0)
    return ray.cluster_resources().get("CPU", 0)
