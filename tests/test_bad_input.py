"""Bad input met at start (issue 24): a tracking store MLflow cannot use or reach, an output_dir or
data.cache_dir that cannot be written, a model too large for the cluster's memory. Each is one
line that names the field and the fix, comes before any actor is placed, and leaves nothing
behind (no run directory, config.yaml or MLflow database)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from raymp.checkpoint.store import CheckpointError
from raymp.config import ConfigError
from raymp.data import DataError
from raymp.trainer import Trainer
from helpers.cli import ROOT, raymp
from helpers.ports import free_port


@pytest.fixture
def listener():
    """A server that accepts connections and never answers (a hung tracking server)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


def _refused_port() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


def _nothing_left(out_dir) -> None:
    assert not out_dir.exists() or not any(out_dir.iterdir()), list(out_dir.iterdir())


@pytest.mark.parametrize("case", ["unknown scheme", "refused", "never answers", "sqlite dir"])
def test_a_tracking_store_that_cannot_be_used_fails_before_anything_starts(
    case, tiny_cfg, tmp_path, listener
):
    uri, expected = {
        "unknown scheme": ("foo://bar", r"tracking.tracking_uri foo://bar: MLflow cannot use it \(it has no "
                                        r"store for foo:// URIs\); use sqlite:///<path>.db"),
        "refused": (_refused_port(), r"the MLflow server did not answer \(.*refused.*; waited at most 1 s\); "
                                     r"start it"),
        "never answers": (listener, r"the MLflow server did not answer \(.*timed out.*waited at most 1 s\)"),
        "sqlite dir": ("sqlite:////proc/raymp-no/x.db", r"tracking.tracking_uri: cannot create the MLflow "
                                                        r"database's directory /proc/raymp-no"),
    }[case]
    cfg = tiny_cfg(tracking={"enabled": True, "tracking_uri": uri, "connect_timeout_s": 1})
    with pytest.raises(ConfigError, match=expected):
        Trainer(cfg, progress=False).setup()
    _nothing_left(tmp_path / "runs")


def test_an_output_dir_that_cannot_be_written_is_named(tiny_cfg):
    cfg = tiny_cfg(output_dir="/proc/raymp-no/runs")
    with pytest.raises(
        ConfigError, match=r"output_dir /proc/raymp-no/runs is not writable \(.*\); set output_dir"
    ):
        Trainer(cfg, progress=False).setup()


def test_a_cache_dir_that_cannot_be_written_is_named(tiny_cfg, tmp_path, ray_local):
    cfg = tiny_cfg(data={"source": "kjv", "tokenizer": "byte", "cache_dir": "/proc/raymp-no/cache"})
    with pytest.raises(DataError, match=r"data.cache_dir /proc/raymp-no/cache: cannot create .*; set "
                                        r"data.cache_dir to a place this user can write"):
        Trainer(cfg, progress=False).setup()
    _nothing_left(tmp_path / "runs")


def test_a_cache_dir_that_is_a_file_is_one_line_before_anything_starts(tmp_path):
    """data.cache_dir naming a file: one line, exit 2, before Ray or the data (once a pyarrow
    traceback from inside the data preparation)."""
    (tmp_path / "a-file").write_text("")
    proc = raymp("train", "configs/tiny.yaml", "--set", f"data.cache_dir={tmp_path / 'a-file'}", "--set",
                 f"output_dir={tmp_path / 'runs'}", "--no-progress")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"raymp: error: data.cache_dir {tmp_path / 'a-file'} is a file, not a "
        "directory; set data.cache_dir to a directory (it is made if "
        "missing), or move the file away"
    ]


def test_an_unwritable_checkpoint_dir_fails_before_the_data_is_prepared(tiny_cfg, tmp_path):
    cfg = tiny_cfg(checkpoint={"every": 2, "dir": "/proc/raymp-no/checkpoints"},
                   data={"source": "kjv", "tokenizer": "byte", "cache_dir": str(tmp_path / "never-made")})
    with pytest.raises(CheckpointError, match=r"checkpoint.dir /proc/raymp-no/checkpoints is not writable"):
        Trainer(cfg, progress=False).setup()
    assert not (tmp_path / "never-made").exists()  # nothing was prepared


def test_a_model_too_large_for_the_cluster_is_refused_before_any_actor(tiny_cfg, tmp_path, ray_local):
    cfg = tiny_cfg(model={"preset": "llama-8b", "vocab_size": None, "max_seq_len": 64})
    placed = len(ray_local.util.placement_group_table())
    with pytest.raises(
        ConfigError,
        match=r"the model does not fit in memory: the planner estimates [\d.,]+ GiB per "
        r"rank .* but the largest node has [\d.,]+ GiB .*; shard it",
    ):
        Trainer(cfg, progress=False).setup()
    assert len(ray_local.util.placement_group_table()) == placed  # no actor was placed
    _nothing_left(tmp_path / "runs")


def test_runs_never_creates_the_store_it_was_asked_to_read(tmp_path):
    from raymp.cli import main

    missing = tmp_path / "missing" / "x.db"
    assert main(["runs", "configs/tiny.yaml", "--tracking-uri", f"sqlite:///{missing}"]) == 2
    assert not missing.parent.exists()


@pytest.mark.system
def test_the_command_line_says_it_in_one_line_with_exit_2(tmp_path):
    out = raymp("train", "configs/tiny.yaml", "--set", "tracking.tracking_uri=foo://bar",
                "--set", f"output_dir={tmp_path / 'runs'}")
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        "raymp: error: tracking.tracking_uri foo://bar: MLflow cannot use it (it has no store for foo:// URIs); "
        "use sqlite:///<path>.db, http(s)://<server>, or leave it unset for the store under output_dir"
    ]
    assert out.stdout == ""
    _nothing_left(tmp_path / "runs")


@pytest.mark.system
@pytest.mark.parametrize(
    "case",
    [
        "config is a directory",
        "invalid YAML",
        "auto without a cluster",
        "parallel: search",
        "layout search without a cluster",
        "checkpoint list of a missing dir",
        "data source of a dangling link",
        "cpus_per_actor above the machine",
    ],
)
def test_each_bad_path_or_file_is_one_line_with_exit_2(tmp_path, case):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("model:\n  preset: tiny\n bad: [\n")
    auto = tmp_path / "auto.yaml"
    auto.write_text("parallel: auto\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "gone.txt").symlink_to(tmp_path / "moved-away.txt")
    train = ["train", "configs/tiny.yaml", "--no-progress", "--set", f"output_dir={tmp_path / 'runs'}"]
    args, expected = {
        "data source of a dangling link": (
            [
                *train,
                "--set",
                f"data.source={tmp_path / 'data'}",
                "--set",
                f"data.cache_dir={tmp_path / 'cache'}",
            ],
            f"{tmp_path / 'data' / 'gone.txt'} is a link to a file that does not exist",
        ),
        "cpus_per_actor above the machine": (
            [*train, "--set", f"resources.cpus_per_actor={(os.cpu_count() or 1) + 1}"],
            f"is more than this machine's {os.cpu_count()} CPUs",
        ),
        "config is a directory": (["config", str(tmp_path)], f"config path '{tmp_path}' is a directory"),
        "invalid YAML": (["config", str(bad_yaml)], f"{bad_yaml}: not valid YAML at line 3, column 2:"),
        "auto without a cluster": (["config", str(auto)], "parallel: auto needs a cluster section"),
        "layout search without a cluster": (
            ["sweep", "--layouts", "3", "configs/tiny.yaml"],
            "a layout search plans for the config's cluster section",
        ),
        "parallel: search": (
            ["config", "configs/tiny.yaml", "--set", "parallel=search"],
            "parallel: search is a measurement, not a layout: run `raymp sweep --layouts N CONFIG`",
        ),
        "checkpoint list of a missing dir": (
            ["checkpoint", "list", str(tmp_path / "nope")],
            f"{tmp_path / 'nope'} is not a directory; give a run's checkpoint.dir",
        ),
    }[case]
    out = raymp(*args)
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    # A config's own rule names its section on a second line (invalid config (<file>):\n  <field>: ...).
    assert len(lines) <= 2 and expected in out.stderr and "Traceback" not in out.stderr, out.stderr


@pytest.mark.system
def test_version_and_a_mistyped_command_import_no_torch_pydantic_or_ray():
    """Start-up: a command imports what it needs when it needs it (import log, not a clock)."""
    for args in (["--version"], ["trian"]):
        out = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "raymp.cli", *args],
            capture_output=True,
            text=True,
            env={**os.environ, "RAY_ADDRESS": ""},
        )
        imported = {line.split("|")[-1].strip() for line in out.stderr.splitlines() if "|" in line}
        assert not {"torch", "pydantic", "ray"} & imported, sorted(imported & {"torch", "pydantic", "ray"})
    config = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "raymp.cli", "config", "configs/tiny.yaml"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    imported = {line.split("|")[-1].strip() for line in config.stderr.splitlines() if "|" in line}
    assert config.returncode == 0 and not {"ray", "torch.distributed.checkpoint"} & imported


@pytest.mark.system
def test_a_run_shorter_than_its_warmup_says_so_once_and_trains(tmp_path):
    out = raymp("train", "configs/tiny.yaml", "--set", "train.steps=2", "--set", f"output_dir={tmp_path}",
                "--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", "tracking.enabled=false")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("note: optimizer.warmup_steps (10) is not below train.steps (2)") == 1, out.stdout
    assert "step 2/2" in out.stdout or "2/2" in out.stdout
