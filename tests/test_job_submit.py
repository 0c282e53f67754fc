"""End to end as a cluster user runs it: a Ray head started with `ray start --head` (own temp dir
and ports, token auth as Ray 2.60 sets it), the tiny config submitted with `ray job submit`,
followed to SUCCEEDED with its MLflow run checked; a second job stopped mid-run with
`ray job stop` (ends STOPPED, MLflow run KILLED, no actor left alive); then the head is stopped.
The head runs in its own process group so stopping it never touches the test session's Ray."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_head():
    temp = tempfile.mkdtemp(prefix="rh", dir="/tmp")  # short: Ray's unix socket paths are limited
    port, dash = free_port(), free_port()
    # As cluster/README.md says to start a head: `ray job stop` waits this long after SIGTERM before
    # SIGKILL (3 s by default), room for the stopped run to commit its save and mark its MLflow run
    # KILLED on a busy machine (at 3 s, CI once found the run still RUNNING).
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_ADDRESS": "", "RAY_JOB_STOP_WAIT_TIME_S": "60"}
    env.pop("PYTHONPATH", None)  # the client job runs with the cluster's environment, not this one
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", f"--temp-dir={temp}", f"--port={port}",
         f"--dashboard-port={dash}", "--dashboard-host=127.0.0.1", "--include-dashboard=true",
         # Its own agent ports: the test session's Ray (started earlier) holds the defaults, and a
         # head whose agent cannot bind answers "No available agent to submit job".
         f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
         f"--metrics-export-port={free_port()}", "--num-cpus=4", "--disable-usage-stats"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    address = f"http://127.0.0.1:{dash}"
    client_env = {**env, "RAY_ADDRESS": address}
    deadline = time.time() + 120
    while time.time() < deadline:  # the job server answers once the dashboard is up
        probe = subprocess.run([str(BIN / "ray"), "job", "list"], env=client_env, capture_output=True, text=True)
        if probe.returncode == 0:
            break
        time.sleep(1)
    else:
        os.killpg(head.pid, signal.SIGTERM)
        pytest.fail("the Ray head did not come up within 120 s")
    yield client_env, f"127.0.0.1:{port}"
    os.killpg(head.pid, signal.SIGTERM)
    try:
        head.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(head.pid, signal.SIGKILL)
    shutil.rmtree(temp, ignore_errors=True)


def ray_cli(env, *args, timeout=300):
    return subprocess.run([str(BIN / "ray"), *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def submit(env, *args):
    """`ray job submit`, retried while the head's job agent is still starting: it can answer
    `ray job list` before it takes jobs ("No available agent to submit job")."""
    deadline = time.time() + 90
    while True:
        out = ray_cli(env, "job", "submit", *args)
        if "No available agent" not in out.stdout + out.stderr or time.time() > deadline:
            return out
        time.sleep(2)


def job_status(env, job_id) -> str:
    """From `ray job status`: "Job 'x' succeeded", "... was stopped", "... failed", "... running"."""
    out = ray_cli(env, "job", "status", job_id)
    text = (out.stdout + out.stderr).lower()
    for status, phrase in (("SUCCEEDED", "succeeded"), ("STOPPED", "was stopped"), ("FAILED", "failed"),
                           ("RUNNING", "running"), ("PENDING", "pending")):
        if f"job '{job_id}'" in text and phrase in text:
            return status
    return text


def wait_for(env, job_id, states, timeout=240) -> str:
    deadline = time.time() + timeout
    status = ""
    while time.time() < deadline:
        status = job_status(env, job_id)
        if status in states:
            return status
        time.sleep(1)
    raise AssertionError(f"job {job_id} still {status!r} after {timeout}s")


def test_submit_follow_stop_and_check_mlflow(ray_head, tmp_path, data_cache):
    env, gcs = ray_head
    out_dir = tmp_path / "runs"
    common = ["--set", f"output_dir={out_dir}", "--set", f"data.cache_dir={data_cache}",
              "--set", "tracking.experiment=job-test"]
    done = submit(env, "--submission-id", "raymp-ok", "--working-dir", ".", "--",
                   "raymp", "train", "configs/tiny.yaml", "--set", "train.steps=6", "--set", "train.log_every=2",
                   "--set", "optimizer.warmup_steps=1", *common)
    # `ray job submit` follows the logs and returns when the job ends.
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert wait_for(env, "raymp-ok", {"SUCCEEDED", "FAILED", "STOPPED"}) == "SUCCEEDED"

    # Issue 24: without output_dir, results went into Ray's copy of the working dir, deleted after
    # the job. Now the job fails at once, saying what to set.
    lost = submit(env, "--submission-id", "raymp-relative", "--working-dir", ".", "--",
                  "raymp", "train", "configs/tiny.yaml", "--set", f"data.cache_dir={data_cache}")
    assert lost.returncode != 0
    assert wait_for(env, "raymp-relative", {"SUCCEEDED", "FAILED", "STOPPED"}) == "FAILED"
    logs = ray_cli(env, "job", "logs", "raymp-relative").stdout
    assert "raymp: error: output_dir 'runs' is inside Ray's copy of the job's working directory" in logs, logs
    assert "set output_dir to durable storage" in logs and "Traceback" not in logs
    logs = ray_cli(env, "job", "logs", "raymp-ok").stdout
    assert "step     6/6" in logs and "MLflow run" in logs  # progress streamed into the job logs

    ckpt = tmp_path / "stopped-checkpoints"
    long = submit(env, "--no-wait", "--submission-id", "raymp-stop", "--working-dir",
                   ".", "--", "raymp", "train", "configs/tiny.yaml", "--set", "train.steps=100000",
                   "--set", "train.log_every=1", "--set", "checkpoint.every=2", "--set", f"checkpoint.dir={ckpt}",
                   *common)
    assert long.returncode == 0, long.stderr
    deadline = time.time() + 180
    while "step     4/" not in ray_cli(env, "job", "logs", "raymp-stop").stdout:
        assert time.time() < deadline, "the second job never started training"
        time.sleep(1)
    stop = ray_cli(env, "job", "stop", "raymp-stop")
    assert stop.returncode == 0, stop.stderr
    assert wait_for(env, "raymp-stop", {"SUCCEEDED", "FAILED", "STOPPED"}) == "STOPPED"

    # No actor outlives its job.
    deadline = time.time() + 30
    while True:
        alive = ray_cli(env, "list", "actors", "--filter", "state=ALIVE", "--address", gcs)
        if "Worker" not in alive.stdout or time.time() > deadline:
            break
        time.sleep(1)
    assert alive.returncode == 0, alive.stderr
    assert "Worker" not in alive.stdout, alive.stdout

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{out_dir / 'mlflow.db'}")
    exp = client.get_experiment_by_name("job-test")
    runs = {r.info.status: r for r in client.search_runs([exp.experiment_id])}

    assert set(runs) == {"FINISHED", "KILLED"}, runs.keys()
    # The stopped job kept a committed checkpoint, whole (it exports), tied to its MLflow run.
    from raymp.checkpoint.export import consolidated_weights
    from raymp.checkpoint.store import CheckpointStore

    kept = CheckpointStore(str(ckpt)).latest()
    assert kept is not None and kept.step >= 2 and kept.step % 2 == 0
    # The save in flight at the stop was committed: no written checkpoint lacks its marker.
    written = [d.name for d in ckpt.iterdir() if (d / ".metadata").exists()]
    assert all((ckpt / name / "raymp.json").exists() for name in written), written
    assert kept.meta["mlflow"]["run_id"] == runs["KILLED"].info.run_id
    weights, _ = consolidated_weights(kept.path)
    assert "tok_embeddings.weight" in weights
    finished = runs["FINISHED"]
    assert len(client.get_metric_history(finished.info.run_id, "loss")) == 6
    assert finished.data.tags["raymp.layout"] == "dp2-pp1-tp1-zero2"
