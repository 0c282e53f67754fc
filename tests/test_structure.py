"""The package's shape: no import cycle, no stray function-local import, and docs/design.md's size
table generated, not typed."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_no_import_cycle_no_stray_local_import_and_the_design_size_table_is_current():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "structure.py"), "--check"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
