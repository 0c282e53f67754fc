"""Tensor-parallel groups are packed per node; a layout that cannot fit fails with a clear error
(at once when no node could hold a TP group, after a bounded wait when the cluster is full)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from raymp.runtime.actor_group import PlacementError
from raymp.runtime.simulated_cluster import OBJECT_STORE_BYTES
from raymp.trainer import Trainer
from helpers.cli import ROOT


def test_tp_groups_pack_per_node_on_a_simulated_gpu_cluster():
    env = {**os.environ, "RAY_ADDRESS": ""}
    out = subprocess.run([sys.executable, "-m", "helpers.placement_probe"], cwd=ROOT / "tests",
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    tp2 = result["tp2"]
    # ranks 0,1 and 2,3 are the TP groups: each on one node, on distinct GPUs; the groups on both nodes.
    assert tp2[0]["node"] == tp2[1]["node"] and tp2[2]["node"] == tp2[3]["node"]
    assert sorted({tp2[0]["node"], tp2[2]["node"]}) == result["node_ids"]
    for a, b in ((0, 1), (2, 3)):
        assert len(tp2[a]["gpus"]) == 1 and tp2[a]["gpus"] != tp2[b]["gpus"]
    assert "tensor-parallel group of 4 actors must fit on one node" in result["tp4_error"]
    assert "GPU=2" in result["tp4_error"]  # said before placing (its placement_timeout_s is 600)
    assert (
        "could not place 8 actors" in result["too_many_error"]
        and "groups of 2 per node" in result["too_many_error"]
    )
    assert result["too_many_seconds"] >= 3  # it waited for its placement_timeout_s (3 s)
    assert result["gpus_free_after"] == 4  # nothing left reserved by the failed attempts
    # Each simulated node's object store is OBJECT_STORE_BYTES, not cluster_utils' 150 MiB (peer
    # copies spilled to disk there: docs/design.md, traps).
    assert result["object_store_bytes"] == [OBJECT_STORE_BYTES] * 3
    # Issue 24: local data on a 0-CPU head (the shipped cluster configs) was unschedulable.
    head0 = result["zero_cpu_head"]
    assert head0["head"] not in head0["actor_nodes"]
    assert head0["losses"] == pytest.approx(head0["reference"], rel=1e-5)


def test_shared_group_must_keep_tp_groups_on_one_node(group2, tiny_cfg):
    group2.nodes = [dict(n) for n in group2.nodes]
    saved = group2.nodes[1]["node_id"]
    group2.nodes[1]["node_id"] = "elsewhere"  # as if rank 1 sat on another node
    try:
        with pytest.raises(PlacementError, match="ranks 0..1 form a TP group but sit on 2 nodes"):
            Trainer(tiny_cfg(parallel={"dp": 1, "tp": 2, "micro_batch_size": 2}), actor_group=group2,
                    progress=False).setup()
    finally:
        group2.nodes[1]["node_id"] = saved
