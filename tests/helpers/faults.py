"""Shared by the fault-matrix tests: the matrix's run config, its one-process reference, the check
every scenario ends with, the ways a checkpoint gets damaged, and waiting on an event with a bound."""

from __future__ import annotations

import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from helpers.tiny_model import at_fewest_layers

STEPS = 8
# The matrix's mixture-of-experts model: a balance loss and a bias update, so the router biases
# are model state that every step changes and a recovery has to carry over exactly.
MOE_MODEL = {"preset": "tiny-moe", "max_seq_len": 64, "moe": {"aux_loss_coef": 0.1, "bias_update_rate": 0.01}}


def matrix_cfg(root: Path, cache: str, ckpt: Path | str | None = None, **sections) -> dict:
    """The tiny model (at the fewest layers its layout takes), dp=2 ZeRO-2, a checkpoint every 2
    steps (asynchronous), 8 steps; a loss restarts from the checkpoint (elastic.keep_survivors=false)."""
    cfg = {
        "name": "faults", "seed": 3, "output_dir": str(Path(root) / "runs"),
        "model": {"preset": "tiny", "max_seq_len": 64},
        "parallel": {"dp": 2, "zero": 2, "micro_batch_size": 2},
        "train": {"steps": STEPS, "global_batch_size": 8, "seq_len": 32, "log_every": 1, "eval_batches": 0},
        "optimizer": {"lr": 1e-2, "warmup_steps": 1, "grad_clip": 1.0},
        "data": {"source": "kjv", "tokenizer": "byte", "cache_dir": cache},
        "checkpoint": {"every": 2, "keep_last": 4, "dir": str(ckpt or Path(root) / "checkpoints")},
        # A restart from the checkpoint, the matrix's subject; the survivors' tests ask for theirs.
        "elastic": {"wait_for_resources_s": 0, "poll_s": 0.1, "keep_survivors": False},
        "tracking": {"enabled": False},
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return at_fewest_layers(cfg)


@dataclass
class Reference:
    """One-process training of the matrix config: the loss of every step and the sample ids the
    global order gives it."""

    losses: list[float]
    sample_ids: list[list[int]]

    @classmethod
    def of(cls, cfg: dict, steps: int = STEPS, skip_updates: frozenset[int] = frozenset()) -> "Reference":
        from raymp.config import config_from_dict
        from raymp.data import TrainOrder, load_dataset
        from raymp.reference import train_single_process

        run = config_from_dict(cfg)
        losses, _ = train_single_process(run, steps, skip_updates=skip_updates)
        data = load_dataset(run.data, run.train.seq_len, log=lambda *_: None)
        order = TrainOrder(data.num_samples, run.data.val_fraction, run.seed, run.train.global_batch_size)
        return cls(losses, [order.batch(s).tolist() for s in range(steps)])


def check_against_reference(history: list[dict], ref: Reference, steps) -> None:
    """Every step once, in order; each step's loss within 1e-5 of one process, and its samples
    exactly the global order's."""
    import pytest

    assert [m["step"] for m in history] == list(steps)
    for m in history:
        s = m["step"]
        ids = m["sample_ids"].tolist() if hasattr(m["sample_ids"], "tolist") else list(m["sample_ids"])
        assert ids == ref.sample_ids[s], f"step {s} read other samples"
        assert m["loss"] == pytest.approx(ref.losses[s], rel=1e-5), f"step {s}"


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_bytes_in_a_tensor(path: Path) -> None:
    """Overwrite 64 bytes in the middle of the largest shard file: tensor data, not a header."""
    data = bytearray(path.read_bytes())
    mid = len(data) * 3 // 5
    data[mid:mid + 64] = bytes((b ^ 0x5A) for b in data[mid:mid + 64])
    path.write_bytes(bytes(data))


def _edit_marker_bytes(ckpt: Path, pattern: str, change) -> None:
    """Change the marker's bytes where `pattern` first matches (no re-serialisation: what a
    flipped byte on storage does)."""
    text = (ckpt / "raymp.json").read_text()
    found = re.search(pattern, text)
    assert found, f"{pattern} not in the marker"
    (ckpt / "raymp.json").write_text(text[:found.start()] + change(found.group(0)) + text[found.end():])


def _flip_last_digit(text: str) -> str:
    return text[:-1] + str((int(text[-1]) + 1) % 10)


def _largest_shard(ckpt: Path) -> Path:
    return max(ckpt.glob("*.distcp"), key=lambda p: p.stat().st_size)


DAMAGE = {
    "truncated shard": lambda ckpt: _truncate(_largest_shard(ckpt)),
    "bytes flipped inside a tensor": lambda ckpt: _flip_bytes_in_a_tensor(_largest_shard(ckpt)),
    "missing metadata": lambda ckpt: (ckpt / ".metadata").unlink(),
    "deleted shard": lambda ckpt: _largest_shard(ckpt).unlink(),
    "half-written marker": lambda ckpt: _truncate(ckpt / "raymp.json"),
    # One byte of the marker: its file list's name (verification would be off without the
    # marker's own checksum), a digit of its data position (it would resume on other samples).
    "marker file list renamed": lambda ckpt: _edit_marker_bytes(ckpt, '"files"', lambda t: '"filez"'),
    "marker data position changed": lambda ckpt: _edit_marker_bytes(ckpt, r'"offset": \d+', _flip_last_digit),
}


def copy_checkpoints(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


ROOM_TIMEOUT_S = 120  # kill_rank_after(until_room=True): how long the let-go bundles may take to free
COPY_TIMEOUT_S = 120  # kill_rank_after(copied=True): how long the ranks may take to hand a peer copy over


class Hung(RuntimeError):
    """A wait ran past its bound; the message names what was awaited and the bound."""


def wait_until(predicate, what: str, bound: float) -> None:
    """Wait for an event (`predicate()` true), never for a time: `bound` only ends a hung wait."""
    deadline = time.monotonic() + bound
    while not predicate():
        if time.monotonic() > deadline:
            raise Hung(f"waited {bound:g}s for {what}")
        time.sleep(0.02)


def kill_rank_after(trainer, steps: int, rank: int | list[int] = 1, committed: bool = False,
                    until_room: bool = False, copied: bool = False) -> None:
    """Kill one rank's actor (or several at once) once `steps` steps are done, and with
    `committed` once a checkpoint is committed too: on the training thread, between two steps
    (Trainer.on_event), so the kill lands at that point of the run however busy the machine is (a
    thread polling the history once let it land steps later, or after the last one). With
    `until_room`, the first step after the survivors went on does not end until Ray has freed
    the bundles of the ranks they let go, so a join back is due before the next step, however
    quick the rest of the run is (ROOM_TIMEOUT_S bounds the wait). With `copied`, not before every
    rank has handed the newest peer copy over (they do so while the next step runs)."""
    import ray

    ranks, done = [rank] if isinstance(rank, int) else rank, []

    def on_event(name, info):
        if until_room and done == [True] and trainer.restarts and name == "step":
            joined = lambda: any(r.get("recovery") == "live join" for r in trainer.restarts)  # noqa: E731
            wait_until(lambda: joined() or trainer.elastic.ranks.joinable_replicas(),
                       f"the let-go bundles freed (ROOM_TIMEOUT_S; restarts: "
                       f"{[r.get('recovery') for r in trainer.restarts]})", ROOM_TIMEOUT_S)
            done.append(True)
        if name != "step" or done or len(trainer.history) < steps:
            return
        if committed and trainer.checkpoints.store.latest() is None:
            return
        if copied:
            newest = trainer.session.peer_copies.kept[-1]
            assert newest.handed_over(COPY_TIMEOUT_S), f"the peer copy of step {newest.step} (COPY_TIMEOUT_S)"
        done.append(True)
        for worker in [trainer.group.workers[r] for r in ranks]:
            ray.kill(worker)

    trainer.on_event = on_event
