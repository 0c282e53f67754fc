"""Bad input met before anything starts, with no Ray: a data.cache_dir that is a file is one line,
`raymp runs` never creates the store it was asked to read (the command line in a subprocess), and
a local Ray that does not start is one line."""

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


def test_a_local_ray_that_does_not_start_is_one_line(tmp_path, monkeypatch, capsys):
    """Ray's local start-up has a fixed 30 s bound for its raylet to register; on an overloaded
    machine (a CI run beside the loop) it passed and `raymp train` printed Ray's traceback. It is
    one line naming the fix, exit 2; Ray's own exception is faked here, as it is raised."""
    import ray

    from raymp.cli import main

    def timed_out(*args, **kwargs):
        raise Exception("The current node timed out during startup. This could happen because some of the "
                        "raylet failed to startup or the GCS has become overloaded.")

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    # As in a new process: in the whole suite this one already holds the session's Ray (its
    # integration tests ran first), which connect() would join instead of starting one.
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", timed_out)
    assert main(["train", "configs/tiny.yaml", "--set", f"output_dir={tmp_path}", "--no-progress"]) == 2
    printed = capsys.readouterr()
    assert printed.out == "" and printed.err.splitlines() == [
        "raymp: error: Ray could not start a local instance (The current node timed out during startup. This "
        "could happen because some of the raylet failed to startup or the GCS has become overloaded.); on a "
        "busy machine Ray's own 30 s start-up bound (not a setting) can pass: try again when the load is "
        "lower, or join a running cluster with resources.address (or RAY_ADDRESS)"], printed.err
