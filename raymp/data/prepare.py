"""Text to packed samples on Ray Data: read files -> parse -> tokenize in parallel -> pack into
windows of seq_len+1 tokens -> parquet shards + manifest.json.

The manifest is written last, so its presence is the commit marker: a directory without one (a
crash mid-prepare) is never read, and the next prepare writes it again.

Packing runs on the driver as the tokenized blocks stream in (in order): it is a concatenation,
cheap next to tokenizing, and doing it in one place makes the packed order deterministic.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import time
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray

from raymp.data.corpus import DataError, Skip, Source, parse_file, resolve_source
from raymp.data.ray_context import (
    local_node_if_local_path,
    offers_no_cpu,
    on_node,
    ordered_context,
    wait_for_free_cpu,
)
from raymp.data.tokenizers import get_tokenizer
from raymp.ray_connection import connect
from raymp.storage import absolute, arrow_fs, join

MANIFEST = "manifest.json"
FORMAT = "raymp-packed-v1"
MAX_SKIP_EXAMPLES = 20


def cache_key(source: Source, tokenizer_name: str, seq_len: int) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in tokenizer_name)
    return f"{source.fingerprint()}-{safe}-L{seq_len}"


def read_manifest(root: str) -> dict | None:
    """The manifest of a prepared directory, or None if it is not (completely) prepared."""
    fs, path = arrow_fs(root)
    try:
        with fs.open_input_stream(join(path, MANIFEST)) as f:
            return json.loads(f.read().decode())
    except FileNotFoundError:
        return None


def prepare(source_name: str, *, tokenizer: str, seq_len: int, cache_dir: str, text_field: str = "text",
            skip_bad: bool = False, shard_samples: int = 16384, docs_per_block: int = 2048,
            cpu_wait_s: float = 0.0, log=print) -> tuple[str, dict]:
    """Prepare `source_name` (or find it already prepared). Returns (dataset root, manifest).
    `cpu_wait_s`: how long to wait for a free CPU to prepare on (a run passes
    resources.placement_timeout_s; 0: refused at once if none is free)."""
    source = resolve_source(source_name)
    tok = get_tokenizer(tokenizer)
    root = join(absolute(cache_dir), cache_key(source, tok.name, seq_len))
    manifest = read_manifest(root)
    if manifest is not None:
        return root, manifest
    log(f"preparing {source_name!r} ({len(source.paths)} file(s), {sum(source.sizes) / 2**20:.1f} MiB) "
        f"with tokenizer {tok.name}, seq_len {seq_len} -> {root}")
    t0 = time.perf_counter()
    fs, path = arrow_fs(root)
    try:
        fs.create_dir(path, recursive=True)
    except OSError as exc:
        raise DataError(f"data.cache_dir {cache_dir}: cannot create {root} ({exc}); set data.cache_dir to a "
                        "place this user can write (a path or a URI)") from None
    packer = _ShardWriter(fs, path, seq_len + 1, shard_samples)
    skipped: Counter = Counter()
    examples: list[str] = []
    documents = 0
    for block in _tokenized_blocks(source, tokenizer, text_field, skip_bad, docs_per_block, cpu_wait_s):
        for tokens, docs, skips in zip(block["tokens"], block["documents"], block["skips"]):
            packer.add(np.asarray(tokens, dtype=np.int32))
            documents += int(docs)
            for reason, where, message in json.loads(skips):
                if not skip_bad:
                    raise Skip(reason, where, message).error()
                skipped[reason] += 1
                if len(examples) < MAX_SKIP_EXAMPLES:
                    examples.append(f"{reason}: {where}")
    packer.finish()
    if packer.samples == 0:
        raise DataError(
            f"data.source {source_name!r} has {packer.tokens} tokens, fewer than one sample of "
            f"train.seq_len+1 = {seq_len + 1}; use more text or a shorter train.seq_len"
        )
    seconds = time.perf_counter() - t0
    manifest = {
        "format": FORMAT, "source": source_name, "files": len(source.paths),
        "fingerprint": source.fingerprint(), "tokenizer": tok.name, "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id, "seq_len": seq_len, "documents": documents, "tokens": packer.tokens,
        "samples": packer.samples, "dropped_tail_tokens": packer.tokens - packer.samples * (seq_len + 1),
        "shards": packer.shards, "skipped": dict(skipped), "skipped_examples": examples,
        "created": _dt.datetime.now().isoformat(timespec="seconds"), "seconds": round(seconds, 2),
        "tokens_per_s": round(packer.tokens / seconds),
    }
    _write_manifest(fs, path, manifest)
    log(describe(manifest))
    return root, manifest


def describe(manifest: dict) -> str:
    line = (f"prepared {manifest['tokens']:,} {manifest['tokenizer']} tokens from {manifest['documents']:,} "
            f"documents -> {manifest['samples']:,} samples of {manifest['seq_len'] + 1} tokens in "
            f"{len(manifest['shards'])} shard(s) ({manifest['tokens_per_s']:,} tokens/s)")
    if manifest["skipped"]:
        counts = ", ".join(f"{n} {reason}" for reason, n in sorted(manifest["skipped"].items()))
        line += f"; SKIPPED {counts} (e.g. {manifest['skipped_examples'][0]})"
    return line


def _write_manifest(fs, path: str, manifest: dict) -> None:
    tmp = join(path, f"{MANIFEST}.tmp-{os.getpid()}")
    with fs.open_output_stream(tmp) as f:
        f.write(json.dumps(manifest, indent=2).encode())
    fs.move(tmp, join(path, MANIFEST))


class _ShardWriter:
    """Cuts a token stream into windows of `window` tokens and writes them, `shard_samples` at a
    time, as parquet shards (columns sample_id, tokens). The tail shorter than a window is
    dropped and counted in the manifest."""

    def __init__(self, fs, path: str, window: int, shard_samples: int):
        self.fs, self.path, self.window, self.shard_samples = fs, path, window, shard_samples
        self.pending: list[np.ndarray] = []
        self.pending_tokens = 0
        self.tokens = self.samples = 0
        self.shards: list[dict] = []

    def add(self, tokens: np.ndarray) -> None:
        self.pending.append(tokens)
        self.pending_tokens += len(tokens)
        self.tokens += len(tokens)
        while self.pending_tokens >= self.window * self.shard_samples:
            self._flush(self.shard_samples)

    def finish(self) -> None:
        if self.pending_tokens >= self.window:
            self._flush(self.pending_tokens // self.window)

    def _flush(self, n: int) -> None:
        flat = np.concatenate(self.pending)
        take = n * self.window
        rest = flat[take:]
        self.pending, self.pending_tokens = [rest], len(rest)
        tokens = pa.FixedSizeListArray.from_arrays(pa.array(flat[:take]), self.window)
        ids = pa.array(np.arange(self.samples, self.samples + n, dtype=np.int64))
        name = f"shard-{len(self.shards):05d}.parquet"
        pq.write_table(pa.table({"sample_id": ids, "tokens": tokens}), join(self.path, name),
                       filesystem=self.fs)
        self.shards.append({"file": name, "samples": n})
        self.samples += n


# -- the Ray Data part ------------------------------------------------------------------------

def _tokenized_blocks(source: Source, tokenizer: str, text_field: str, skip_bad: bool, docs_per_block: int,
                      cpu_wait_s: float):
    """Blocks of {tokens, documents, skips}, in file and document order, tokenized in parallel."""
    connect(None, 1)
    ordered_context()  # the packed order must not depend on which task finishes first
    node = local_node_if_local_path(source.name)
    # The read runs on `node` (no CPU reserved where it offers none), the tokenizing anywhere.
    reader_node = None if offers_no_cpu(node) else node
    wait_for_free_cpu(reader_node, cpu_wait_s, f"preparing data.source {source.name!r}")
    ds = ray.data.read_binary_files(  # local files are read on this node, a URI anywhere
        list(source.paths),
        filesystem=source.filesystem,
        include_paths=True,
        override_num_blocks=len(source.paths),
        **on_node(node),
        **({"num_cpus": 0} if offers_no_cpu(node) else {}),
    )
    ds = ds.map_batches(
        _parse_batch, batch_size=1, fn_kwargs={"text_field": text_field, "skip_bad": skip_bad}
    )
    # One big file is one block after parsing; split it so its documents tokenize in parallel.
    ds = ds.repartition(target_num_rows_per_block=docs_per_block)
    ds = ds.map_batches(_tokenize_batch, batch_size=docs_per_block, fn_kwargs={"tokenizer": tokenizer})
    yield from ds.iter_batches(batch_size=None, batch_format="numpy")


def _parse_batch(batch: dict, text_field: str, skip_bad: bool) -> dict:
    texts, skips = [], []
    for path, raw in zip(batch["path"], batch["bytes"]):
        for item in parse_file(str(path), bytes(raw), text_field, skip_bad):
            if isinstance(item, Skip):
                texts.append(""), skips.append(json.dumps([item.reason, item.where, item.message]))
            else:
                texts.append(item), skips.append("")
    return {"text": np.asarray(texts, dtype=object), "skip": np.asarray(skips, dtype=object)}


def _tokenize_batch(batch: dict, tokenizer: str) -> dict:
    """One output row per batch: the batch's documents tokenized and joined, each followed by
    the end-of-text token, plus the skipped records it carried."""
    tok = get_tokenizer(tokenizer)
    docs = [t for t, skip in zip(batch["text"], batch["skip"]) if not skip]
    encoded = tok.encode_batch(docs) if hasattr(tok, "encode_batch") else [tok.encode(d) for d in docs]
    eot = np.asarray([tok.eot_id], dtype=np.int32)
    parts = [p for ids in encoded for p in (np.asarray(ids, dtype=np.int32), eot)]
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    skips = [json.loads(skip) for skip in batch["skip"] if skip]
    out_tokens = np.empty(1, dtype=object)
    out_tokens[0] = tokens
    return {"tokens": out_tokens, "documents": np.asarray([len(docs)]),
            "skips": np.asarray([json.dumps(skips)], dtype=object)}
