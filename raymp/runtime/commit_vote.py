"""The step's commit vote. Every rank's ballot rides on the step's last collective, the gradient
norm's all-reduce (DataParallelEngine.clip_grad_norm), which every rank joins after its backward and
before its optimizer step; no collective of its own. It makes "the step was taken" a fact every
survivor can state: a rank lost before that all-reduce leaves no rank that applied the step (they
all keep the state from before it); once it is in, every rank holds what the driver needs to
record the step without any one rank's report (each rank's loss and the samples it read), so a
rank lost after it costs no step; one lost during it can leave survivors that disagree, and those
do not go on with their state (raymp.elastic.policy)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class StepRecord:
    """What the vote of one step gathered, by rank: the loss (None: not a last pipeline stage)
    and the sample ids it read (None: not a first stage)."""

    step: int
    losses: list[float | None]
    sample_ids: list[np.ndarray | None]


class Ballot:
    """One row per rank, this rank's filled and the others zero, so the sum over ranks is every
    rank's row exactly: [has a loss, loss, ids read (-1: none), step, ids...] in float64 (sample
    ids below 2**53 and a float loss come back as they were; a non-finite loss too)."""

    def __init__(self, step: int, loss: float | None, sample_ids: np.ndarray | None, ids_per_rank: int,
                 rank: int, world_size: int):
        ids = np.asarray([] if sample_ids is None else sample_ids, dtype=np.int64).ravel()
        if ids.size > ids_per_rank:
            raise ValueError(f"{ids.size} sample ids on one rank, the vote has room for {ids_per_rank}")
        self.step = step
        rows = np.zeros((world_size, 4 + ids_per_rank))  # numpy: one torch op to wrap, not one per field
        rows[rank, :4] = (loss is not None, 0.0 if loss is None else loss,
                          -1 if sample_ids is None else ids.size, step)
        rows[rank, 4:4 + ids.size] = ids
        self.rows = torch.from_numpy(rows)

    @property
    def tensor(self) -> torch.Tensor:
        """What the all-reduce sums over every rank, in place (flat)."""
        return self.rows.view(-1)

    def record(self) -> StepRecord:
        """Every rank's ballot, once the all-reduce summed them."""
        rows = self.rows.numpy()
        if any(int(row[3]) != self.step for row in rows):
            raise RuntimeError(f"the commit vote of step {self.step} met ballots of steps "
                               f"{[int(r[3]) for r in rows]}")
        return StepRecord(
            self.step,
            [float(row[1]) if row[0] else None for row in rows],
            [None if row[2] < 0 else row[4:4 + int(row[2])].astype(np.int64) for row in rows],
        )
