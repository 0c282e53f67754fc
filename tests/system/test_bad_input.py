"""Bad input on the command line, as a user meets it: one line that names the field and the fix,
exit status 2, nothing left behind; `raymp --version` and a mistyped command import no torch,
pydantic or Ray; a run shorter than its warm-up says so once and trains."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers.cli import ROOT, assert_nothing_left, raymp


def test_the_command_line_says_it_in_one_line_with_exit_2(tmp_path):
    out = raymp("train", "configs/tiny.yaml", "--set", "tracking.tracking_uri=foo://bar",
                "--set", f"output_dir={tmp_path / 'runs'}")
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        "raymp: error: tracking.tracking_uri foo://bar: MLflow cannot use it (it has no store for foo:// URIs); "
        "use sqlite:///<path>.db, http(s)://<server>, or leave it unset for the store under output_dir"
    ]
    assert out.stdout == ""
    assert_nothing_left(tmp_path / "runs")


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


def test_a_command_imports_what_it_needs_when_it_needs_it():
    """Start-up (import log, not a clock): --version and a mistyped command import no torch,
    pydantic or Ray; loading a config, or refusing one, no torch or Ray."""
    for args in (["--version"], ["trian"]):
        out = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "raymp.cli", *args],
            capture_output=True,
            text=True,
            env={**os.environ, "RAY_ADDRESS": ""},
        )
        imported = {line.split("|")[-1].strip() for line in out.stderr.splitlines() if "|" in line}
        assert not {"torch", "pydantic", "ray"} & imported, sorted(imported & {"torch", "pydantic", "ray"})
    # Loading and checking a config needs the model's shape, not its code: neither the resolved
    # config nor a config refused by the layout rules imports torch or Ray.
    refused = ["train", "configs/tiny.yaml", "--set", "parallel.tp=3"]
    for args, code in ((["config", "configs/tiny.yaml"], 0), (refused, 2)):
        config = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "raymp.cli", *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ, "RAY_ADDRESS": ""},
        )
        imported = {line.split("|")[-1].strip() for line in config.stderr.splitlines() if "|" in line}
        assert config.returncode == code, (args, config.returncode, config.stderr[-500:])
        assert not {"ray", "torch"} & imported, (args, sorted({"ray", "torch"} & imported))


def test_a_run_shorter_than_its_warmup_says_so_once_and_trains(tmp_path):
    out = raymp("train", "configs/tiny.yaml", "--set", "train.steps=2", "--set", f"output_dir={tmp_path}",
                "--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", "tracking.enabled=false")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("note: optimizer.warmup_steps (10) is not below train.steps (2)") == 1, out.stdout
    assert "step 2/2" in out.stdout or "2/2" in out.stdout
