"""What one rank reports after a training step: a typed record instead of a dict the driver
pops keys from. Built on the worker, aggregated by raymp.driver.metrics."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass(frozen=True)
class RankSetup:
    """What one rank reports once its part of the model is built (Worker.setup)."""

    rank: int
    coords: dict[str, int]  # its place in the mesh: dp, cp, pp, tp (Layout.coords)
    num_params: int  # parameters of its part
    setup_peak_bytes: int | None  # memory building and loading its part took at its peak (None: unmeasured)
    stages: dict = field(default_factory=dict)  # pipelines: stage index -> layer indices it holds


@dataclass
class RankReport:
    rank: int
    loss: float | None  # last pipeline stages only
    grad_norm: float  # over every rank's gradients; not finite: the step's update was not applied
    lr: float
    compute_s: float
    data_wait_s: float
    peak_mem_bytes: int
    param_bytes: int
    grad_bytes: int
    optim_bytes: int
    own_s: float = 0.0  # the step's own time: not blocked (raymp.runtime.thread_time)
    activation_peak_bytes: int = 0
    loss_saved_peak_bytes: int = 0
    logits_bytes: int = 0
    memory_step: int = -1  # the step the memory figures above were measured on (measures_memory)
    sample_ids: np.ndarray | None = None  # first-stage ranks: the samples this rank read
    checkpoint: dict | None = None  # a save's outcome, when one finished since the last step
    save_started: dict | None = None  # the step's SaveOrder, started: blocked_s, wait_s, stage_s
    pipeline_events: list = field(default_factory=list)  # pipelines: this rank's stage clock
    routing: dict = field(default_factory=dict)  # MoE: per block of this rank, the global batch's routing
    expert_exchange_s: float | None = None  # expert parallelism: its all-to-alls' seconds (exchange_seconds)
    stand_in: bool = False  # a lost rank's report of a step the vote committed (Session.commit_failed_step)

    @property
    def measured_bytes(self) -> int:
        """Model state + saved activations: the quantity the planner estimates."""
        return (self.param_bytes + self.grad_bytes + self.optim_bytes + self.activation_peak_bytes
                + self.loss_saved_peak_bytes)

    def public(self) -> dict:
        """The report as the run's history keeps it (without ids, events and save outcomes)."""
        out = asdict(self)
        for key in ("sample_ids", "checkpoint", "save_started", "pipeline_events", "routing"):
            out.pop(key)
        return out


class MemorySampler:
    """A rank's memory measurements, taken on the steps measures_memory picks: which step
    measures, and the last measurement, which every report carries with the step it is from."""

    KEYS_FROM_STEP = ("activation_peak_bytes", "loss_saved_peak_bytes", "logits_bytes")

    def __init__(self, steps: int, every: int):
        self.steps, self.every = steps, every
        self.last: dict | None = None  # none yet in this set-up: its first step measures

    def measures(self, step: int) -> bool:
        return measures_memory(step, self.last is None, self.steps, self.every)

    def record(self, step: int, step_out: dict, state_bytes: dict) -> None:
        """A measured step's figures: the step runner's (taken out of `step_out`) and the engine's."""
        from_step = {key: step_out.pop(key) for key in self.KEYS_FROM_STEP if key in step_out}
        self.last = {**from_step, **state_bytes, "memory_step": step}


def measures_memory(step: int, first_of_setup: bool, steps: int, every: int) -> bool:
    """Whether a rank measures its memory on `step` (train.memory_every): counting saved
    activations and model-state bytes costs time, so it runs on a set-up's first step, the
    run's last (`steps` in all) and every `every` steps; a report between carries the last
    measurement and the step it was taken on."""
    return first_of_setup or step == steps - 1 or (every > 0 and (step + 1) % every == 0)
