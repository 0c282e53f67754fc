"""Checkpoint storage and saving without Ray: the store commits atomically, prunes and ignores
unfinished writes; a marker changed after its commit is never read; async saves are snapshots,
whether a thread or DCP's writer process writes."""

from __future__ import annotations

import json
import os

import pytest
import torch

from raymp.checkpoint.store import MARKER, CheckpointError, CheckpointStore, read_marker, storage_reader
from helpers.ports import free_port


def test_store_commits_atomically_prunes_and_ignores_unfinished(tmp_path):
    from raymp.checkpoint.integrity import directory_files

    store = CheckpointStore(f"file://{tmp_path}/ck", keep_last=2)  # a URI: the fsspec path

    def written(step):  # what a save writes: the ranks' shards and DCP's index, hashed
        path = store.prepare(step)
        for name in ("__0_0.distcp", ".metadata"):
            (tmp_path / "ck" / f"step-{step:08d}" / name).write_text(f"{name} of {step}")
        return directory_files(path)

    for step in (2, 4, 6):
        files = written(step)
        assert store.latest() is None or store.latest().step < step  # not committed yet
        store.commit(step, {"data_position": {"step": step}}, files)
    assert [c.step for c in store.committed()] == [4, 6]  # step 2 pruned
    store.prepare(8)  # a write that never finishes
    (tmp_path / "ck" / "step-00000008" / "shard").write_text("half")
    assert store.latest().step == 6 and store.uncommitted() == [f"file://{tmp_path}/ck/step-00000008"]
    with pytest.raises(CheckpointError, match="never committed"):
        read_marker(f"{tmp_path}/ck/step-00000008")
    assert not list((tmp_path / "ck" / "step-00000006").glob("*.tmp"))
    assert json.loads((tmp_path / "ck" / "step-00000006" / MARKER).read_text())["step"] == 6
    store.commit(10, {}, written(10))
    # Committed 6 and 10 kept; unfinished 8 (older than the newest commit) deleted.
    assert [name for name in sorted(os.listdir(tmp_path / "ck"))] == ["step-00000006", "step-00000010"]


@pytest.mark.parametrize("writer", [True, "process"], ids=["thread", "process"])
def test_async_save_is_a_snapshot(tmp_path, writer):
    """DCP's own async staging reads live CPU storage in the background: a step that runs while
    the write is in flight would leak into the checkpoint (docs/design.md trap). raymp copies first,
    whether a thread or DCP's writer process writes."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from raymp.checkpoint.rank_state import RankCheckpointer, host_copy
    from raymp.checkpoint.writer_process import close_writer_process

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        checkpointer = RankCheckpointer(0, 1, dist.new_group(backend="gloo"))
        weight = torch.randn(4096, 1024)  # 16 MB: the write is still going when the update lands
        before = weight.clone()
        checkpointer.write(host_copy({"model.w": weight}), str(tmp_path / "a"), 1, async_save=writer)
        weight.add_(1.0)  # the next optimizer step, in place
        report = checkpointer.wait()
        assert report["step"] == 1 and report["error"] is None
        assert sorted(report["files"]) == [".metadata", "__0_0.distcp"]  # hashed for the marker
        loaded = {"model.w": torch.zeros_like(weight)}
        dcp.load(loaded, storage_reader=storage_reader(str(tmp_path / "a")))  # through the one-rank group
        assert torch.equal(loaded["model.w"], before)
    finally:
        close_writer_process()
        dist.destroy_process_group()


def test_a_marker_changed_after_its_commit_is_never_read(tmp_path):
    """The marker carries a checksum of its own content: a changed data position (re-serialised
    whole, so the JSON still reads) or a marker without the checksum is damaged."""
    from raymp.checkpoint.store import MARKER_DIGEST

    store = CheckpointStore(str(tmp_path / "ck"))
    store.prepare(2)
    store.commit(2, {"data_position": {"epoch": 0, "offset": 16}})
    marker = tmp_path / "ck" / "step-00000002" / MARKER
    meta = json.loads(marker.read_text())
    assert read_marker(str(marker.parent)).data_position["offset"] == 16
    marker.write_text(json.dumps({**meta, "data_position": {"epoch": 0, "offset": 17}}))
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        read_marker(str(marker.parent))
    marker.write_text(json.dumps({k: v for k, v in meta.items() if k != MARKER_DIGEST}))
    with pytest.raises(CheckpointError, match="carries no checksum of its own"):
        read_marker(str(marker.parent))
    assert [e.problem is not None for e in store.scan()] == [True]
