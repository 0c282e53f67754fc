"""Tokenize documents and pack them into fixed-length samples of seq_len+1 tokens (inputs + shifted
labels), cached on disk so later runs and every actor load the same array instantly."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from raymp.data.corpus import DataError, fingerprint, read_documents, source_files
from raymp.data.tokenizers import get_tokenizer


@dataclass
class PackedData:
    train: np.ndarray  # [n_train, seq_len + 1] int32
    val: np.ndarray  # [n_val, seq_len + 1] int32
    vocab_size: int
    tokenizer: str

    @property
    def seq_len(self) -> int:
        return self.train.shape[1] - 1


def tokenize_all(docs, tokenizer) -> np.ndarray:
    parts: list[np.ndarray] = []
    eot = np.asarray([tokenizer.eot_id], dtype=np.int32)
    batch: list[str] = []
    encode_batch = getattr(tokenizer, "encode_batch", None)
    for doc in docs:
        if encode_batch is None:
            parts += [tokenizer.encode(doc), eot]
            continue
        batch.append(doc)
        if len(batch) == 4096:
            for ids in encode_batch(batch):
                parts += [ids, eot]
            batch = []
    if batch:
        for ids in encode_batch(batch):
            parts += [ids, eot]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


def pack(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """Non-overlapping windows of seq_len+1 tokens; the tail shorter than a window is dropped
    (and counted in the manifest, never silently)."""
    window = seq_len + 1
    n = len(tokens) // window
    return tokens[: n * window].reshape(n, window)


def load_packed(data_cfg, seq_len: int, seed: int) -> PackedData:
    files = source_files(data_cfg.source)
    tokenizer = get_tokenizer(data_cfg.tokenizer)
    key = f"{fingerprint(files)}-{tokenizer.name}-{seq_len}"
    cache = Path(data_cfg.cache_dir).expanduser() / key
    manifest_path = cache / "manifest.json"
    if manifest_path.is_file():
        samples = np.load(cache / "samples.npy", mmap_mode="r")
        manifest = json.loads(manifest_path.read_text())
    else:
        tokens = tokenize_all(read_documents(files, data_cfg.text_field), tokenizer)
        samples = pack(tokens, seq_len)
        if len(samples) == 0:
            raise DataError(
                f"data.source {data_cfg.source!r} has {len(tokens)} tokens, fewer than one sample of "
                f"train.seq_len+1 = {seq_len + 1}; use more text or a shorter train.seq_len"
            )
        manifest = {
            "files": [str(f) for f in files], "tokenizer": tokenizer.name, "seq_len": seq_len,
            "tokens": int(len(tokens)), "samples": int(len(samples)),
            "dropped_tail_tokens": int(len(tokens) - samples.size),
        }
        _write_cache(cache, samples, manifest)
    n_val = int(round(len(samples) * data_cfg.val_fraction))
    if data_cfg.val_fraction > 0 and n_val == 0:
        n_val = 1
    if len(samples) - n_val < 1:
        raise DataError(f"data.val_fraction {data_cfg.val_fraction} leaves no training samples")
    # The validation split is a fixed, seeded subset so it never depends on the layout.
    perm = np.random.default_rng(seed).permutation(len(samples))
    val_ids, train_ids = np.sort(perm[:n_val]), np.sort(perm[n_val:])
    return PackedData(
        train=np.ascontiguousarray(samples[train_ids]),
        val=np.ascontiguousarray(samples[val_ids]),
        vocab_size=tokenizer.vocab_size,
        tokenizer=tokenizer.name,
    )


def _write_cache(cache: Path, samples: np.ndarray, manifest: dict) -> None:
    """Write to a temp dir then rename, so a crash never leaves a half cache that looks complete."""
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(cache.name + f".tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    np.save(tmp / "samples.npy", samples)
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))
    try:
        os.replace(tmp, cache)
    except OSError:  # another process won the race; its cache is identical
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
