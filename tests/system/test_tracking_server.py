"""MLflow over HTTP, as a team shares it: a real `mlflow server --workers 1` started by the test,
two short training runs logged to it, and everything read back through the REST API; then
`raymp runs` lists and compares them from the same server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from raymp import Trainer
from raymp.cli import main
from helpers.ports import free_port

BIN = Path(sys.executable).parent


def get(url: str, endpoint: str, **query) -> dict:
    with urllib.request.urlopen(f"{url}{endpoint}?{urllib.parse.urlencode(query)}", timeout=30) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    server = subprocess.Popen(
        [
            str(BIN / "mlflow"),
            "server",
            "--workers",
            "1",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            f"sqlite:///{root}/server.db",
            "--artifacts-destination",
            str(root / "artifacts"),
        ],
        stdout=open(root / "server.log", "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=root,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            break
        except OSError:
            assert server.poll() is None, (root / "server.log").read_text()[-3000:]
            time.sleep(0.5)
    else:
        os.killpg(server.pid, signal.SIGTERM)
        pytest.fail(
            "mlflow server did not answer within 120 s:\n" + (root / "server.log").read_text()[-3000:]
        )
    yield url
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:  # a busy machine (CI, load 200: over 30 s): the test's work is done
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


@pytest.fixture(scope="module")
def two_runs(mlflow_server, group2, data_cache, tmp_path_factory):
    root = tmp_path_factory.mktemp("tracked")
    ids = []
    for name, zero, extra in (("server-a", 0, {}), ("server-b", 2, {"system_metrics": True,
                                                                     "system_metrics_interval_s": 0.5})):
        cfg = {
            "name": "tracked", "seed": 3, "output_dir": str(root / "runs"),
            "model": {"preset": "tiny", "max_seq_len": 64},
            "parallel": {"dp": 2, "zero": zero, "micro_batch_size": 2},
            "train": {"steps": 4, "global_batch_size": 8, "seq_len": 32, "log_every": 1, "eval_every": 2},
            "optimizer": {"warmup_steps": 1},
            "data": {"source": "kjv", "tokenizer": "byte", "cache_dir": data_cache, "val_fraction": 0.05},
            "checkpoint": {"every": 2, "dir": str(root / name)},
            "tracking": {"tracking_uri": mlflow_server, "experiment": "server-test", "run_name": name,
                         "flush_every": 2, **extra},
        }
        with Trainer(cfg, actor_group=group2, progress=False) as t:
            t.fit()
            ids.append(t.tracker.run_id)
    return ids


def test_rest_api_returns_params_tags_metric_histories_and_artifacts(mlflow_server, two_runs):
    run = get(mlflow_server, "/api/2.0/mlflow/runs/get", run_id=two_runs[1])["run"]
    assert run["info"]["status"] == "FINISHED" and run["info"]["run_name"] == "server-b"
    params = {p["key"]: p["value"] for p in run["data"]["params"]}
    assert params["parallel.dp"] == "2" and params["parallel.zero"] == "2" and params["train.steps"] == "4"
    assert params["model.dim"] == "64" and int(params["data.train_samples"]) > 0
    tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
    assert tags["raymp.layout"] == "dp2-pp1-tp1-zero2" and tags["raymp.world_size"] == "2"
    assert tags["raymp.device"] == "cpu" and tags["raymp.backend"] == "gloo"
    for key in ("torch.version", "ray.version", "raymp.version", "ray.address", "raymp.checkpoint"):
        assert tags[key], key
    assert tags["raymp.checkpoint"].endswith("step-00000004")
    every = [0, 1, 2, 3]
    for key, steps in (
        ("fit/loss", every),
        ("fit/lr", every),
        ("speed/tok_s", every),
        ("fit/grad_norm", every),
        ("speed/step_s", every),
        ("speed/data_frac", every),
        ("mem/peak_mb", every),
        ("speed/tflops", every),
        ("restart/count", every),
        ("fit/val_loss", [1, 3]),
    ):
        history = get(
            mlflow_server, "/api/2.0/mlflow/metrics/get-history", run_id=two_runs[1], metric_key=key
        )
        assert sorted(m["step"] for m in history["metrics"]) == steps, key
    metric_keys = {m["key"] for m in run["data"]["metrics"]}
    assert any(k.startswith("system/cpu_utilization") for k in metric_keys), metric_keys
    assert "speed/mfu" not in metric_keys  # no known peak on CPU: no made-up MFU
    # MLflow's chart view: one section per prefix, alphabetically, the training curves first; every
    # name whole in a chart's title
    assert sorted({k.split("/")[0] for k in metric_keys}) == ["fit", "mem", "restart", "speed", "system"]
    assert max(len(k) for k in metric_keys if not k.startswith("system/")) <= 15, metric_keys
    files = {
        f["path"] for f in get(mlflow_server, "/api/2.0/mlflow/artifacts/list", run_id=two_runs[1])["files"]
    }
    assert {"config.yaml", "layout.json", "loss_curve.png"} <= files


def test_runs_command_lists_and_compares(mlflow_server, two_runs, capsys, tmp_path):
    assert main(["runs", "--tracking-uri", mlflow_server, "--experiment", "server-test"]) == 0
    out = capsys.readouterr().out
    assert "2 run(s)" in out and "server-a" in out and "server-b" in out
    assert "dp2-pp1-tp1-zero0" in out and "dp2-pp1-tp1-zero2" in out
    assert main(["runs", "--tracking-uri", mlflow_server, "--experiment", "server-test",
                 "--compare", two_runs[0][:8], "server-b"]) == 0
    table = capsys.readouterr().out
    assert "param parallel.zero" in table and "param train.steps" not in table  # only what differs
    assert "fit/loss" in table and "speed/tok_s_med" in table  # the throughput `raymp runs` shows
    png = tmp_path / "compare.png"
    assert main(["runs", "--tracking-uri", mlflow_server, "--experiment", "server-test",
                 "--compare", "server-a", "server-b", "--plot", str(png)]) == 0
    assert f"loss, tokens/s and peak memory by step: {png}" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_a_killed_run_is_resumed_by_run_id(mlflow_server, two_runs, group2, data_cache, tmp_path):
    cfg = {
        "name": "tracked", "seed": 3, "output_dir": str(tmp_path / "runs"),
        "model": {"preset": "tiny", "max_seq_len": 64},
        "parallel": {"dp": 2, "zero": 0, "micro_batch_size": 2},
        "train": {"steps": 6, "global_batch_size": 8, "seq_len": 32, "eval_batches": 0},
        "optimizer": {"warmup_steps": 1},
        "data": {"source": "kjv", "tokenizer": "byte", "cache_dir": data_cache},
        "tracking": {"tracking_uri": mlflow_server, "experiment": "server-test",
                     "resume_run_id": two_runs[0]},
    }
    for _ in range(2):  # killed and resumed twice: each resume keeps its own record
        with Trainer(cfg, actor_group=group2, progress=False) as t:
            t.fit(1)
            assert t.tracker.run_id == two_runs[0]
    run = get(mlflow_server, "/api/2.0/mlflow/runs/get", run_id=two_runs[0])["run"]
    files = {f["path"] for f in get(mlflow_server, "/api/2.0/mlflow/artifacts/list", run_id=two_runs[0],
                                    path="events")["files"]}
    assert {"events/resume-1.json", "events/resume-2.json"} <= files
    assert {t["key"]: t["value"] for t in run["data"]["tags"]}["raymp.events"] == "2"
    bad = dict(cfg, tracking={**cfg["tracking"], "resume_run_id": "0" * 32})
    with pytest.raises(Exception, match="tracking.resume_run_id"):
        Trainer(bad, actor_group=group2, progress=False).setup()


def test_ui_screenshot_compares_the_runs(mlflow_server, two_runs, tmp_path):
    """scripts/mlflow_ui_screenshot.py against the server: the chart-compare view of the
    experiment renders its charts (it waits for them), and the rendered page names both runs."""
    from scripts.mlflow_ui_screenshot import find_browser, rendered_charts, shoot  # `python -m pytest` from the root

    if find_browser() is None:
        pytest.skip("Chromium is not installed (Debian: apt-get install -y chromium)")
    png, dom = shoot(mlflow_server, "server-test", tmp_path / "ui.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    assert "server-a" in dom and "server-b" in dom
    charts = rendered_charts(dom)  # drawn, not spinners: raymp's step metrics, both runs in each
    assert {"fit/grad_norm", "fit/loss", "fit/lr"} <= set(charts), charts
    assert next(c for c in charts if "/" in c).startswith("fit/")  # the training section comes first
