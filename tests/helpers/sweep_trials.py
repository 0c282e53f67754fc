"""A sweep trial that dies once, mid-run: its process exits (as on a lost node) after a given
step, the first time any trial of the sweep gets there (a marker file under the run's output_dir)."""

from __future__ import annotations

import os
from pathlib import Path

from raymp.sweeps.trial import RaympTrial

DIE_AFTER_STEP = 6


class DiesOnceTrial(RaympTrial):
    def step(self) -> dict:
        result = super().step()
        marker = Path(self.trainer.config.output_dir) / "trial-died"
        if self.trainer.global_step == DIE_AFTER_STEP and not marker.exists():
            marker.write_text(self.trial_id)
            os._exit(1)
        return result


LOSE_RANK_AFTER_STEP = 2


class LosesARankOnceTrial(RaympTrial):
    """The first trial of the sweep to finish step 2 loses its rank 1's actor there (as on a lost
    node, the trial's own process lives on): its next step recovers inside Trainer.step."""

    def step(self) -> dict:
        result = super().step()
        marker = Path(self.trainer.config.output_dir) / "rank-lost"
        if self.trainer.global_step == LOSE_RANK_AFTER_STEP and not marker.exists():
            marker.write_text(self.trial_id)
            self.trainer.group.kill_ranks([1])
        return result
