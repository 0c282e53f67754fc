"""A prepared dataset read back: random access to packed samples by id, from the parquet shards
of any filesystem. Each process keeps the shards it has touched (a few MiB each) in a small cache,
so the stream's tasks read a shard once, not once per batch."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raymp.data.corpus import DataError
from raymp.data.prepare import prepare, read_manifest
from raymp.storage import arrow_fs, join


@dataclass(frozen=True)
class PackedDataset:
    root: str  # the prepared directory (path or URI)
    manifest: dict

    @property
    def num_samples(self) -> int:
        return self.manifest["samples"]

    @property
    def seq_len(self) -> int:
        return self.manifest["seq_len"]

    @property
    def vocab_size(self) -> int:
        return self.manifest["vocab_size"]

    @property
    def eot_id(self) -> int:
        """The end-of-text id that closes every document in the packed stream."""
        return self.manifest["eot_id"]

    @property
    def tokenizer(self) -> str:
        return self.manifest["tokenizer"]

    @property
    def identity(self) -> str:
        """What a saved data position must match to be resumed here."""
        m = self.manifest
        return f"{m['fingerprint']}-{m['tokenizer']}-L{m['seq_len']}"

    def gather(self, ids) -> np.ndarray:
        """Samples `ids` (any order, repeats allowed) as an int32 array [len(ids), seq_len+1]."""
        ids = np.asarray(ids, dtype=np.int64)
        if len(ids) and (ids.min() < 0 or ids.max() >= self.num_samples):
            raise IndexError(f"sample ids must lie in [0, {self.num_samples}) for {self.root}")
        starts = _shard_starts(tuple(s["samples"] for s in self.manifest["shards"]))
        shard_of = np.searchsorted(starts, ids, side="right") - 1
        out = np.empty((len(ids), self.seq_len + 1), dtype=np.int32)
        for shard in np.unique(shard_of):
            rows = shard_of == shard
            tokens = _shard_tokens(self.root, self.manifest["shards"][shard]["file"], self.seq_len + 1)
            out[rows] = tokens[ids[rows] - starts[shard]]
        return out


@functools.lru_cache(maxsize=64)
def _shard_starts(counts: tuple[int, ...]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)


@functools.lru_cache(maxsize=16)
def _shard_tokens(root: str, file: str, window: int) -> np.ndarray:
    fs, path = arrow_fs(root)
    column = pq.read_table(join(path, file), columns=["tokens"], filesystem=fs).column("tokens")
    return np.asarray(column.combine_chunks().flatten()).reshape(-1, window)


def open_packed(root: str) -> PackedDataset:
    manifest = read_manifest(root)
    if manifest is None:
        raise DataError(f"{root} is not a prepared dataset (no manifest.json); run `raymp data prepare`")
    return PackedDataset(root, manifest)


def load_dataset(data_cfg, seq_len: int, log=print, cpu_wait_s: float = 0.0) -> PackedDataset:
    """The packed dataset a run reads: `data.source` itself when it is a prepared directory,
    else the cached preparation of it (prepared now if missing; see prepare's `cpu_wait_s`)."""
    if data_cfg.source != "kjv":
        manifest = read_manifest(data_cfg.source) if _is_dir(data_cfg.source) else None
        if manifest is not None:
            if manifest["seq_len"] != seq_len:
                raise DataError(
                    f"data.source {data_cfg.source} was prepared with seq_len {manifest['seq_len']}, but "
                    f"train.seq_len is {seq_len}: its samples are the wrong length. Set "
                    f"train.seq_len={manifest['seq_len']}, or prepare again with --seq-len {seq_len}"
                )
            return PackedDataset(data_cfg.source, manifest)
    root, manifest = prepare(
        data_cfg.source, tokenizer=data_cfg.tokenizer, seq_len=seq_len, cache_dir=data_cfg.cache_dir,
        text_field=data_cfg.text_field, skip_bad=data_cfg.on_bad_data == "skip", cpu_wait_s=cpu_wait_s,
        log=log,
    )
    return PackedDataset(root, manifest)


def _is_dir(source: str) -> bool:
    try:
        fs, path = arrow_fs(source)
        return fs.get_file_info(path).type == pafs.FileType.Directory
    except (OSError, ValueError):
        return False
