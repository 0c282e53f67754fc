"""The pipeline as users see it: per-step bubble metrics, the timeline from the Python API (and
in the MLflow run), the layout of stages, and `raymp timeline` on the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raymp.trainer import Trainer
from helpers.cli import raymp


def test_pipeline_metrics_timeline_and_mlflow_artifacts(group2, tiny_cfg, tmp_path):
    cfg = tiny_cfg(model={"preset": "tiny", "max_seq_len": 64, "n_layers": 4},  # two layers a stage
                   parallel={"dp": 1, "pp": 2, "schedule": "gpipe", "micro_batch_size": 1},
                   tracking={"enabled": True, "experiment": "pp-test"})
    with Trainer(cfg, actor_group=group2, progress=False) as trainer:
        with pytest.raises(RuntimeError, match="no step has run"):
            trainer.timeline()
        assert "pipeline gpipe, 2 stages, layers [2, 2]" in trainer.describe()
        assert [r["stages"] for r in trainer.layout()] == [{0: [0, 1]}, {1: [2, 3]}]
        history = trainer.fit()
        for m in history:
            assert 0 < m["bubble_fraction"] < 1
            assert m["bubble_fraction_theory"] == pytest.approx(1 / 9)  # (p-1)/(m+p-1), m=8, p=2
            assert len(m["stage_busy_s"]) == 2 and m["activation_peak_bytes_max"] > 0
            assert all("pipeline_events" not in r for r in m["per_rank"])
        # fit() saved the last step's timeline in the run directory...
        assert (Path(trainer.run_dir) / "timeline.png").stat().st_size > 5000
        trace = json.loads((Path(trainer.run_dir) / "timeline.json").read_text())
        spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        # 8 forwards (+ 8 loss computations on the last stage) and 8 backwards per stage.
        assert sum(e["name"].startswith("F") for e in spans) == 8 * 2 + 8
        assert sum(e["name"].startswith("B") for e in spans) == 8 * 2
        # ...and the API draws it anywhere.
        paths = trainer.timeline(tmp_path / "elsewhere")
        assert Path(paths["png"]).is_file() and Path(paths["trace"]).is_file()
        run_id, client = trainer.tracker.run_id, trainer.tracker.client
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"timeline.png", "timeline.json", "config.yaml"} <= artifacts
    run = client.get_run(run_id)
    assert run.data.tags["raymp.schedule"] == "gpipe"
    assert run.data.params["parallel.stage_layers"] == "[[0, 1], [2, 3]]"  # the driver's split, recorded
    assert len(client.get_metric_history(run_id, "pipe/bubble")) == 5


def test_timeline_command(tmp_path, data_cache):
    out = raymp("timeline", "configs/tiny-pipeline.yaml", "--steps", "2", "--out", str(tmp_path / "tl"),
                "--set", "parallel.dp=1", "--set", "parallel.micro_batch_size=2", "--set", "train.seq_len=32",
                "--set", "train.global_batch_size=8",  # 4 micro-batches: a bubble to draw
                "--set", f"output_dir={tmp_path}", "--set", f"data.cache_dir={data_cache}")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "bubble" in out.stdout and "theory" in out.stdout
    assert (tmp_path / "tl" / "timeline.png").is_file() and (tmp_path / "tl" / "timeline.json").is_file()
    assert not (tmp_path / "mlflow.db").exists()  # a look, not a tracked run
