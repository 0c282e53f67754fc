"""A sweep's file: a base run config, the fields to search and how, the metric, the trial budget
and the early stopping. Everything here is checked before any trial starts: a field the run
config does not have, a value it refuses or a metric a run does not report is one line."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from raymp.config import ConfigError, RunConfig, load_config
from raymp.config.loading import config_from_dict
from raymp.metric_names import PER_STEP

# How a field is searched: every value (grid), one of them at random (choice), or a number drawn
# from a range (uniform, loguniform, randint: [low, high]).
KINDS = ("grid", "choice", "uniform", "loguniform", "randint")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Ashas(_Strict):
    """Asynchronous successive halving (Tune's ASHAScheduler): at each rung (grace_period steps,
    then that times reduction_factor, ...) a trial below the best 1/reduction_factor of the trials
    that reached the rung stops."""

    grace_period: int = Field(5, ge=1, description="steps every trial runs before it can be stopped")
    reduction_factor: float = Field(2, gt=1, description="keep the best 1/reduction_factor at each rung")


class SweepSpec(_Strict):
    name: str = Field("sweep", description="the MLflow parent run's name and the trials' name prefix")
    base: str | None = Field(None, description="the run config every trial starts from (a path relative to "
                             "the sweep file; from Python, raymp.sweep(spec, base=...) instead)")
    set: list[str] = Field(default_factory=list, description="overrides of the base, KEY=VALUE, for every "
                           "trial")
    space: dict[str, dict[str, list[Any]]] = Field(
        ..., description="field -> {grid|choice: [values]} or {uniform|loguniform|randint: [low, high]}")
    metric: str = Field("loss", description="the step metric the sweep ranks by (a key of a step's metrics)")
    mode: Literal["min", "max"] = "min"
    search: Literal["random", "optuna"] = Field(
        "random",
        description="random: Tune's variant generator (every grid point, random draws of the rest); "
        "optuna: Optuna's TPE sampler proposes each trial from the results so far (seeded by the base "
        "config's seed; no grid fields)",
    )
    samples: int = Field(1, ge=1, description="Tune's num_samples: the grid is run this many times, each "
                                              "with fresh draws of the sampled fields")
    max_concurrent: int | None = Field(None, ge=1, description="trials at once; None: as many as the cluster "
                                                               "holds (one on a local Ray this sweep starts)")
    retries: int = Field(0, ge=0, description="a failed trial is restarted this many times, from its latest "
                                              "checkpoint (checkpoint.every) when it has one")
    asha: Ashas | None = Field(default_factory=Ashas, description="early stopping; null: every trial runs "
                                                                  "train.steps")

    @model_validator(mode="after")
    def _space(self) -> "SweepSpec":
        if not self.space:
            raise ValueError("space is empty: name at least one field, e.g. "
                             "optimizer.lr: {loguniform: [1e-4, 1e-2]}")
        for field, how in self.space.items():
            if len(how) != 1 or next(iter(how)) not in KINDS:
                raise ValueError(f"space.{field}: give exactly one of {', '.join(KINDS)} (got {sorted(how)})")
            kind, values = next(iter(how.items()))
            if not values:
                raise ValueError(f"space.{field}.{kind}: give at least one value")
            if kind in ("uniform", "loguniform", "randint") and (len(values) != 2 or values[0] >= values[1]):
                raise ValueError(f"space.{field}.{kind}: give [low, high] with low < high (got {values})")
            if kind == "loguniform" and values[0] <= 0:
                raise ValueError(f"space.{field}.loguniform: low must be > 0 (got {values[0]})")
            if kind == "grid" and self.search == "optuna":
                raise ValueError(f"space.{field}.grid: search: optuna draws every value, it runs no grid; "
                                 "use choice, or search: random")
        return self

    def candidates(self, field: str) -> list[Any]:
        """The values of `field` that are checked against the run config before the sweep starts:
        every listed one, or a range's two ends."""
        return next(iter(self.space[field].values()))

    def grid_size(self) -> int:
        sizes = [len(v["grid"]) for v in self.space.values() if "grid" in v]
        return math.prod(sizes)

    def trials(self) -> int:
        return self.grid_size() * self.samples


def override(field: str, value: Any) -> str:
    """A KEY=VALUE override that reads back as `value` (JSON is YAML)."""
    return f"{field}={json.dumps(value)}"


def spec_from_dict(data: dict, source: str = "<dict>") -> SweepSpec:
    try:
        return SweepSpec.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "sweep"
        msg = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            msg = f"not a sweep field (the fields: {', '.join(SweepSpec.model_fields)})"
        raise ConfigError(f"invalid sweep ({source}): {field}: {msg}") from None


def load_sweep(path: str | Path, overrides: list[str] | None = None) -> tuple[SweepSpec, RunConfig]:
    """The sweep file and its base run config (with the sweep's `set` and `overrides` applied),
    every searched value checked against the run config."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"sweep file {path} not found (or not a file); give a SWEEP.yaml")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ConfigError(f"{path} is not valid YAML{where}: {getattr(err, 'problem', err)}") from None
    spec = spec_from_dict(data, str(path))
    if spec.base is None:
        raise ConfigError(f"invalid sweep ({path}): base: give the run config the trials start from, "
                          "e.g. base: ../tiny.yaml")
    base = Path(spec.base)
    base = base if base.is_absolute() else path.parent / base
    return spec, check_spec(spec, load_config(base, [*spec.set, *(overrides or [])]))


MAX_CHECKED = 1000  # grid combinations validated before the sweep starts (each ~5 ms)


def _accepted(dumped: dict, values: dict[str, Any]) -> None:
    try:
        config_from_dict(dumped, [override(f, v) for f, v in values.items()])
    except ConfigError as err:  # the config's own words, without its "invalid config" head
        why = "; ".join(line.strip() for line in str(err).splitlines()[1:]) or str(err)
        which = ", ".join(f"{f}={v!r}" for f, v in values.items())
        raise ConfigError(f"sweep space: {which} is refused: {why}") from None


def check_spec(spec: SweepSpec, base: RunConfig) -> RunConfig:
    """`base` if every searched value makes a config it accepts and the metric is one a step
    reports; else the ConfigError naming the first that does not."""
    dumped = base.model_dump(mode="json")
    for field in spec.space:
        for value in spec.candidates(field):
            _accepted(dumped, {field: value})
    # The grid's combinations too (dp=4 may refuse one global batch size that dp=2 takes); a
    # sampled value's combinations are only known when drawn: such a trial fails with the reason.
    grid = [f for f, how in spec.space.items() if "grid" in how]
    if len(grid) > 1:
        for combo in itertools.islice(itertools.product(*(spec.space[f]["grid"] for f in grid)), MAX_CHECKED):
            _accepted(dumped, dict(zip(grid, combo)))
    if spec.metric not in PER_STEP:
        raise ConfigError(f"sweep metric {spec.metric!r} is not a step metric; use one of "
                          f"{', '.join(sorted(PER_STEP))}")
    if spec.metric == "val_loss" and not base.train.eval_batches:
        raise ConfigError("sweep metric val_loss needs validation: set train.eval_batches > 0 (and "
                          "train.eval_every) in the base config")
    if spec.asha is not None and spec.asha.grace_period > base.train.steps:
        raise ConfigError(f"sweep asha.grace_period ({spec.asha.grace_period}) is more than train.steps "
                          f"({base.train.steps}): no trial could be stopped early; lower it or set "
                          "asha: null")
    return base
