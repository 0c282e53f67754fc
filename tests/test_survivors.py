"""elastic.keep_survivors on the session's Ray: a rank's actor is killed mid-run (ray.kill) and
the survivors go on from the failed step with the state they hold in memory. Checked like a
layout test (every step once, loss within 1e-5 of one process, samples in the global order),
plus: the survivors' processes are the same, no checkpoint is read and no step is redone.
test_fault_matrix_cluster.py loses whole nodes the same way."""

from __future__ import annotations

import pytest

from faults import STEPS, Reference, check_against_reference, kill_rank_after, matrix_cfg
from raymp import Trainer
from raymp.config import ConfigError, config_from_dict


@pytest.fixture(scope="module")
def ref(data_cache, tmp_path_factory):
    return Reference.of(matrix_cfg(tmp_path_factory.mktemp("ref"), data_cache))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("parallel,lost,kept_dp", [
    ({"dp": 2}, 1, 1),
    # The rendezvous rank is lost; dp 4 -> 3 does not split the global batch of 8: dp 2 goes on.
    ({"dp": 4}, 0, 2),
    # Whole replicas of pp, tp or cp ranks: replica 1 loses a rank (its other rank is let go at
    # once, so no peer waits on it), replica 0 goes on.
    ({"dp": 2, "pp": 2, "schedule": "1f1b"}, 3, 1),
    ({"dp": 2, "tp": 2}, 2, 1),
    ({"dp": 2, "cp": 2}, 3, 1),
], ids=["dp2", "dp4-rank0", "dp2xpp2", "dp2xtp2", "dp2xcp2"])
def test_survivors_keep_their_state_and_redo_no_step(parallel, lost, kept_dp, ref, data_cache, tmp_path):
    cfg = matrix_cfg(tmp_path, data_cache, parallel={"zero": 0, "micro_batch_size": 1, **parallel},
                     elastic={"keep_survivors": True, "grow_back": False})
    with Trainer(cfg, progress=False) as trainer:
        trainer.setup()
        pids = [n["pid"] for n in trainer.group.nodes]
        per_replica = len(pids) // parallel["dp"]
        kill_rank_after(trainer, 3, rank=lost)
        history = trainer.fit()
        (event,) = trainer.restarts
        layout = trainer.config.parallel.layout
    assert event["recovery"] == "survivors" and event["checkpoint"] is None  # nothing read from storage
    assert event["resumed_step"] == event["failed_step"]  # nothing redone
    assert (layout.dp, layout.cp, layout.pp, layout.tp) == (kept_dp, *(parallel.get(d, 1) for d in ("cp", "pp", "tp")))
    # The same processes go on, whole replicas (which ones: whichever gloo let end the step first).
    lost_replica = set(pids[lost // per_replica * per_replica:][:per_replica])
    assert len(event["pids"]) == kept_dp * per_replica and set(event["pids"]) <= set(pids) - lost_replica
    check_against_reference(history, ref, range(STEPS))


def test_keep_survivors_is_refused_where_a_replica_holds_only_part_of_the_state(tmp_path, data_cache):
    for zero in (1, 2, 3):
        cfg = matrix_cfg(tmp_path, data_cache, parallel={"dp": 2, "zero": zero}, elastic={"keep_survivors": True})
        with pytest.raises((ConfigError, ValueError), match="elastic.keep_survivors needs each dp replica"):
            config_from_dict(cfg)
