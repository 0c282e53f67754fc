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
@pytest.mark.parametrize("dp,lost", [(2, 1), (4, 0)])
def test_survivors_keep_their_state_and_redo_no_step(dp, lost, ref, data_cache, tmp_path):
    cfg = matrix_cfg(tmp_path, data_cache, parallel={"dp": dp, "zero": 0, "micro_batch_size": 1},
                     elastic={"keep_survivors": True, "grow_back": False})
    with Trainer(cfg, progress=False) as trainer:
        trainer.setup()
        pids = [n["pid"] for n in trainer.group.nodes]
        kill_rank_after(trainer, 3, rank=lost)
        history = trainer.fit()
        (event,) = trainer.restarts
        kept_dp = trainer.config.parallel.dp
    assert event["recovery"] == "survivors" and event["checkpoint"] is None  # nothing read from storage
    assert event["resumed_step"] == event["failed_step"]  # nothing redone
    # dp 4 -> 3 does not split the global batch of 8: the survivors go on as dp 2.
    assert kept_dp == {2: 1, 4: 2}[dp]
    # The same processes go on (which of the survivors: whichever gloo let end the failed step first).
    assert len(event["pids"]) == kept_dp and set(event["pids"]) <= set(pids) - {pids[lost]}
    check_against_reference(history, ref, range(STEPS))


def test_keep_survivors_is_refused_where_a_rank_holds_only_part_of_the_state(tmp_path, data_cache):
    for parallel in ({"dp": 2, "zero": 2}, {"dp": 1, "pp": 2, "zero": 0}):
        cfg = matrix_cfg(tmp_path, data_cache, parallel=parallel, elastic={"keep_survivors": True})
        with pytest.raises((ConfigError, ValueError), match="elastic.keep_survivors needs every rank"):
            config_from_dict(cfg)
