"""The one home of the private torch APIs raymp relies on, each with why: when torch moves one,
this module is the only place to change."""

from __future__ import annotations

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["flatten_dense_tensors", "unflatten_dense_tensors", "recomputing"]

# DDP-style gradient buckets: one flat buffer per dtype, and views back into it (no public API).
flatten_dense_tensors = _flatten_dense_tensors
unflatten_dense_tensors = _unflatten_dense_tensors


def recomputing() -> bool:
    """Whether this forward runs inside a backward pass: activation checkpointing recomputing a
    block. Statistics gathered in forward (MoE routing counts) must not count it twice; torch has
    no public query for it, and its graph-task id is -1 outside a backward."""
    return torch._C._current_graph_task_id() != -1
