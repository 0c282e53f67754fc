"""Sweeps on Ray Tune: a search over run-config fields, each trial a whole raymp run nested under
one MLflow parent run (`raymp sweep SWEEP.yaml`, or `raymp.sweep(...)` from a notebook), and a
search of the parallel layout by measurement (`raymp sweep --layouts N CONFIG`,
`raymp.search_layouts(...)`)."""

from raymp.sweeps.layouts import LayoutSearch, search_layouts
from raymp.sweeps.run import SweepResult, Trial, sweep
from raymp.sweeps.spec import SweepSpec, load_sweep

__all__ = ["LayoutSearch", "SweepResult", "SweepSpec", "Trial", "load_sweep", "search_layouts", "sweep"]
