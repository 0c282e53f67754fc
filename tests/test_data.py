"""Tokenizers, packing, the global sample order, and clear errors on bad data."""

from __future__ import annotations

import json

import numpy as np
import pytest

from raymp.config import DataConfig
from raymp.data import DataError, GlobalOrder, load_packed, replica_slice
from raymp.data.tokenizers import get_tokenizer


def test_gpt2_tokenizer_works_offline_with_known_ids():
    tok = get_tokenizer("gpt2")
    ids = tok.encode("In the beginning God created the heaven and the earth.")
    assert list(ids[:3]) == [818, 262, 3726]  # "In", " the", " beginning" in GPT-2's vocab
    assert tok.decode(ids) == "In the beginning God created the heaven and the earth."


def test_byte_tokenizer_round_trip():
    tok = get_tokenizer("byte")
    assert tok.decode(tok.encode("naïve café")) == "naïve café"


def test_kjv_packs_into_full_windows(data_cache):
    data = load_packed(DataConfig(cache_dir=data_cache), seq_len=32, seed=0)
    assert data.train.shape[1] == 33 and data.train.dtype == np.int32
    assert len(data.train) > 100_000 and len(data.val) > 0
    assert data.vocab_size == 256


def test_global_order_covers_each_sample_once_per_epoch_independent_of_dp():
    order = GlobalOrder(num_samples=103, global_batch=8, seed=5)
    per_epoch = 103 // 8
    for epoch in range(3):
        seen = np.concatenate([order.batch(epoch * per_epoch + s) for s in range(per_epoch)])
        assert len(set(seen.tolist())) == len(seen) == per_epoch * 8
    batch = order.batch(4)
    for dp in (1, 2, 4, 8):
        assert np.array_equal(np.concatenate([replica_slice(batch, dp, r) for r in range(dp)]), batch)
    assert not np.array_equal(order.permutation(0), order.permutation(1))


def _cfg(tmp_path, source, **kw):
    return DataConfig(source=str(source), cache_dir=str(tmp_path / "cache"), **kw)


def test_bad_data_errors_name_the_file(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataError, match="empty.txt: file is empty"):
        load_packed(_cfg(tmp_path, empty), 16, 0)

    latin = tmp_path / "latin1.txt"
    latin.write_bytes("ok line\ncaf\xe9".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1.txt: not UTF-8 at byte 11 \(line 2\)"):
        load_packed(_cfg(tmp_path, latin), 16, 0)

    schema = tmp_path / "rows.jsonl"
    schema.write_text(json.dumps({"body": "hello"}) + "\n")
    with pytest.raises(DataError, match="rows.jsonl:1: no 'text' field"):
        load_packed(_cfg(tmp_path, schema), 16, 0)

    short = tmp_path / "short.txt"
    short.write_text("too short")
    with pytest.raises(DataError, match="fewer than one sample"):
        load_packed(_cfg(tmp_path, short), 64, 0)

    with pytest.raises(DataError, match="no such file"):
        load_packed(_cfg(tmp_path, tmp_path / "missing"), 16, 0)


def test_batch_larger_than_dataset_is_refused():
    with pytest.raises(ValueError, match="exceeds the 10 training samples"):
        GlobalOrder(num_samples=10, global_batch=16, seed=0)
