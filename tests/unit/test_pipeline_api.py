"""`raymp timeline` on a run without a pipeline says there is none."""

from __future__ import annotations

from helpers.cli import raymp


def test_timeline_command_needs_a_pipeline():
    out = raymp("timeline", "configs/tiny.yaml")
    assert out.returncode == 2 and "parallel.pp > 1" in out.stderr and "Traceback" not in out.stderr
