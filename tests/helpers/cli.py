"""The command line in a subprocess, as a user runs it, never attached to the test session's Ray."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository


def raymp(*args, cwd=ROOT, timeout=300):
    env = {**os.environ, "RAY_ADDRESS": ""}  # never attach to a cluster from the test session
    return subprocess.run([sys.executable, "-m", "raymp.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def assert_nothing_left(out_dir) -> None:
    """A refused run leaves no run directory, config.yaml or MLflow database behind."""
    assert not out_dir.exists() or not any(out_dir.iterdir()), list(out_dir.iterdir())
