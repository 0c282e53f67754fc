"""The `raymp` console command around cli.main."""

from __future__ import annotations

import pytest


def test_the_raymp_command_exits_with_main_s_code_without_a_last_collection(monkeypatch):
    import gc

    from raymp import cli

    calls = []
    monkeypatch.setattr(cli, "main", lambda: calls.append("main") or 143)
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    with pytest.raises(SystemExit) as exit_:
        cli.console()
    assert exit_.value.code == 143 and calls == ["main", "freeze"]
