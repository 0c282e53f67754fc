"""Stragglers: a rank the others keep waiting for. Each step, every rank's own time (what its
training thread ran or waited for a core: raymp.runtime.thread_time) is set against the median of
the other ranks of its pipeline stage (the ranks that do the same work). A rank above
elastic.straggler_factor times that for elastic.straggler_steps steps in a row is reported once, in
one line and in the step's metrics; the largest ratio of every step is a metric (MLflow
speed/straggler). A layout change (a restart, survivors, a join) starts the count again: the ranks
are not the same processes. Reported here; elastic.replace_stragglers has the Trainer ask the
elastic controller to replace the rank reported (ElasticController.replace_straggler)."""

from __future__ import annotations

import statistics

from raymp.layout import Layout


def own_time_ratios(own: list[float], layout: Layout) -> dict[int, float]:
    """rank -> its own time over the median of the other ranks of its stage (ranks with no peer
    in their stage, or peers that took no time, are left out)."""
    ratios = {}
    for rank, mine in enumerate(own):
        stage = layout.coords(rank)["pp"]
        peers = [own[r] for r in layout.ranks_where(pp=stage) if r != rank]
        if peers and (typical := statistics.median(peers)) > 0:
            ratios[rank] = mine / typical
    return ratios


class StragglerWatch:
    """Counts each rank's steps in a row above the factor and says when one reaches the count."""

    def __init__(self, factor: float, steps: int, say):
        """`factor` 0: off."""
        self.factor, self.steps, self.say = factor, steps, say
        self.in_a_row: dict[int, int] = {}
        self.reported: list[tuple[int, int]] = []  # (step, rank) of every report
        self._layout = None

    def after_step(self, own: list[float], layout: Layout, metrics: dict, where=lambda rank: "",
                   launch: int = 0) -> None:
        """`own`: every rank's own time of the step; `where(rank)`: where the rank runs, for the line;
        `launch`: changes when the ranks are set up anew (the run's restarts so far)."""
        if not self.factor:
            return
        if (launch, layout.record()) != self._layout:
            self._layout, self.in_a_row = (launch, layout.record()), {}
        ratios = own_time_ratios(own, layout)
        if not ratios:
            return
        metrics["straggler_ratio"] = max(ratios.values())
        for rank, ratio in ratios.items():
            self.in_a_row[rank] = self.in_a_row.get(rank, 0) + 1 if ratio >= self.factor else 0
            if self.in_a_row[rank] == self.steps:
                self.reported.append((metrics["step"], rank))
                metrics["straggler_rank"] = rank
                self.say(f"straggler: rank {rank}{where(rank)} took {ratio:.1f}x the own time of its stage's "
                         f"other ranks for {self.steps} steps in a row (elastic.straggler_factor="
                         f"{self.factor:g}, elastic.straggler_steps={self.steps}); the others wait for it "
                         "every step")
