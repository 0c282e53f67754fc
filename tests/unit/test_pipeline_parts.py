"""The pipeline's parts that need no actors: stage placement, balancing, bubble arithmetic, the
activation meter (and the step abandon it checks) and the timeline files."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from torch import nn

from raymp.config import config_from_dict
from raymp.models import model_args
from raymp.parallel.pipeline import (
    ActivationMeter,
    balance_stages,
    bubble_stats,
    local_stages,
    mark_weight_views,
    stage_costs,
    stage_to_pp_rank,
    theoretical_bubble,
)
from raymp.timeline import chrome_trace, write_timeline


def args_for(preset, vocab=256, **model):
    return model_args(config_from_dict({"model": {"preset": preset, **model}}).model, vocab)


def test_looped_and_v_shaped_placement():
    assert [stage_to_pp_rank(s, 4, "interleaved") for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [stage_to_pp_rank(s, 4, "zbv") for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert local_stages(0, 4, 8, "dualpipev") == [0, 7]  # first and last stage share rank 0
    assert local_stages(1, 4, 8, "interleaved") == [1, 5]
    assert local_stages(2, 4, 4, "1f1b") == [2]


def _max_cost(split, args):
    costs, first, last = stage_costs(args)
    per = [sum(costs[i] for i in layers) for layers in split]
    per[0] += first
    per[-1] += last
    return max(per)


@pytest.mark.parametrize("preset,stages", [("tiny", 2), ("small", 4), ("llama-8b", 4), ("llama-70b", 8)])
def test_balanced_split_is_consecutive_complete_and_optimal(preset, stages):
    args = args_for(preset, vocab=128256 if preset.startswith("llama") else 256)
    split = balance_stages(args, stages)
    assert [i for layers in split for i in layers] == list(range(args.n_layers))
    assert all(split)
    # Optimal: no other set of cut points has a cheaper most-expensive stage (brute force where feasible).
    if args.n_layers <= 32:
        best = min(
            _max_cost([list(range(a, b)) for a, b in zip((0, *cuts), (*cuts, args.n_layers))], args)
            for cuts in itertools.combinations(range(1, args.n_layers), stages - 1)
        )
        assert _max_cost(split, args) == best


def test_embedding_and_head_weigh_on_the_end_stages():
    split = balance_stages(args_for("llama-8b", vocab=128256), 4)
    sizes = [len(layers) for layers in split]
    assert sizes[0] < sizes[1] and sizes[-1] < sizes[1], sizes  # 525M-param embedding and head
    assert sum(sizes) == 32


def test_theoretical_bubble():
    assert theoretical_bubble("gpipe", 4, 4, 1) == pytest.approx(3 / 7)
    assert theoretical_bubble("1f1b", 4, 32, 1) == pytest.approx(3 / 35)
    assert theoretical_bubble("interleaved", 4, 8, 2) == pytest.approx(3 / 19)
    assert theoretical_bubble("zbv", 4, 8, 2) is None


def test_bubble_stats_counts_idle_against_the_makespan():
    # rank 0 busy 0-1 and 2-4 (3 s); rank 1 busy 1-3 (2 s); makespan 4 s.
    events = [[(0, "F", 0, 0.0, 1.0), (0, "B", 0, 2.0, 4.0)], [(1, "F", 0, 1.0, 2.0), (1, "B", 0, 2.0, 3.0)]]
    stats = bubble_stats(events)
    assert stats["makespan_s"] == 4.0 and stats["busy_s"] == [3.0, 2.0] and stats["idle_s"] == [1.0, 2.0]
    assert stats["bubble_fraction"] == pytest.approx(3 / 8)


def test_activation_meter_counts_saved_activations_not_weights():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 512))
    meter = ActivationMeter()
    x = torch.randn(4, 512)
    with meter.hooks():
        y1 = model(x).sum()
        y2 = model(x * 2).sum()
    # Per graph autograd keeps the input (for the first linear) and tanh's output (saved by tanh
    # and by the second linear: one storage), 4x512 fp32 = 8 KiB each; never the 1 MiB weights.
    assert meter.live == 2 * 2 * 8192
    assert meter.peak == meter.live
    y1.backward()
    assert meter.live < meter.peak  # the first graph's activations are released by its backward
    y2.backward()
    assert meter.live == 0
    meter.reset_peak()
    assert meter.peak == 0


def test_activation_meter_skips_plain_views_of_parameter_storage_it_is_told_of():
    """Expert parallelism hands its grouped GEMM the local pieces of DTensor parameters as plain
    tensors (to_local()): what autograd saves of them is parameter memory. Unmarked, the same
    views count as activations."""
    weight = torch.randn(512, 512)  # stands for a DTensor parameter's local tensor
    x = torch.randn(4, 512, requires_grad=True)
    for marked in (False, True):
        view = weight.view(512, 512)
        if marked:
            mark_weight_views([view])
        meter = ActivationMeter()
        with meter.hooks():
            out = (x @ view.t()).sum()
        assert meter.live == (0 if marked else 512 * 512 * 4)  # what x's gradient needs: the weight
        out.backward()


def test_a_step_abandoned_ends_at_the_next_activation_in_forward_or_backward():
    """StepAbandon's check runs at every activation autograd saves (forward) or uses (backward),
    so a step stops within an op; a request about a process group already left is void."""
    from raymp.runtime.peer_loss import StepAbandon, StepAbandoned, is_peer_loss

    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    meter, abandon = ActivationMeter(), StepAbandon()
    meter.on_activation = abandon.check
    abandon.arm(("10.0.0.1", 29500))
    assert not abandon.request(("10.0.0.1", 29400))  # an earlier group's: void
    with meter.hooks():
        loss = model(torch.randn(4, 64)).sum()  # runs: nothing asked
    assert abandon.request(("10.0.0.1", 29500))
    with pytest.raises(StepAbandoned) as err:
        loss.backward()  # stopped in backward, at the first saved activation it uses
    assert is_peer_loss(err.value)  # so the rank leaves its groups, keeping its state
    wrapped = RuntimeError("Stage 0 failed to run forward")  # as a pipeline stage wraps it
    wrapped.__cause__ = err.value
    assert is_peer_loss(wrapped) and not is_peer_loss(RuntimeError("shape mismatch"))
    with pytest.raises(StepAbandoned), meter.hooks():
        model(torch.randn(4, 64))  # and in forward
    abandon.arm(("10.0.0.1", 29600))  # the survivors' new group: the old request is gone
    with meter.hooks():
        model(torch.randn(4, 64)).sum().backward()


def test_timeline_files(tmp_path):
    events = [[(0, "F", 0, 0.0, 0.01), (0, "B", 0, 0.02, 0.04)],
              [(1, "F", 0, 0.01, 0.02), (1, "I", 0, 0.02, 0.03), (1, "W", 0, 0.03, 0.035)]]
    paths = write_timeline(events, tmp_path, "test")
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and paths["png"].stat().st_size > 5000
    trace = json.loads(paths["trace"].read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 5 and {e["tid"] for e in spans} == {0, 1}
    assert spans[1]["ts"] == pytest.approx(20000) and spans[1]["dur"] == pytest.approx(20000)
    assert chrome_trace(events, "t")["displayTimeUnit"] == "ms"
