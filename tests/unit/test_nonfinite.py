"""A checkpoint of non-finite state is never committed: the save guard finds a NaN or an inf
anywhere, and a rank's background save of such state fails, so the driver never commits it."""

from __future__ import annotations

import pytest

from helpers.ports import free_port


@pytest.mark.timeout(120)
def test_a_checkpoint_of_nonfinite_state_is_never_committed(tmp_path):
    """The ranks check what they wrote in the background: a NaN in the state makes the save
    fail, so the driver never commits it (CheckpointCoordinator.collect)."""
    import os

    import torch
    import torch.distributed as dist

    from raymp.checkpoint.rank_state import RankCheckpointer, host_copy

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        checkpointer = RankCheckpointer(0, 1, dist.new_group(backend="gloo"))
        state = {"model.w": torch.ones(8), "optim.w.exp_avg": torch.tensor([1.0, float("inf")])}
        checkpointer.write(host_copy(state), str(tmp_path / "a"), 1, async_save=True)
        report = checkpointer.wait()
        assert report["step"] == 1 and "non-finite values (optim.w.exp_avg)" in report["error"], report
    finally:
        dist.destroy_process_group()


def test_the_save_guard_finds_a_nan_or_an_inf_anywhere():
    """nonfinite_entries reads each tensor's min and max: a NaN or an inf at any place, in any
    floating dtype, shows in them; finite and empty tensors pass."""
    import torch

    from raymp.checkpoint.rank_state import nonfinite_entries

    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for n in (1, 63, 100_003):
            for where in {0, n // 3, n - 1}:
                for value in (float("nan"), float("inf"), float("-inf")):
                    t = torch.randn(n).to(dtype)
                    t[where] = value
                    sd = {"fine": torch.randn(n).to(dtype), "bad": t, "empty": torch.empty(0, dtype=dtype),
                          "step": torch.tensor(3)}
                    assert nonfinite_entries(sd) == ["bad"], (dtype, n, where, value)
    strided = torch.randn(10, 7)[:, ::2]
    strided[3, 1] = float("nan")
    assert nonfinite_entries({"s": strided}) == ["s"]
