"""The planner's prices as measured on a cluster: the compute rate one actor reaches and each
mechanism's cost factor (`raymp sweep --layouts`). Saved under a config's output_dir, so the next
plan made for that config (`raymp plan`, `parallel: auto`) prices layouts with what this cluster
measured instead of the datasheet numbers of its `cluster:` section."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace

from raymp import storage
from raymp.step_time import COST_TERMS, Cluster, cluster_from_config

CALIBRATION_FILE = "cluster-calibration.json"


@dataclass(frozen=True)
class Calibration:
    """What a measured layout search found on `nodes` x `gpus_per_node` devices."""

    nodes: int
    gpus_per_node: int
    compute_tflops: float  # what one device reached on the model measured (all of its FLOP/s)
    cost_factors: dict[str, float]  # COST_TERMS key -> measured over priced
    measured_at: str
    layouts: list[str]  # the layouts measured

    def applies_to(self, cluster_cfg) -> bool:
        return (self.nodes, self.gpus_per_node) == (cluster_cfg.nodes, cluster_cfg.gpus_per_node)

    def priced(self, cluster: Cluster) -> Cluster:
        """`cluster` priced as measured: the compute rate as reached (so no MFU applies on top),
        the factors measured (a mechanism none of the layouts used keeps the cluster's own)."""
        factors = {**cluster.cost_factors, **self.cost_factors}
        return replace(cluster, gpu_tflops=self.compute_tflops, achievable_mfu=1.0, cost_factors=factors)

    def note(self, where: str) -> str:
        factors = ", ".join(f"{k} x{v:.2g}" for k, v in sorted(self.cost_factors.items())) or "none"
        return (f"priced as measured on this cluster ({where}, {self.measured_at}): "
                f"{self.compute_tflops * 1e3:.3g} GFLOP/s per device, cost factors {factors}")


def calibration_path(output_dir: str) -> str:
    return storage.join(output_dir, CALIBRATION_FILE)


def save_calibration(output_dir: str, calibration: Calibration) -> str:
    path = calibration_path(output_dir)
    storage.make_dirs(output_dir)
    storage.write_text(path, json.dumps(asdict(calibration), indent=1) + "\n")
    return path


def load_calibration(output_dir: str) -> Calibration | None:
    """The calibration saved under `output_dir`, or None (none saved, or one this version cannot
    read: a plan then uses the config's prices, as without one)."""
    fs, path = storage.fsspec_fs(calibration_path(output_dir))
    if not fs.exists(path):
        return None
    try:
        with fs.open(path, "r") as f:
            data = json.load(f)
        calibration = Calibration(**data)
    except (ValueError, TypeError):
        return None
    if set(calibration.cost_factors) - set(COST_TERMS) or calibration.compute_tflops <= 0:
        return None
    return calibration


def planning_cluster(cluster_cfg, output_dir: str) -> tuple[Cluster, str | None]:
    """The cluster a plan prices layouts on: the config's `cluster:` section, priced as measured
    when a layout search saved a calibration for this shape of cluster under `output_dir` and the
    section sets no cost_factors of its own (those win); and the note that says which."""
    cluster = cluster_from_config(cluster_cfg)
    calibration = None if cluster_cfg.cost_factors else load_calibration(output_dir)
    if calibration is None or not calibration.applies_to(cluster_cfg):
        return cluster, None
    return calibration.priced(cluster), calibration.note(calibration_path(output_dir))
