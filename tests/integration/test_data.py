"""Preparing data on Ray Data (read, tokenize, pack, parquet shards + manifest), reuse of a prepared
dataset, sources by URI, pluggable tokenizers, and clear errors or counted skips on bad data."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raymp.config import DataConfig
from raymp.data import DataError, load_dataset, open_packed
from raymp.data.corpus import kjv_path
from raymp.data.prepare import MANIFEST, prepare, read_manifest
from raymp.data.tokenizers import get_tokenizer


def test_kjv_prepared_in_parallel_equals_sequential_packing(data_cache):
    """Ray Data tokenizes blocks in parallel; the packed result must be exactly what one process
    gets by tokenizing the verses in order, joining them with end-of-text, and cutting windows."""
    data = load_dataset(DataConfig(cache_dir=data_cache), 32, log=lambda *_: None)
    m = data.manifest
    tok = get_tokenizer("byte")
    verses = [json.loads(line)["text"] for line in kjv_path().read_text().splitlines() if line.strip()]
    stream = np.concatenate([np.append(tok.encode(v), tok.eot_id) for v in verses]).astype(np.int32)
    n = len(stream) // 33
    assert (m["documents"], m["tokens"], m["samples"]) == (len(verses), len(stream), n)
    assert m["dropped_tail_tokens"] == len(stream) - 33 * n
    assert len(m["shards"]) >= 2  # 16384 samples a shard: ids cross shard boundaries below
    ids = np.array([0, 1, 16383, 16384, n - 1, 5])
    assert np.array_equal(data.gather(ids), stream[: 33 * n].reshape(n, 33)[ids])
    assert tok.decode(data.gather([0])[0]).startswith("In the beginning God created")
    assert m["tokenizer"] == "byte" and m["vocab_size"] == 256 and len(m["fingerprint"]) == 16


def test_prepared_dataset_is_reused_and_a_half_written_one_is_not(tmp_path, ray_local):
    src = tmp_path / "corpus.txt"
    src.write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    kw = dict(tokenizer="byte", seq_len=16, cache_dir=str(tmp_path / "cache"), log=lambda *_: None)
    root, first = prepare(str(src), **kw)
    root2, again = prepare(str(src), **kw)
    assert root2 == root and again["created"] == first["created"]  # read back, not re-made
    # A crash before the manifest (the commit marker) was written: the directory is not a dataset.
    (tmp_path / "cache" / root.rsplit("/", 1)[1] / MANIFEST).unlink()
    assert read_manifest(root) is None
    with pytest.raises(DataError, match="not a prepared dataset"):
        open_packed(root)
    root3, remade = prepare(str(src), **kw)
    assert root3 == root and remade["samples"] == first["samples"]
    src.write_text("changed text, so a new fingerprint " * 20)
    root4, _ = prepare(str(src), **kw)
    assert root4 != root


def test_directory_of_jsonl_parquet_and_text_by_uri(tmp_path, ray_local):
    d = tmp_path / "mixed"
    d.mkdir()
    (d / "a.jsonl").write_text("\n".join(json.dumps({"body": f"row {i} " * 5}) for i in range(20)))
    pq.write_table(pa.table({"body": [f"parquet {i} " * 5 for i in range(20)]}), d / "b.parquet")
    (d / "c.txt").write_text("plain text file " * 30)
    cfg = DataConfig(source=f"file://{d}", text_field="body", cache_dir=str(tmp_path / "cache"))
    data = load_dataset(cfg, 16, log=lambda *_: None)
    assert data.manifest["files"] == 3 and data.manifest["documents"] == 41
    text = get_tokenizer("byte").decode(data.gather(np.arange(data.num_samples)).ravel())
    assert text.index("row 0") < text.index("parquet 0") < text.index("plain text")
    # The prepared directory itself can be the source; a different seq_len is refused.
    assert load_dataset(DataConfig(source=data.root), 16).num_samples == data.num_samples
    with pytest.raises(DataError, match="prepared with seq_len 16, but train.seq_len is 32"):
        load_dataset(DataConfig(source=data.root), 32)


def _cfg(tmp_path, source, **kw):
    return DataConfig(source=str(source), cache_dir=str(tmp_path / "cache"), **kw)


def _load(cfg, seq_len=16):
    return load_dataset(cfg, seq_len, log=lambda *_: None)


def test_bad_data_errors_name_the_file_and_the_fix(tmp_path, ray_local):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataError, match="empty.txt: file is empty; or set data.on_bad_data=skip"):
        _load(_cfg(tmp_path, empty))

    latin = tmp_path / "latin1.txt"
    latin.write_bytes("ok line\ncaf\xe9".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1.txt: not UTF-8 at byte 11 \(line 2\)"):
        _load(_cfg(tmp_path, latin))

    schema = tmp_path / "rows.jsonl"
    schema.write_text(json.dumps({"body": "hello"}) + "\n")
    with pytest.raises(DataError, match="rows.jsonl:1: no 'text' field"):
        _load(_cfg(tmp_path, schema))

    table = tmp_path / "t.parquet"
    pq.write_table(pa.table({"content": ["x"]}), table)
    with pytest.raises(DataError, match=r"t.parquet: no column 'text' \(columns: content\)"):
        _load(_cfg(tmp_path, table))

    short = tmp_path / "short.txt"
    short.write_text("too short")
    with pytest.raises(DataError, match="fewer than one sample"):
        _load(_cfg(tmp_path, short), 64)

    with pytest.raises(DataError, match="no such file"):
        _load(_cfg(tmp_path, tmp_path / "missing"))


def test_bad_records_are_skipped_and_counted_when_asked(tmp_path, ray_local):
    d = tmp_path / "messy"
    d.mkdir()
    good = [json.dumps({"text": f"good document number {i} " * 3}) for i in range(30)]
    lines = good[:10] + ["{not json"] + good[10:20] + [json.dumps({"body": "x"})] + good[20:]
    (d / "a.jsonl").write_text("\n".join(lines))
    (d / "b.txt").write_text("")
    (d / "c.txt").write_bytes(b"fine line\n\xff\xfe broken line\nanother fine line " * 3)
    data = _load(_cfg(tmp_path, d, on_bad_data="skip"))
    m = data.manifest
    assert m["skipped"] == {"bad_json": 1, "bad_schema": 1, "empty_file": 1, "not_utf8": 3}
    assert m["documents"] == 31  # 30 good rows + what is left of c.txt
    assert any("a.jsonl:11" in e for e in m["skipped_examples"])
    assert any(e.startswith("empty_file") and "b.txt" in e for e in m["skipped_examples"])
    assert "broken" not in get_tokenizer("byte").decode(data.gather(np.arange(data.num_samples)).ravel())


def test_pluggable_tokenizer(tmp_path, ray_local):
    src = tmp_path / "c.txt"
    src.write_text("abcdefghijklmnopqrstuvwxyz" * 4)
    data = _load(_cfg(tmp_path, src, tokenizer="helpers.plugins:ReversedBytes"))
    assert data.tokenizer == "reversed-bytes"
    assert bytes(data.gather([0])[0][:3].astype(np.uint8)) == b"zyx"
    with pytest.raises(ValueError, match="cannot load"):
        get_tokenizer("no_such_module:Thing")


def test_preparing_while_every_cpu_is_taken_waits_for_one_then_names_the_knob(tmp_path, ray_local, monkeypatch):
    """Actors holding every CPU (an actor group made beforehand, a busy shared cluster): Ray
    would queue the preparation's tasks forever (it did: a run hung without a word). It waits for
    a free CPU on the node that reads the file, at most the bound. Ray's count of free CPUs is
    replaced here: the suite's shared Ray is not emptied for one test."""
    from raymp.data import ray_context

    src = tmp_path / "corpus.txt"
    src.write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    kw = dict(tokenizer="byte", seq_len=16, cache_dir=str(tmp_path / "cache"), log=lambda *_: None)
    asked = []

    def free_cpus(node_id):
        asked.append(node_id)
        return 0 if len(asked) < 3 or refuse else 2

    refuse = True
    monkeypatch.setattr(ray_context, "free_cpus", free_cpus)
    with pytest.raises(DataError, match=r"needs 1 free CPU for its Ray Data tasks, but the driver's node "
                                        r"\(the data is a local path there\) had 0 free for 0.5 s "
                                        r"\(resources.placement_timeout_s\): free CPUs there"):
        prepare(str(src), cpu_wait_s=0.5, **kw)
    assert set(asked) == {ray_local.get_runtime_context().get_node_id()}
    asked.clear()
    refuse = False  # two CPUs free at the third look: it prepares
    _, manifest = prepare(str(src), cpu_wait_s=120, **kw)
    assert len(asked) == 3 and manifest["samples"] > 0
