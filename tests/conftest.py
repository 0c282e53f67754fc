"""Shared fixtures: one local Ray instance for the whole session and actor groups reused across
tests (Ray start-up costs ~5 s and each actor ~1-2 s here)."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from unittest import mock

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Every Ray the suite starts (the session's, a CLI run's, a simulated cluster's, the job server's)
# runs its workers at nice 0, not Ray's 15 (its raylet's worker_niceness, read from this variable,
# which their processes inherit). Nearly all of a test's work is in workers, and on a machine busy
# with other work at nice 0 (a CI runner) nice-15 workers get a few percent of a core each: there
# the suite ran past CI's 90 minutes. docs/design.md, "Where the suite's time goes".
os.environ.setdefault("RAY_worker_niceness", "0")

# Tiers: a test's folder is its tier and its marker (`pytest tests/unit` is `pytest -m unit`).
# unit/ uses no Ray. integration/ uses the session's Ray and its actors (the fixtures below).
# system/ drives raymp from outside: subprocesses (the CLI, `ray job submit`, a notebook kernel, an
# MLflow server, a browser) or simulated multi-node clusters.
TIERS = ("unit", "integration", "system")
RAY_FIXTURES = {"ray_local", "data_cache", "group2", "group4", "group8", "tiny_cfg"}


def pytest_collection_modifyitems(config, items):
    misplaced = []
    for item in items:
        tier = item.path.parent.name
        uses_ray = bool(RAY_FIXTURES & set(getattr(item, "fixturenames", ())))
        if tier not in TIERS or (tier == "unit" and uses_ray) or (tier == "integration" and not uses_ray):
            misplaced.append(f"{item.nodeid} (uses the session's Ray: {uses_ray})")
        else:
            item.add_marker(getattr(pytest.mark, tier))
    if misplaced:
        raise pytest.UsageError("tests outside the folder of their tier (tests/unit: no Ray; "
                                "tests/integration: the session's Ray): " + ", ".join(misplaced))


_FIRST_FAILURES = 3  # how many failures of a session print the machine's state
_session: dict = {"reported": 0}


def pytest_configure(config):
    _session["config"] = config
    _stop_on_sigterm()


def _stop_on_sigterm() -> None:
    """SIGTERM (a CI job's time limit) ends the session as Ctrl-C does: pytest's summary and the
    slowest tests' durations, exit 2. By default it kills pytest without a word, and once the
    session's Ray is up Ray's handler made it one test's failure (SystemExit: 15) and the run
    went on (pytest.exit would skip the durations)."""
    def stop(signum, frame):
        raise KeyboardInterrupt("SIGTERM")

    signal.signal(signal.SIGTERM, stop)


def pytest_runtest_logreport(report):
    """The first failures of a session print what the machine had left (disk, memory, open files,
    processes) beside the error's first line, at once: when everything after one test fails on a
    CI machine, its output says why even if the run is cut short."""
    if not report.failed or _session["reported"] >= _FIRST_FAILURES:
        return
    _session["reported"] += 1
    crash = getattr(report.longrepr, "reprcrash", None)
    first = ((crash.message if crash else report.longreprtext.strip()).splitlines() or [""])[0][:300]
    if terminal := _session["config"].pluginmanager.get_plugin("terminalreporter"):
        tag = f"[failure {_session['reported']}]"
        terminal.write_line(f"\n{tag} {report.nodeid} ({report.when}): {first}\n{tag} {machine_state()}")


def machine_state() -> str:
    try:
        return _machine_state()
    except Exception as exc:  # out of files or processes itself: that is the answer
        return f"the machine's state could not be read: {exc!r}"


def _machine_state() -> str:
    def free(path: str) -> str:
        try:
            return f"{shutil.disk_usage(path).free / 2**30:.1f} GiB"
        except OSError as exc:
            return str(exc)

    mem = {}
    try:
        with open("/proc/meminfo") as f:
            mem = {k: v.strip() for k, v in (line.split(":", 1) for line in f)}
    except OSError:
        pass
    fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else -1
    procs = sum(name.isdigit() for name in os.listdir("/proc")) if os.path.isdir("/proc") else -1
    return (f"free: {tempfile.gettempdir()} {free(tempfile.gettempdir())}, cwd {free(os.getcwd())}, "
            f"/dev/shm {free('/dev/shm')}; MemAvailable {mem.get('MemAvailable', '?')}; "
            f"this process's open files {fds}; processes {procs}; load {os.getloadavg()}")


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory, ray_local):
    """Preparing data runs Ray Data tasks: on the session's Ray instance, not one of its own."""
    return str(tmp_path_factory.mktemp("raymp_cache"))


@pytest.fixture(scope="session")
def ray_local():
    import ray

    if not ray.is_initialized():
        # Logical CPUs, not cores: shared groups (2 + 4 + 8 actors) stay up while tests start their own.
        # address="local": a Ray of its own, even while another one runs on this machine. Ray's
        # workers import tests/helpers by name (a factory model, a tokenizer, failing workers).
        helpers = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers")
        # Its log monitor looks for new log files every 2 s, not every 0.1 s (a glob of a folder that
        # gains files with every actor: ~6% of a core through the integration tier). Its workers
        # print nothing the tests read (log_to_driver is off).
        with mock.patch.dict(os.environ, RAY_LOG_MONITOR_MANY_FILES_THRESHOLD="0", LOG_NAME_UPDATE_INTERVAL_S="2"):
            ray.init(address="local", num_cpus=32, include_dashboard=False, log_to_driver=False,
                     runtime_env={"py_modules": [helpers]})
        _stop_on_sigterm()  # ray.init put its own handler in
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def group2(ray_local):
    """The 2-actor group, shared by the integration and system tiers (tests/integration/conftest.py
    has the 4- and 8-actor ones)."""
    from helpers.groups import shared_group

    g = shared_group(2)
    yield g
    g.shutdown()


@pytest.fixture
def tiny_cfg(data_cache, tmp_path):
    """A small, fast run: the tiny model (at the fewest layers its layout takes) on KJV bytes, 5
    steps, clipping active, no validation (a test of validation asks for it: ~1 s a run)."""
    from helpers.tiny_model import at_fewest_layers

    def make(**sections) -> dict:
        cfg = {
            "name": "test",
            "seed": 7,
            "output_dir": str(tmp_path / "runs"),
            "model": {"preset": "tiny", "max_seq_len": 64},
            "parallel": {"dp": 2, "zero": 0, "micro_batch_size": 2},
            "train": {"steps": 5, "global_batch_size": 8, "seq_len": 32, "log_every": 1, "eval_batches": 0},
            "optimizer": {"lr": 1e-2, "warmup_steps": 1, "grad_clip": 1.0},
            "data": {"source": "kjv", "tokenizer": "byte", "cache_dir": data_cache},
            "tracking": {"enabled": False},
        }
        for section, values in sections.items():
            if isinstance(values, dict):
                cfg.setdefault(section, {}).update(values)
            else:
                cfg[section] = values
        return at_fewest_layers(cfg)

    return make
