"""Checksums of a checkpoint's files: written into the commit marker, verified before a load.

DCP itself checks nothing: a shard with bytes flipped inside a tensor loads without error (the
loss went to 2e36 and the run carried on). So every rank hashes the files it wrote, in the
background thread that wrote them (the raw writer from the bytes it wrote, raw_storage.py; other
files read back), and the driver records them in the marker; before a load the
ranks verify a share of the files each, and a damaged checkpoint is passed over for an older one.

Rank r's files are DCP's `__r_*.distcp` (its storage plan's prefix); rank 0, DCP's coordinator in
raymp's checkpoint group, also wrote `.metadata`.
"""

from __future__ import annotations

import hashlib

from raymp.storage import fsspec_fs

INDEX = ".metadata"
_CHUNK = 8 << 20


def file_sha256(fs, path: str) -> str:
    h = hashlib.sha256()
    with fs.open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def rank_files(path: str, rank: int, hashed: dict[str, str] | None = None) -> dict[str, str]:
    """{file name: sha256} of what `rank` wrote into the checkpoint directory at `path`; a file in
    `hashed` (its writer hashed the bytes as it wrote them) is not read back."""
    prefix = f"__{rank}_"
    return _hashed(path, lambda n: n.startswith(prefix) or (rank == 0 and n == INDEX), hashed or {})


def directory_files(path: str) -> dict[str, str]:
    """{file name: sha256} of every file in a checkpoint directory but the commit marker."""
    return _hashed(path, lambda n: n == INDEX or n.endswith(".distcp"), {})


def _hashed(path: str, wanted, hashed: dict[str, str]) -> dict[str, str]:
    """{file name: sha256} of the files in the directory at `path` whose name is `wanted`, read
    back but for those `hashed` already holds."""
    fs, root = fsspec_fs(path)
    names = sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in fs.ls(root, detail=False))
    return {n: hashed[n] if n in hashed else file_sha256(fs, f"{root}/{n}") for n in names if wanted(n)}


def verify_files(path: str, expected: dict[str, str]) -> list[str]:
    """Problems found with `expected` ({name: sha256}) under `path`: one short phrase per file
    that is missing, unreadable or not what was written. Empty: all intact."""
    fs, root = fsspec_fs(path)
    problems = []
    for name, digest in sorted(expected.items()):
        try:
            actual = file_sha256(fs, f"{root}/{name}")
        except FileNotFoundError:
            problems.append(f"{name} is missing")
            continue
        except OSError as exc:
            problems.append(f"{name} cannot be read ({exc.strerror or exc})")
            continue
        if actual != digest:
            problems.append(f"{name} does not match its checksum (damaged after it was written)")
    return problems


def shares(files: dict[str, str], world_size: int) -> list[dict[str, str]]:
    """The files split over `world_size` ranks (round robin) for verifying in parallel."""
    out: list[dict[str, str]] = [{} for _ in range(world_size)]
    for i, name in enumerate(sorted(files)):
        out[i % world_size][name] = files[name]
    return out


NO_CHECKSUMS = "its marker lists no checksums of its files (it cannot be verified, so it is never loaded)"


def listed_files(marker: dict) -> dict[str, str] | None:
    """{file name: sha256} a commit marker lists; None when it lists none (nothing can be
    verified), or a list without DCP's index."""
    files = marker.get("files")
    return files if isinstance(files, dict) and INDEX in files else None


def verify(path: str, marker: dict) -> list[str]:
    """What is wrong with the files of the committed checkpoint at `path` whose marker is
    `marker`, read from the driver (empty: intact)."""
    files = listed_files(marker)
    return [NO_CHECKSUMS] if files is None else verify_files(path, files)
