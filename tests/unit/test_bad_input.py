"""Bad input met before anything starts, with no Ray: a data.cache_dir that is a file is one line,
and `raymp runs` never creates the store it was asked to read (the command line in a subprocess)."""

from __future__ import annotations

from helpers.cli import raymp


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


def test_runs_never_creates_the_store_it_was_asked_to_read(tmp_path):
    from raymp.cli import main

    missing = tmp_path / "missing" / "x.db"
    assert main(["runs", "configs/tiny.yaml", "--tracking-uri", f"sqlite:///{missing}"]) == 2
    assert not missing.parent.exists()
