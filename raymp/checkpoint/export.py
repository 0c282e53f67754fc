"""Consolidate a sharded checkpoint into one plain file of full weights, named as in the plain
model (`tok_embeddings.weight`, `layers.0.attention.wq.weight`, ...), for use outside raymp.

Runs in one process without a process group or Ray: DCP reads each saved shard into its place in
the full tensors. Only the model's entries are read, never the optimizer's (twice the size). What
is exported was verified first: a damaged checkpoint is refused, and given a run's checkpoint
directory the newest intact one is taken, the damaged ones passed over named.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from raymp.checkpoint.rank_state import EMBEDDING, TIED_HEAD
from raymp.checkpoint.store import (
    MARKER,
    Checkpoint,
    CheckpointError,
    CheckpointStore,
    read_marker,
    storage_reader,
)
from raymp.checkpoint.integrity import verify
from raymp.layout import Layout
from raymp.models.hf import export_hf, load_hf_config
from raymp.storage import fsspec_fs


def intact_checkpoint(path: str) -> tuple[Checkpoint, list[str]]:
    """(the checkpoint to export, the damaged ones passed over): `path` itself when it is a
    committed checkpoint, which must verify; else the newest intact one in the directory."""
    fs, inner = fsspec_fs(path)
    if fs.exists(f"{inner}/{MARKER}"):
        checkpoint = read_marker(path)  # refuses a marker that was changed after the commit
        if problems := verify(checkpoint.path, checkpoint.meta):
            raise CheckpointError(
                f"checkpoint {path} is damaged ({problems[0]}); it is not exported. "
                f"`raymp checkpoint list {path.rstrip('/').rsplit('/', 1)[0]}` shows the intact ones"
            )
        return checkpoint, []
    store = CheckpointStore(path)
    passed_over = []
    for entry in reversed(store.scan()):
        if entry.problem:
            passed_over.append(f"step {entry.step} ({entry.problem})")
        elif entry.checkpoint is not None:
            if not (problems := store.problems(entry.checkpoint)):
                return entry.checkpoint, passed_over
            passed_over.append(f"step {entry.step} ({problems[0]})")
    found = f": every committed one is damaged: {'; '.join(passed_over)}" if passed_over else ""
    raise CheckpointError(
        f"{path} is neither a committed checkpoint nor a directory holding an intact one{found}"
    )


def consolidated_weights(checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
    """The full weights by name of a committed (and verified) checkpoint."""
    path = checkpoint.path
    reader = storage_reader(path)
    saved = reader.read_metadata().state_dict_metadata
    sd = {key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
          for key, meta in saved.items()
          if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
    if not sd:
        raise CheckpointError(f"checkpoint {path} holds no model weights")
    with warnings.catch_warnings():
        # torch warns that it assumes one process even when told so (no_dist=True): not the user's to act on.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(sd, storage_reader=reader, no_dist=True)
    weights = {key[len("model."):]: value for key, value in sd.items()}
    if checkpoint.meta["config"]["model"].get("tie_embeddings") and TIED_HEAD not in weights:
        # Saved once as the embedding; the plain model's state dict lists the head too.
        weights[TIED_HEAD] = weights[EMBEDDING].clone()
    return weights


def export(path: str, out: str) -> dict:
    """Write the weights of the checkpoint at `path` (or the newest intact one of a checkpoint
    directory) to `out`: .safetensors (default) or .pt/.pth (torch.save). Written to a
    temporary name and renamed, so `out` is never half a file. Returns a short description."""
    checkpoint, passed_over = intact_checkpoint(path)
    weights, meta = consolidated_weights(checkpoint), checkpoint.meta
    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp")
    if out_path.suffix in (".pt", ".pth"):
        torch.save(weights, tmp)
    else:
        from safetensors.torch import save_file

        layout = meta["layout"]
        save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp), metadata={
            "format": "pt", "raymp_step": str(meta["step"]),
            "raymp_layout": Layout.from_record(layout).text(),
        })
    os.replace(tmp, out_path)
    tied = bool(meta["config"]["model"].get("tie_embeddings"))
    params = sum(v.numel() for v in weights.values()) - (weights[TIED_HEAD].numel() if tied else 0)
    return {"path": str(out_path), "tensors": len(weights), "step": meta["step"], "parameters": params,
            "bytes": out_path.stat().st_size, "source": checkpoint.path, "passed_over": passed_over}


def export_hf_dir(path: str, out: str) -> dict:
    """Write a checkpoint of a Hugging Face model (model.hf / model.hf_config) as a Hugging Face
    directory: config.json + model.safetensors, which `from_pretrained` loads. Written beside
    `out` and renamed into place, so `out` is never half a model. `path` as for export()."""
    checkpoint, passed_over = intact_checkpoint(path)
    weights, meta = consolidated_weights(checkpoint), checkpoint.meta
    model = meta["config"]["model"]
    if model.get("hf") is None and model.get("hf_config") is None:
        raise CheckpointError(f"checkpoint {path} is of the built-in model, not a Hugging Face one; "
                              "export it as a .safetensors file instead (drop --hf)")
    hf_config = load_hf_config(model.get("hf"), model.get("hf_config"))
    out_path = Path(out)
    tmp = out_path.with_name(out_path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    export_hf(weights, hf_config, tmp)
    if out_path.exists():
        shutil.rmtree(out_path)
    os.replace(tmp, out_path)
    return {"path": str(out_path), "tensors": len(weights), "step": meta["step"],
            "model_type": hf_config.model_type, "source": checkpoint.path, "passed_over": passed_over}
