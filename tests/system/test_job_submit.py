"""End to end as a cluster user runs it, following cluster/README.md: a token, a 0-CPU head and a
worker node started with `ray start` (own temp dirs and ports), a client environment with Ray and no
raymp, the tiny config submitted from it with `ray job submit`,
followed to SUCCEEDED with its MLflow run checked; a second job stopped mid-run with
`ray job stop` (ends STOPPED, MLflow run KILLED, no actor left alive); then the head is stopped.
The head runs in its own process group so stopping it never touches the test session's Ray."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from helpers.ports import free_port
from helpers.cli import ROOT

BIN = Path(sys.executable).parent
# How long the head's job server may take to answer: a bound, not a pause (the wait ends when it
# answers). A head started while the 2-core machine ran the suite and a second pytest (load ~18)
# did not answer within 120 s.
HEAD_UP_S = 300


def client_without_raymp(root: Path) -> Path:
    """A client environment in which Ray imports and raymp does not, as on a laptop that only has
    `pip install "ray[default]"`: a venv whose one .pth line adds this environment's
    site-packages as a plain path. Python runs .pth files only in site directories, so the
    editable install's finder there never runs and `import raymp` fails; no download needed. Its
    `ray` is a launcher of Ray's own CLI. Returns the directory of its `python` and `ray`."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    import ray

    packages = Path(ray.__file__).resolve().parent.parent
    (next(root.glob("lib/python*/site-packages")) / "cluster_packages.pth").write_text(f"{packages}\n")
    ray_cli = root / "bin" / "ray"
    ray_cli.write_text(f"#!{root / 'bin' / 'python'}\nimport sys\nfrom ray.scripts.scripts import main\n"
                       "sys.exit(main())\n")
    ray_cli.chmod(0o755)
    return root / "bin"


def _stop(process) -> None:
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)


@pytest.fixture
def ray_head():
    """A cluster set up as cluster/README.md says: the auth token generated first, a head with no
    CPU (as the shipped cluster configs make it), a worker node with 4 CPUs joining with the token,
    a client given RAY_AUTH_MODE=token and RAY_AUTH_TOKEN. Each node has its own temp dir (two
    nodes sharing one session dir on one machine remove each other's copy of the job's working
    directory) and its own ports, and runs in its own process group."""
    temp = tempfile.mkdtemp(prefix="rh", dir="/tmp")  # short: Ray's unix socket paths are limited
    home = Path(temp, "home")  # the token file goes to ~/.ray/auth_token: never the user's own
    home.mkdir()
    # RAY_JOB_STOP_WAIT_TIME_S, as cluster/README.md says to start a head: `ray job stop` waits this
    # long after SIGTERM before SIGKILL (3 s by default), room for the stopped run to commit its save
    # and mark its MLflow run KILLED on a busy machine (at 3 s, CI once found the run still RUNNING).
    # PATH: the nodes have raymp installed, as after `pip install raymp` on each node (the job's
    # entrypoint runs in the head's environment); the client has only Ray (client_without_raymp).
    env = {**os.environ, "HOME": str(home), "RAY_AUTH_MODE": "token", "RAY_ADDRESS": "",
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "RAY_JOB_STOP_WAIT_TIME_S": "60"}
    env.pop("PYTHONPATH", None)  # the client job runs with the cluster's environment, not this one
    client_bin = client_without_raymp(Path(temp, "client"))
    check = subprocess.run([str(client_bin / "python"), "-c", "import ray, importlib.util as u; "
                            "print(u.find_spec('raymp') is None)"], env=env, capture_output=True, text=True,
                           cwd=temp, timeout=120)
    assert (
        check.stdout.strip() == "True"
    ), f"the client environment is not Ray-only: {check.stdout}{check.stderr}"
    token = subprocess.run([str(BIN / "ray"), "get-auth-token", "--generate"], env=env, capture_output=True,
                           text=True, timeout=60).stdout.strip()
    assert len(token) >= 32, "ray get-auth-token --generate gave no token"
    port, dash = free_port(), free_port()
    # Its own agent ports: the test session's Ray (started earlier) holds the defaults, and a
    # node whose agent cannot bind answers "No available agent to submit job".
    agent = lambda: [  # noqa: E731
        f"--dashboard-agent-listen-port={free_port()}",
        f"--dashboard-agent-grpc-port={free_port()}",
        f"--metrics-export-port={free_port()}",
        "--disable-usage-stats",
        "--block",
    ]
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", f"--temp-dir={temp}/head", f"--port={port}",
         f"--dashboard-port={dash}", "--dashboard-host=127.0.0.1", "--include-dashboard=true",
         "--num-cpus=0", *agent()],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    node_env = {**env, "RAY_AUTH_TOKEN": token}
    client_env = {
        **node_env,
        "RAY_ADDRESS": f"http://127.0.0.1:{dash}",
        "RAYMP_TEST_CLIENT_BIN": str(client_bin),
        "PATH": f"{client_bin}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    worker = None
    try:
        deadline = time.time() + HEAD_UP_S
        while True:  # the job server answers once the dashboard is up
            probe = ray_cli(client_env, "job", "list")
            if probe.returncode == 0:
                break
            assert time.time() < deadline, f"the Ray head did not come up within {HEAD_UP_S} s (HEAD_UP_S)"
            time.sleep(1)
        worker = subprocess.Popen(
            [str(BIN / "ray"), "start", f"--address=127.0.0.1:{port}", f"--temp-dir={temp}/worker",
             "--num-cpus=4", f"--node-manager-port={free_port()}", f"--object-manager-port={free_port()}",
             f"--runtime-env-agent-port={free_port()}", *agent()],
            env=node_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        # Its own bound, from its own start: on a loaded machine the head's start once used most of
        # a shared one, and the worker (started in a minute there) was found missing.
        joined_by = time.time() + 240
        status_args = ("status", "--address", f"127.0.0.1:{port}")
        while "0.0/4.0 CPU" not in (status := ray_cli(node_env, *status_args)).stdout:
            why = status.stdout + status.stderr
            assert time.time() < joined_by, f"the worker node did not join in 240 s: {why}"
            time.sleep(1)
        yield client_env, f"127.0.0.1:{port}"
    finally:
        for process in (worker, head):
            if process is not None:
                _stop(process)
        shutil.rmtree(temp, ignore_errors=True)


def ray_cli(env, *args, timeout=300):
    """`ray` as the client runs it (Ray only, no raymp) where the env is the client's, else the
    cluster nodes' own."""
    ray = Path(env.get("RAYMP_TEST_CLIENT_BIN", BIN)) / "ray"
    return subprocess.run(
        [str(ray), *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


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
    job = ["--working-dir", ".", "--", "raymp", "train", "configs/tiny.yaml"]  # each job's entrypoint
    done = submit(env, "--submission-id", "raymp-ok", *job, "--set", "train.steps=6",
                  "--set", "train.log_every=2", "--set", "optimizer.warmup_steps=1", *common)
    # `ray job submit` follows the logs and returns when the job ends.
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert wait_for(env, "raymp-ok", {"SUCCEEDED", "FAILED", "STOPPED"}) == "SUCCEEDED"

    # Issue 24: without output_dir, results went into Ray's copy of the working dir, deleted after
    # the job. Now the job fails at once, saying what to set.
    lost = submit(env, "--submission-id", "raymp-relative", *job, "--set", f"data.cache_dir={data_cache}")
    assert lost.returncode != 0
    assert wait_for(env, "raymp-relative", {"SUCCEEDED", "FAILED", "STOPPED"}) == "FAILED"
    logs = ray_cli(env, "job", "logs", "raymp-relative").stdout
    assert "raymp: error: output_dir 'runs' is inside Ray's copy of the job's working directory" in logs, logs
    assert "set output_dir to durable storage" in logs and "Traceback" not in logs
    logs = ray_cli(env, "job", "logs", "raymp-ok").stdout
    assert "step     6/6" in logs and "MLflow run" in logs  # progress streamed into the job logs

    ckpt = tmp_path / "stopped-checkpoints"
    long = submit(env, "--no-wait", "--submission-id", "raymp-stop", *job, "--set", "train.steps=100000",
                  "--set", "train.log_every=1", "--set", "checkpoint.every=2",
                  "--set", f"checkpoint.dir={ckpt}", *common)
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

    assert set(runs) == {"FINISHED", "KILLED"}, (
        runs.keys(),
        ray_cli(env, "job", "logs", "raymp-stop").stdout[-3000:],
    )
    # The stopped job kept a committed checkpoint, whole (it exports), tied to its MLflow run.
    from raymp.checkpoint.export import consolidated_weights, intact_checkpoint
    from raymp.checkpoint.store import CheckpointStore

    kept = CheckpointStore(str(ckpt)).latest()
    assert kept is not None and kept.step >= 2 and kept.step % 2 == 0
    # The save in flight at the stop was committed: no written checkpoint lacks its marker.
    written = [d.name for d in ckpt.iterdir() if (d / ".metadata").exists()]
    assert all((ckpt / name / "raymp.json").exists() for name in written), written
    assert kept.meta["mlflow"]["run_id"] == runs["KILLED"].info.run_id
    weights = consolidated_weights(intact_checkpoint(kept.path)[0])  # verifies first
    assert "tok_embeddings.weight" in weights
    finished = runs["FINISHED"]
    assert len(client.get_metric_history(finished.info.run_id, "fit/loss")) == 6
    assert finished.data.tags["raymp.layout"] == "dp2-pp1-tp1-zero2"
