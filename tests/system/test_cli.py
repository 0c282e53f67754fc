"""The command line as a user runs it: a real training run in a fresh process with its own local
Ray, bad configs that exit 2 with one message and no traceback, and the README/CI contract."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from helpers.cli import ROOT, raymp

NOISE = ("WARNING", " INFO ", "Traceback", "Fatal Python error", "Warning:", "SIGABRT")


def noise(printed: str) -> str:
    """The printed lines with a NOISE word, first (a failure's first line is what a CI log shows),
    then everything printed."""
    lines = [line for line in printed.splitlines() if any(word in line for word in NOISE)]
    return "\n".join(lines) + "\n--- all it printed:\n" + printed if lines else ""


def test_train_tiny_prints_falling_loss_and_nothing_else(tmp_path):
    """Its own cache: preparing the data (Ray Data's tasks) is part of what must print cleanly, and
    so is MLflow's system-metrics monitor."""
    out = raymp("train", "configs/tiny.yaml", "--set", "train.steps=12", "--set", "train.log_every=4",
                "--set", "optimizer.warmup_steps=2", "--set", f"output_dir={tmp_path}",
                "--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", "tracking.system_metrics=true")
    printed = out.stdout + out.stderr
    assert out.returncode == 0, f"exit {out.returncode}: {printed}"
    assert not noise(printed), noise(printed)
    assert printed.startswith("preparing 'kjv'"), printed[:500]
    losses = [float(x) for x in re.findall(r"^step\s+\d+/12\s+loss (\d+\.\d+)", out.stdout, re.M)]
    assert len(losses) >= 3 and losses[-1] < losses[0] - 0.5, out.stdout
    assert "dp=2 pp=1 tp=1 zero=2" in out.stdout
    assert "MLflow run" in out.stdout and (tmp_path / "mlflow.db").is_file()


def test_bad_config_exits_2_with_field_and_no_traceback():
    out = raymp("train", "configs/tiny.yaml", "--set", "parallel.tp=3")
    assert out.returncode == 2
    assert "parallel.tp (3) must divide model.n_heads (4)" in out.stderr
    assert "Traceback" not in out.stderr
    out = raymp("train", "configs/nope.yaml")
    assert out.returncode == 2 and "not found" in out.stderr


def test_sweep_prints_its_table_and_nothing_else(tmp_path):
    """The example sweep, shortened: 2 trials without early stopping. Tune's progress tables, file
    loggers and INFO lines stay out; the trials' table and the best trial are what it prints."""
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(f"base: {ROOT / 'configs/tiny.yaml'}\nset: [train.steps=4, optimizer.warmup_steps=1]\n"
                     "space: {parallel.zero: {grid: [0, 2]}}\nasha: null\n")
    out = raymp(
        "sweep", str(sweep), "--set", f"output_dir={tmp_path}", "--set", f"data.cache_dir={tmp_path / 'c'}"
    )
    printed = out.stdout + out.stderr
    assert out.returncode == 0, f"exit {out.returncode}: {printed}"
    assert not noise(printed), noise(printed)
    rows = [line for line in out.stdout.splitlines() if re.match(r"^\w+_0000[01]\s", line)]
    assert len(rows) == 2 and all(" completed" in r for r in rows), f"trial rows {rows}: {out.stdout}"
    assert re.search(r"^best: trial \w+, loss=\d", out.stdout, re.M), f"no best trial: {out.stdout}"
    out = raymp("sweep", str(sweep), "--set", "parallel.dp=3")  # the base config refuses it, as train would
    assert (
        out.returncode == 2 and "Traceback" not in out.stderr and "train.global_batch_size (32)" in out.stderr
    )
    sweep.write_text(sweep.read_text().replace("parallel.zero", "parallel.zeroo"))
    out = raymp("sweep", str(sweep))
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("raymp: error: sweep space: parallel.zeroo=0 is refused: "), out.stderr


def test_config_command_prints_resolved_yaml():
    out = raymp("config", "configs/tiny.yaml", "--set", "parallel.zero=3")
    assert out.returncode == 0 and "zero: 3" in out.stdout and "dim: 64" in out.stdout


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    test_cmd = next(b.strip() for b in blocks if "pytest" in b)
    assert test_cmd in ci, "the README's test command and .ci/run have drifted apart"


def test_data_prepare_stops_on_bad_records_or_skips_and_counts_them(tmp_path):
    rows = [f'{{"text": "line {i} of a small corpus for the prepare command"}}' for i in range(40)]
    rows.insert(2, '{"text": broken')
    (tmp_path / "a.jsonl").write_text("\n".join(rows))
    args = ("data", "prepare", "--source", str(tmp_path / "a.jsonl"), "--seq-len", "32",
            "--cache-dir", str(tmp_path / "cache"))
    out = raymp(*args)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "a.jsonl:3: not valid JSON" in out.stderr and "data.on_bad_data=skip" in out.stderr
    assert "Traceback" not in out.stderr
    out = raymp(*args, "--skip-bad")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "from 40 documents" in out.stdout and "SKIPPED 1 bad_json" in out.stdout
    root = re.search(r"^dataset: (\S+)$", out.stdout, re.M).group(1)
    assert (Path(root) / "manifest.json").is_file() and list(Path(root).glob("shard-*.parquet"))


def _signal_on_line(proc, prefix: str, signum) -> str:
    """Send `signum` to `proc` once its output has a line starting with `prefix`; its whole output."""
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.startswith(prefix):
                break
        proc.send_signal(signum)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return "".join(seen) + out


def test_sigint_stops_a_run_started_with_sigint_ignored(tmp_path):
    """A command started in the background by a script (or CI) inherits SIGINT ignored; `kill -INT`
    must still stop it as Ctrl-C does (once it trained to its end instead). Its output piped as a
    job log is (stdout and stderr in one stream, no PYTHONUNBUFFERED): each step line arrives as
    it is made, and the stop's line comes after the last of them."""
    import signal

    proc = subprocess.Popen(
        [sys.executable, "-m", "raymp.cli", "train", "configs/tiny.yaml", "--set", "train.steps=500",
         "--set", "train.log_every=1", "--set", "checkpoint.every=0", "--set", "tracking.enabled=false",
         "--set", f"output_dir={tmp_path / 'runs'}"],
        cwd=ROOT, env={**{k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}, "RAY_ADDRESS": ""},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    # The event (a step line: plain lines off a terminal), not a clock.
    lines = _signal_on_line(proc, "step ", signal.SIGINT).splitlines()
    assert proc.returncode == 130, "\n".join(lines[-20:])
    stopped = next(
        i for i, line in enumerate(lines) if line.startswith("raymp: stopped by SIGINT")
    )
    last_step = max(i for i, line in enumerate(lines) if line.startswith("step "))
    assert last_step < stopped and "step   500/500" not in lines[last_step], lines[-20:]


def test_sigterm_while_the_run_is_set_up_stops_it_without_a_crash_dump(tmp_path):
    """ray.init gives SIGTERM to abseil's failure handler (a stack dump, exit 134); a stop that
    arrives once Ray is connected and the data prepared, while the actors start, ends the run as
    `ray job stop` should: exit 143, one line, no dump."""
    import signal

    proc = subprocess.Popen(
        [sys.executable, "-m", "raymp.cli", "train", "configs/tiny.yaml", "--set", "train.steps=500",
         "--set", "checkpoint.every=0", "--set", "tracking.enabled=false",
         "--set", f"output_dir={tmp_path / 'runs'}"],
        cwd=ROOT, env={**os.environ, "RAY_ADDRESS": ""}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    text = _signal_on_line(proc, "prepared ", signal.SIGTERM)  # the data is prepared: Ray is connected
    assert proc.returncode == 143, text[-3000:]
    assert "raymp: stopped by SIGTERM" in text and "SIGTERM received" not in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]


def test_sigterm_stops_a_sweep_and_marks_its_runs_killed(tmp_path):
    """`ray job stop` sends SIGTERM: the sweep ends with status 143, and the trial it interrupted
    and the sweep's own MLflow run end KILLED (not RUNNING forever), the trial with why."""
    import signal
    import time

    from mlflow.tracking import MlflowClient

    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(f"name: long\nbase: {ROOT / 'configs/tiny.yaml'}\nasha: null\n"
                     "set: [train.steps=500, checkpoint.every=0]\nspace: {parallel.zero: {grid: [0, 2]}}\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "raymp.cli", "sweep", str(sweep), "--set", f"output_dir={tmp_path}"],
        cwd=ROOT,
        env={**os.environ, "RAY_ADDRESS": ""},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")

    def trial_runs():
        exp = client.get_experiment_by_name("raymp")
        return (
            []
            if exp is None
            else client.search_runs([exp.experiment_id], "attributes.run_name LIKE 'long-%'")
        )

    try:
        # The event: the first trial's MLflow run exists (its actors are up), within a bound.
        deadline = time.monotonic() + 300
        while not trial_runs():
            assert proc.poll() is None and time.monotonic() < deadline, "no trial started"
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, out  # 128 + SIGTERM, as a shell reports a process ended by it
    assert "raymp: stopped by SIGTERM" in out and "Traceback" not in out, out
    runs = {
        r.info.run_name: r for r in client.search_runs([client.get_experiment_by_name("raymp").experiment_id])
    }
    assert runs["long"].info.status == "KILLED"
    trials = [r for name, r in runs.items() if name.startswith("long-")]
    assert len(trials) == 1 and trials[0].info.status == "KILLED"
    assert trials[0].data.tags["raymp.trial_stop"] == "the sweep was stopped (Ctrl-C or SIGTERM)"
