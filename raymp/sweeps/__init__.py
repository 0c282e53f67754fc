"""Sweeps on Ray Tune: a search over run-config fields, each trial a whole raymp run nested under
one MLflow parent run (`raymp sweep SWEEP.yaml`, or `raymp.sweep(...)` from a notebook)."""

from raymp.sweeps.run import SweepResult, Trial, sweep
from raymp.sweeps.spec import SweepSpec, load_sweep

__all__ = ["SweepResult", "SweepSpec", "Trial", "load_sweep", "sweep"]
