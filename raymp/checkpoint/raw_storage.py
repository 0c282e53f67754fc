"""DCP storage that writes each tensor's memory as it is, not through torch.save.

Why not DCP's FileSystemWriter: it serializes every tensor with torch.save, whose zip writer
holds the rank's GIL while it copies and checksums the bytes. In a background save that is time
the training thread cannot run (BENCHMARKS.md section 15 prices both writers). Here a tensor's
bytes go to the file with one write call, which lets go of the GIL, and everything else stays
DCP's: its planner (so a checkpoint saved under one layout loads into any other), its index
(`.metadata`), its file names (`__<rank>_0.distcp`, what integrity.py hashes), and its fsspec
backends. The writer hashes the bytes as it writes them (`digests`), so the rank need not read
its file back to checksum it (integrity.rank_files).

How a tensor's entry is read back: its index entry (DCP's `_StorageInfo`) carries the transform
descriptor RAW, and the checkpoint's metadata already holds each chunk's dtype and sizes. A
stock DCP reader refuses the descriptor ("Unknown extension") rather than misreading the bytes;
RawReading reads entries without it (written by torch.save) as DCP does, so checkpoints written
before this format still load. Bytes are in the machine's order (little-endian everywhere torch
runs).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from raymp.torch_compat import dcp_storage_info, fsspec_storage_classes

FsspecWriter, FsspecReader = fsspec_storage_classes()
RAW = "raymp-raw/1"  # the transform descriptor of a tensor written as its raw bytes


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A CPU tensor's elements as contiguous bytes (a copy only where it is not contiguous)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def _sync(stream) -> None:
    try:
        os.fsync(stream.fileno())
    except (AttributeError, io.UnsupportedOperation):
        os.sync()


class RawWriting:
    """write_data for a DCP FileSystemWriter (or FsspecWriter): one file per rank, every item
    written with one call: BYTE_IO items (JSON, RNG state) as DCP writes them, tensors raw.
    `digests` ({file name: sha256}) holds the file it wrote, hashed from the bytes it wrote
    (hashlib lets go of the GIL, as the write does)."""

    digests: dict[str, str]

    def write_data(self, plan, planner) -> Future:
        name = f"{plan.storage_data.prefix}0.distcp"
        results = []
        sha = hashlib.sha256()
        with self.fs.create_stream(self.fs.concat_path(self.path, name), "wb") as stream:
            for item in plan.items:
                data = planner.resolve_data(item)
                offset = stream.tell()
                if item.type == WriteItemType.BYTE_IO:
                    buffer = data.getbuffer()
                    descriptors = None
                else:
                    if data.device.type != "cpu":
                        raise RuntimeError(f"{item.index.fqn} is on {data.device}: "
                                           "stage it to host memory first")
                    buffer = tensor_bytes(data)
                    descriptors = [RAW]
                stream.write(buffer)
                sha.update(buffer)
                length = stream.tell() - offset
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=dcp_storage_info(name, offset, length, descriptors)))
            if self.sync_files:
                stream.flush()
                _sync(stream)
        self.digests = {name: sha.hexdigest()}
        done: Future = Future()
        done.set_result(results)
        return done


class RawReading:
    """read_data for a DCP FileSystemReader (or FsspecReader) that also reads RawWriting's
    tensors: each from its chunk's dtype and sizes in the checkpoint's metadata."""

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self.chunks = {
            MetadataIndex(fqn, chunk.offsets): (entry.properties.dtype, chunk.sizes)
            for fqn, entry in metadata.state_dict_metadata.items()
            if isinstance(entry, TensorStorageMetadata)
            for chunk in entry.chunks
        }

    def read_data(self, plan, planner) -> Future:
        per_file: dict[str, list] = {}  # the raw tensors, by file
        others = []  # what DCP reads itself: BYTE_IO items, tensors written by torch.save
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            if item.type != LoadItemType.BYTE_IO and RAW in (info.transform_descriptors or ()):
                per_file.setdefault(info.relative_path, []).append(item)
            else:
                others.append(item)
        if others:
            super().read_data(dataclasses.replace(plan, items=others), planner).wait()
        for name, items in per_file.items():
            with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as stream:
                for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].offset):
                    self._read_tensor(stream, item, planner)
        done: Future = Future()
        done.set_result(None)
        return done

    def _read_tensor(self, stream, item, planner) -> None:
        info = self.storage_data[item.storage_index]
        dtype, sizes = self.chunks[item.storage_index]
        expected = sizes.numel() * dtype.itemsize
        if info.length != expected:
            raise ValueError(f"{item.storage_index.fqn}: {info.length} bytes stored where its "
                             f"{tuple(sizes)} {dtype} chunk holds {expected}")
        if expected:
            buffer = bytearray(expected)
            stream.seek(info.offset)
            if stream.readinto(buffer) != expected:
                raise ValueError(f"{item.storage_index.fqn}: its file {info.relative_path} ends early")
            tensor = torch.frombuffer(buffer, dtype=dtype).view(sizes)
        else:  # torch.frombuffer refuses an empty buffer
            tensor = torch.empty(sizes, dtype=dtype)
        for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
            tensor = tensor.narrow(dim, start, length)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise ValueError(f"{item.storage_index.fqn}: read {tuple(tensor.size())} "
                             f"for {tuple(target.size())}")
        target.copy_(tensor)
        planner.commit_tensor(item, target)


class RawFileWriter(RawWriting, FileSystemWriter):
    """DCP's file writer, tensors raw."""


class RawFsspecWriter(RawWriting, FsspecWriter):
    """DCP's fsspec writer (a URI), tensors raw."""


class RawFileReader(RawReading, FileSystemReader):
    """DCP's file reader, for raw tensors too."""


class RawFsspecReader(RawReading, FsspecReader):
    """DCP's fsspec reader (a URI), for raw tensors too."""
