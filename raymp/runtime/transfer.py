"""A rank's kept state (host_state) handed to a rank that joins in its place of another replica,
straight over the new world's process group: the receiver learns each tensor's shape and dtype
from a small description, allocates, and receives one flat buffer per dtype. Through Ray's
object store the same 68 MiB state (`small`, DDP) took 0.47-1.0 s of a spare's join between two
simulated nodes on this machine (the source's put, the fetch, a copy out of the store; as numpy
arrays or as tensors), the send 0.33-0.34 s (docs/design.md).
A peer lost during it fails the send or receive within the world's collective timeout."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorSlot:
    shape: tuple[int, ...]
    dtype: torch.dtype


def describe(state: dict) -> dict:
    """What a receiver needs to take `state`: each tensor's shape and dtype; other values as they are."""
    return {k: TensorSlot(tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v
            for k, v in state.items()}


def send_state(state: dict, dst: int) -> None:
    """`state`'s tensors to rank `dst` of the default process group (receive_state there)."""
    for keys in _by_dtype(describe(state)).values():
        dist.send(torch.cat([state[k].detach().reshape(-1) for k in keys]), dst)


def receive_state(description: dict, src: int) -> dict:
    """The state rank `src` sends (send_state), from its describe(): the tensors are views of
    the received buffers."""
    state = {k: v for k, v in description.items() if not isinstance(v, TensorSlot)}
    for dtype, keys in _by_dtype(description).items():
        slots = [description[k] for k in keys]
        sizes = [math.prod(s.shape) for s in slots]
        flat = torch.empty(sum(sizes), dtype=dtype)
        dist.recv(flat, src)
        for key, slot, part in zip(keys, slots, flat.split(sizes)):
            state[key] = part.view(slot.shape)
    return {k: state[k] for k in description}


def _by_dtype(description: dict) -> dict[torch.dtype, list[str]]:
    """The tensors' keys grouped by dtype, in the description's order (the same on both sides)."""
    groups: dict[torch.dtype, list[str]] = {}
    for key, slot in description.items():
        if isinstance(slot, TensorSlot):
            groups.setdefault(slot.dtype, []).append(key)
    return groups
