"""What one rank reports after a training step: a typed record instead of a dict the driver
pops keys from. Built on the worker, aggregated by raymp.driver.metrics."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass
class RankReport:
    rank: int
    loss: float | None  # last pipeline stages only
    grad_norm: float
    lr: float
    compute_s: float
    data_wait_s: float
    peak_mem_bytes: int
    param_bytes: int
    grad_bytes: int
    optim_bytes: int
    activation_peak_bytes: int = 0
    loss_saved_peak_bytes: int = 0
    logits_bytes: int = 0
    sample_ids: np.ndarray | None = None  # first-stage ranks: the samples this rank read
    checkpoint: dict | None = None  # a save's outcome, when one finished since the last step
    pipeline_events: list = field(default_factory=list)  # pipelines: this rank's stage clock

    @property
    def measured_bytes(self) -> int:
        """Model state + saved activations: the quantity the planner estimates."""
        return (self.param_bytes + self.grad_bytes + self.optim_bytes + self.activation_peak_bytes
                + self.loss_saved_peak_bytes)

    def public(self) -> dict:
        """The report as the run's history keeps it (without ids, events and save outcomes)."""
        out = asdict(self)
        for key in ("sample_ids", "checkpoint", "pipeline_events"):
            out.pop(key)
        return out
