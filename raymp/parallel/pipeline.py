"""Pipeline parallelism: cut the model into stages, place them on the pp ranks, and run one of
torch.distributed.pipelining's schedules over them (the stage and schedule classes are in
pipeline_stage.py, which only a pipeline-parallel rank imports).

torch owns the schedules (GPipe, 1F1B, interleaved 1F1B, ZBV zero-bubble, DualPipeV), the
stage-to-stage activation/gradient transfer and the split backward. raymp adds what it lacks:
balancing layers by cost, stages built without ever materialising the whole model, tied
embeddings across the first and last stage, and a per-action clock for bubble measurement.
"""

from __future__ import annotations

import contextlib
import time

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from raymp.layout import V_SHAPED  # rank r holds stages r and 2p-1-r: first and last on rank 0
from raymp.torch_compat import dtensor_local, view_base

# Schedules that split backward into input-grad (I) and weight-grad (W) passes. FSDP2 must keep
# parameters gathered between forward and W under these, or gradients come out wrong (docs/design.md).
ZERO_BUBBLE = frozenset({"zbv", "dualpipev"})


# -- where stages go ---------------------------------------------------------------------------


def stage_to_pp_rank(stage: int, pp: int, schedule: str) -> int:
    if schedule in V_SHAPED:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp  # looped: rank r holds r, r+p, r+2p, ...


def local_stages(pp_rank: int, pp: int, num_stages: int, schedule: str) -> list[int]:
    return [s for s in range(num_stages) if stage_to_pp_rank(s, pp, schedule) == pp_rank]


def stage_costs(args) -> tuple[list[int], int, int]:
    """(parameters per block, embedding parameters, norm + head parameters). A tied head still
    costs the last stage its weight: it holds a copy and does the vocab-sized matmul."""
    embed = args.vocab_size * args.dim
    return [round(sum(args.layer_params(i))) for i in range(args.n_layers)], embed, embed + args.dim


def balance_stages(args, num_stages: int) -> list[list[int]]:
    """Consecutive layer runs, one per stage, minimising the most expensive stage; the first
    stage also carries the embedding and the last the norm and head. Exact (dynamic programming
    over split points), which is cheap at ~100 layers."""
    costs, first_extra, last_extra = stage_costs(args)
    n, k = len(costs), num_stages
    if k > n:
        raise ValueError(f"{k} stages need at least {k} layers; the model has {n}")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(stage: int, lo: int, hi: int) -> int:
        extra = (first_extra if stage == 0 else 0) + (last_extra if stage == k - 1 else 0)
        return prefix[hi] - prefix[lo] + extra

    inf = float("inf")
    # best[s][i]: lowest max-cost placing layers [0, i) on stages [0, s); cut[s][i]: where stage s-1 starts.
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0
    for s in range(1, k + 1):
        for i in range(s, n - (k - s) + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], cost(s - 1, j, i))
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    bounds, i = [], n
    for s in range(k, 0, -1):
        j = cut[s][i]
        bounds.append(list(range(j, i)))
        i = j
    return bounds[::-1]


def theoretical_bubble(schedule: str, pp: int, micro_batches: int, stages_per_rank: int) -> float | None:
    """Idle fraction of an ideal pipeline (equal stage costs, free communication). The
    zero-bubble schedules have no closed form that holds for every m; None there."""
    if schedule in ("gpipe", "1f1b"):
        return (pp - 1) / (micro_batches + pp - 1)
    if schedule == "interleaved":
        return (pp - 1) / (stages_per_rank * micro_batches + pp - 1)
    return None


# -- measurement -------------------------------------------------------------------------------


class StepClock:
    """Start/end of every forward (F), backward (B), input-grad (I) and weight-grad (W) action
    of one step, in seconds since the pp group's barrier at step start."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.events: list[tuple[int, str, int, float, float]] = []

    def restart(self) -> None:
        self.t0 = time.perf_counter()
        self.events = []

    @contextlib.contextmanager
    def span(self, stage: int, kind: str, micro_batch: int):
        start = time.perf_counter() - self.t0
        try:
            yield
        finally:
            self.events.append((stage, kind, micro_batch, start, time.perf_counter() - self.t0))


_WEIGHT_VIEW = "_raymp_weight_view"


def mark_weight_views(tensors) -> None:
    """Say that `tensors` are views of parameters' storage that a module hands to an op as plain
    tensors (expert parallelism's local expert weights, DTensor.to_local()): what autograd saves
    of them is the parameters' memory, not an activation, and the ActivationMeter skips it."""
    for t in tensors:
        setattr(view_base(t), _WEIGHT_VIEW, True)


class ActivationMeter:
    """Bytes of tensors autograd keeps for backward (activations), live and peak.

    Counted through saved-tensor hooks, by storage, so a tensor saved twice counts once and
    memory returns to the meter when autograd frees the graph. Parameters (and views of their
    storage: mark_weight_views) are not activations and are skipped. Works on any device
    (torch's CPU allocator keeps no statistics)."""

    def __init__(self):
        self.live = 0
        self.peak = 0
        self._refs: dict[int, list[int]] = {}
        # Called at every activation saved (forward) or used (backward): the points where a
        # step can be stopped mid-way (raymp.runtime.peer_loss.StepAbandon sets it).
        self.on_activation = _nothing
        # Counting costs a Python object per saved tensor (5% of a `tiny` step on one core), so
        # it runs only on the steps that report memory (the worker's measures_memory).
        self.measuring = True

    def reset_peak(self) -> None:
        self.peak = self.live

    def hooks(self):
        """Saved-tensor hooks for one forward: counting ones while measuring, else ones that only
        call on_activation (or none, when nothing is to be called)."""
        return self._counting() if self.measuring else self._stop_points()

    def _counting(self):
        meter = self

        class _Saved:
            __slots__ = ("tensor", "key")

            def __init__(self, tensor, key):
                self.tensor, self.key = tensor, key

            def __del__(self):
                if self.key is not None:
                    meter._release(self.key)

        def pack(t: torch.Tensor):
            meter.on_activation()
            base = view_base(t)
            parameter = isinstance(base, nn.Parameter) or getattr(base, _WEIGHT_VIEW, False)
            if parameter or t.device.type == "meta":
                return _Saved(t, None)
            local = dtensor_local(t) if isinstance(t, DTensor) else t  # TP: this rank's piece
            try:
                storage = local.untyped_storage()
                key = storage.data_ptr()
            except (RuntimeError, NotImplementedError):  # storage-less tensors: not counted
                return _Saved(t, None)
            entry = meter._refs.setdefault(key, [0, storage.nbytes()])
            if entry[0] == 0:
                meter.live += entry[1]
                meter.peak = max(meter.peak, meter.live)
            entry[0] += 1
            return _Saved(t, key)

        def unpack(saved: _Saved) -> torch.Tensor:
            meter.on_activation()
            return saved.tensor

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def _stop_points(self):
        check = self.on_activation
        if check is _nothing:
            return contextlib.nullcontext()

        def pass_through(t):
            check()
            return t

        return torch.autograd.graph.saved_tensors_hooks(pass_through, pass_through)

    def _release(self, key: int) -> None:
        entry = self._refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._refs[key]


def autocast_context(device, dtype):
    """Forward under autocast to `dtype`, or as is when dtype is None."""
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def bubble_stats(events_by_pp_rank: list[list[tuple]]) -> dict:
    """Busy and idle seconds per pp rank of one replica and the bubble fraction: idle time over
    pp x makespan, the makespan ending with the last action of any rank."""
    makespan = max((e[4] for events in events_by_pp_rank for e in events), default=0.0)
    busy = [sum(e[4] - e[3] for e in events) for events in events_by_pp_rank]
    idle = [makespan - b for b in busy]
    fraction = sum(idle) / (len(busy) * makespan) if makespan > 0 else 0.0
    return {"makespan_s": makespan, "busy_s": busy, "idle_s": idle, "bubble_fraction": fraction}


def _nothing() -> None:
    pass
