"""The local cluster helper (cluster/local_cluster.py), scripted in its own process: it shows a node
loss and a node's return while a run trains."""

from __future__ import annotations

import os
import subprocess
import sys

from helpers.cli import ROOT


def test_local_cluster_helper_shows_a_node_loss_and_return(tmp_path, data_cache):
    """cluster/local_cluster.py, scripted: a node removed after step 5, one added after step 9."""
    env = {**os.environ, "RAY_ADDRESS": ""}
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "cluster" / "local_cluster.py"),
            str(ROOT / "configs" / "tiny-elastic.yaml"),
            "--set",
            "train.steps=16",
            "--set",
            "train.seq_len=32",
            "--set",
            "checkpoint.every=4",
            "--set",
            f"checkpoint.dir={tmp_path}/ck",
            "--set",
            f"output_dir={tmp_path}/runs",
            "--set",
            f"data.cache_dir={data_cache}",
            "--set",
            "elastic.wait_for_resources_s=1",
            "--kill-at",
            "5",
            "--add-at",
            "9",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        stdin=subprocess.DEVNULL,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "[cluster] removed node 0" in out.stdout and "[cluster] added node" in out.stdout
    assert "failure restart 1: dp=2 pp=2 tp=1 zero=2 -> dp=1 pp=2" in out.stdout
    assert "grow restart 2: dp=1 pp=2 tp=1 zero=2 -> dp=2 pp=2" in out.stdout
    assert "step    16/16" in out.stdout and "[cluster] done: 2 restart(s)" in out.stdout
