"""The fault matrix's storage cases that need no Ray: a rewind into a directory whose newer
checkpoint is damaged is still a rewind. The rest of the matrix is integration/test_fault_matrix.py."""

from __future__ import annotations

import pytest

from helpers.faults import (
    DAMAGE,
)
from raymp.checkpoint.store import CheckpointStore


@pytest.mark.timeout(60)
def test_rewind_into_a_dir_with_a_damaged_newer_checkpoint_is_still_a_rewind(tmp_path):
    """No Ray: the lineage alone. A damaged checkpoint of the abandoned timeline is not another
    run's, and never a candidate."""
    from raymp.checkpoint.lineage import Lineage

    store = CheckpointStore(str(tmp_path / "ck"))
    for step in (2, 4):
        store.prepare(step)
        store.commit(step, {"data_position": {}})
    DAMAGE["half-written marker"](tmp_path / "ck" / "step-00000004")
    lineage = Lineage.open(store, f"{tmp_path}/ck/step-00000002")
    assert lineage.rewound_from == 2 and [c.step for c in lineage.candidates()] == [2]
