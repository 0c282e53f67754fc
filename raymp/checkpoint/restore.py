"""Restoring the ranks from the newest intact state of a lineage (lineage.py gives the order).

A checkpoint is verified before it is loaded: the ranks check the marker's checksums, a share of
the files each, in parallel. A damaged, partial or unreadable checkpoint is reported in one line
and the previous one is tried; a load that fails anyway is followed by a fresh set-up of the
ranks (it may have filled part of the state) before the next try. If the lineage has states but
none is intact, the run stops: it never goes on from scratch in their place.
"""

from __future__ import annotations

import ray

from raymp.checkpoint.integrity import NO_CHECKSUMS, listed_files, shares
from raymp.checkpoint.store import Checkpoint, CheckpointError

SETUP_KNOB = "resources.setup_timeout_s"
COLLECTIVE_KNOB = "resources.collective_timeout_s"  # a wait on the ranks' collectives


def verify_on_ranks(group, checkpoint: Checkpoint, timeout_s: float | None) -> list[str]:
    """Problems with the checkpoint's files; the ranks read a share each."""
    files = listed_files(checkpoint.meta)
    if files is None:
        return [NO_CHECKSUMS]
    per_rank = [(checkpoint.path, share) for share in shares(files, group.world_size)]
    found = group.call_per_rank("verify_checkpoint", per_rank, timeout_s=timeout_s, knob=SETUP_KNOB)
    return [problem for rank_problems in found for problem in rank_problems]


def restore_newest_intact(group, candidates: list[Checkpoint], resetup, log,
                          timeout_s: float | None = None) -> Checkpoint | None:
    """Load the first of `candidates` (newest first) that verifies and loads on every rank;
    `resetup()` rebuilds the ranks' state after a failed load. None when there is no candidate."""
    passed_over = []
    for checkpoint in candidates:
        problems = verify_on_ranks(group, checkpoint, timeout_s)
        if not problems:
            try:
                group.call("load_checkpoint", checkpoint.path, timeout_s=timeout_s, knob=SETUP_KNOB)
                if passed_over:
                    log(f"checkpoint: resumed from step {checkpoint.step} ({checkpoint.path}), the newest "
                        f"intact state, in place of {', '.join(passed_over)}")
                return checkpoint
            except ray.exceptions.RayTaskError as exc:
                problems = [str(exc.cause).splitlines()[0][:300]]
                resetup()
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        log(f"checkpoint: step {checkpoint.step} at {checkpoint.path} is damaged: {problems[0]}{more}; "
            "trying the previous one")
        passed_over.append(f"step {checkpoint.step} ({problems[0]})")
    if candidates:
        raise CheckpointError(
            "no intact checkpoint in this run's lineage: " + "; ".join(passed_over)
            + ". Restore one from a copy, or start over in another checkpoint.dir")
    return None
