"""raymp's DCP storage (raw_storage.py): tensors go to the files as their raw bytes and come back
the same, on a path and a URI; checkpoints written by torch.save (DCP's own writer) still load;
DCP's own reader refuses raw files rather than misreading them; a short or mis-sized file is an
error, never a tensor of the wrong bytes; the writer's checksum of its file is the file's, so the
rank does not read it back."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from raymp.checkpoint.store import storage_reader, storage_writer

pytestmark = [pytest.mark.unit, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model.w": torch.randn(6, 4, generator=g).t(),  # not contiguous
        "model.half": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        "optim.step": torch.tensor(7, dtype=torch.int64),  # 0-dim
        "empty": torch.empty(0, 3),
        "scheduler": '{"last_epoch": 7}',  # BYTE_IO
        "blob": io.BytesIO(b"\x00\x01raw"),
    }


def _empty_like(sd: dict) -> dict:
    def empty(v):
        if isinstance(v, torch.Tensor):
            return torch.zeros_like(v)
        return "" if isinstance(v, str) else io.BytesIO()

    return {k: empty(v) for k, v in sd.items()}


def _same(loaded: dict, sd: dict) -> None:
    for key, value in sd.items():
        if isinstance(value, torch.Tensor):
            assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
    assert loaded["scheduler"] == sd["scheduler"]
    assert loaded["blob"].getvalue() == b"\x00\x01raw"


@pytest.mark.parametrize("uri", [False, True], ids=["path", "fsspec"])
def test_writer_hashes_its_file_as_written(tmp_path, uri, monkeypatch):
    from raymp.checkpoint import integrity

    path = f"file://{tmp_path}/ck" if uri else str(tmp_path / "ck")
    writer = storage_writer(path)
    dcp.save(_state(), storage_writer=writer, no_dist=True)
    fs, data = integrity.fsspec_fs(str(tmp_path / "ck" / "__0_0.distcp"))
    assert writer.digests == {"__0_0.distcp": integrity.file_sha256(fs, data)}
    read_back = []
    real = integrity.file_sha256
    monkeypatch.setattr(integrity, "file_sha256", lambda fs, p: read_back.append(p) or real(fs, p))
    files = integrity.rank_files(path, 0, writer.digests)
    assert [p.rsplit("/", 1)[-1] for p in read_back] == [".metadata"]  # not the data file
    assert files == integrity.directory_files(path)  # .metadata and the rank's file, as the driver lists them


@pytest.mark.parametrize("uri", [False, True], ids=["path", "fsspec"])
def test_tensors_round_trip_as_raw_bytes(tmp_path, uri):
    path = f"file://{tmp_path}/ck" if uri else str(tmp_path / "ck")
    sd = _state()
    dcp.save(sd, storage_writer=storage_writer(path), no_dist=True)
    data = (tmp_path / "ck" / "__0_0.distcp").read_bytes()
    assert sd["model.w"].contiguous().numpy().tobytes() in data  # the elements, not a zip of them
    loaded = _empty_like(sd)
    dcp.load(loaded, storage_reader=storage_reader(path), no_dist=True)
    _same(loaded, sd)


def test_a_checkpoint_written_by_torch_save_still_loads(tmp_path):
    sd = _state()
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path), no_dist=True)
    loaded = _empty_like(sd)
    dcp.load(loaded, storage_reader=storage_reader(str(tmp_path)), no_dist=True)
    _same(loaded, sd)


def test_dcp_own_reader_refuses_raw_files(tmp_path):
    sd = {"w": torch.ones(4)}
    dcp.save(sd, storage_writer=storage_writer(str(tmp_path)), no_dist=True)
    with pytest.raises(BaseException, match="Unknown extension"):  # CheckpointException is a BaseException
        dcp.load({"w": torch.zeros(4)}, storage_reader=FileSystemReader(tmp_path), no_dist=True)


def test_a_short_file_is_an_error_not_a_tensor(tmp_path):
    dcp.save({"w": torch.ones(1000)}, storage_writer=storage_writer(str(tmp_path)), no_dist=True)
    data = tmp_path / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-8])
    target = {"w": torch.zeros(1000)}
    with pytest.raises(BaseException, match="ends early"):
        dcp.load(target, storage_reader=storage_reader(str(tmp_path)), no_dist=True)
