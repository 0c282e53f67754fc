"""Where a run keeps what it writes. `output_dir` is the run's storage, like Ray Train's
`RunConfig(storage_path)`: a local or shared path, or a URI of any filesystem pyarrow or fsspec
knows (s3://, gs://, hdfs://, abfs://, file://). The run directories (config.yaml, checkpoints)
and the prepared-data cache go under it.

One module reads a location both ways, because two libraries consume it: DCP's writer and the
checkpoint store speak fsspec, Ray Data's reads speak pyarrow. Both used to parse locations on their
own; now they cannot disagree on what one means."""

from __future__ import annotations

import os
import posixpath
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pyarrow.fs as pafs

# The embedded MLflow store is a sqlite file, which needs a local path.
NEEDS_A_TRACKING_SERVER = (
    "output_dir {location!r} is a URI, and MLflow's default store is a sqlite file under output_dir, "
    "which must be a local path: set tracking.tracking_uri to a tracking server (http://<host>:5000; "
    "cluster/README.md shows one) or tracking.enabled=false")


def is_uri(location: str | os.PathLike) -> bool:
    return "://" in str(location)


def join(location: str | os.PathLike, *parts: str) -> str:
    """`location`/parts, keeping a URI's scheme (os.path.join would, but Path() folds its '//')."""
    if is_uri(location):
        return posixpath.join(str(location), *parts)
    return str(Path(location).expanduser().joinpath(*parts))


def absolute(location: str | os.PathLike) -> str:
    """A URI as it is; a path with ~ expanded, made absolute (the same on every node that shares it)."""
    return str(location) if is_uri(location) else str(Path(location).expanduser().resolve())


def fsspec_fs(location: str | os.PathLike):
    """(fsspec filesystem, path inside it): what DCP's fsspec reader and writer use."""
    import fsspec

    if not is_uri(location):
        return fsspec.filesystem("file"), absolute(location)
    return fsspec.core.url_to_fs(str(location))


def arrow_fs(location: str | os.PathLike):
    """(pyarrow filesystem, path inside it): what Ray Data reads and writes through. pyarrow's own
    filesystems where it has one (s3, gs, hdfs), any other scheme through fsspec."""
    if not is_uri(location):
        return pafs.LocalFileSystem(), absolute(location)
    try:
        return pafs.FileSystem.from_uri(str(location))
    except (ValueError, NotImplementedError):  # ArrowInvalid / ArrowNotImplementedError: unknown scheme
        fs, path = fsspec_fs(location)
        return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path


def make_dirs(location: str | os.PathLike) -> None:
    fs, path = fsspec_fs(location)
    fs.makedirs(path, exist_ok=True)


def write_text(location: str | os.PathLike, text: str) -> None:
    fs, path = fsspec_fs(location)
    with fs.open(path, "w") as f:
        f.write(text)


@contextmanager
def staged(location: str):
    """A local directory for files bound for `location`: the location itself when it is a path;
    for a URI a temporary one, whose files are uploaded there on a clean exit (matplotlib and
    MLflow's log_artifact write and read local files only)."""
    if not is_uri(location):
        Path(location).expanduser().mkdir(parents=True, exist_ok=True)
        yield Path(location).expanduser()
        return
    with tempfile.TemporaryDirectory(prefix="raymp-staged-") as local:
        yield Path(local)
        fs, path = fsspec_fs(location)
        fs.makedirs(path, exist_ok=True)
        for file in sorted(Path(local).iterdir()):
            fs.put_file(str(file), f"{path}/{file.name}")


def remove_if_empty(location: str | os.PathLike) -> None:
    """Remove a directory only if nothing is in it (a set-up that failed leaves no empty run
    directory; object stores have no empty directories to remove)."""
    fs, path = fsspec_fs(location)
    try:
        if fs.isdir(path) and not fs.ls(path):
            fs.rmdir(path)
    except OSError:
        pass


def check_writable(location: str | os.PathLike) -> None:
    """Create `location` and write, read back and delete a small file there; OSError (or the
    filesystem's own error) if that cannot be done."""
    fs, path = fsspec_fs(location)
    probe = f"{path}/.raymp-write-probe-{os.getpid()}"
    fs.makedirs(path, exist_ok=True)
    with fs.open(probe, "w") as f:
        f.write("ok")
    with fs.open(probe, "r") as f:
        if f.read() != "ok":
            raise OSError(f"{location}: a file written there read back different")
    fs.rm(probe)


def free_space_note(location: str | os.PathLike) -> str:
    """", N MiB free on its disk" for a local path (what a failed write most often lacks, and
    torch's writer may say only "unexpected pos 704 vs 598"); "" for a URI or a path not there."""
    if is_uri(location) and not str(location).startswith("file://"):
        return ""
    path = Path(str(location).removeprefix("file://"))
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return ""
    return f", {free / 2**20:,.1f} MiB free on the disk holding {path}"


def default_tracking_uri(output_dir: str) -> str:
    """The embedded MLflow store: a sqlite database in output_dir. ValueError, naming the fix,
    when output_dir is a URI (a database file cannot live in an object store)."""
    if is_uri(output_dir):
        raise ValueError(NEEDS_A_TRACKING_SERVER.format(location=output_dir))
    return f"sqlite:///{Path(absolute(output_dir)) / 'mlflow.db'}"


def local_artifact_root(output_dir: str) -> str:
    """Where the embedded store keeps artifacts: beside its database (MLflow's default, ./mlruns
    in the current directory, would scatter a run's data; docs/design.md)."""
    return (Path(absolute(output_dir)) / "mlartifacts").as_uri()
