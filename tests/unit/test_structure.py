"""The package's shape: no import cycle, no stray function-local import, and docs/design.md's size
table generated, not typed."""

import subprocess
import sys

from helpers.cli import ROOT


def test_no_import_cycle_no_stray_local_import_and_the_design_size_table_is_current():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "structure.py"), "--check"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_a_subpackage_cycle_is_found_even_when_no_two_modules_import_each_other():
    import importlib.util

    spec = importlib.util.spec_from_file_location("structure", ROOT / "scripts" / "structure.py")
    structure = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(structure)
    graph = {
        "raymp.data.prepare": {"raymp.runtime.cluster"},
        "raymp.runtime.cluster": {"raymp.config.schema"},
        "raymp.config.schema": set(),
        "raymp.config.rules": {"raymp.data.tokenizers"},
        "raymp.data.tokenizers": set(),
        "raymp.storage": set(),
    }
    assert structure.cycles(graph) == []
    assert structure.cycles(structure.subpackage_graph(graph)) == [
        ["raymp.config", "raymp.data", "raymp.runtime"]
    ]
