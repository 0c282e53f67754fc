"""docs/design.md trap: FSDP2 with set_reshard_after_backward(False) + an optimizer step leaves the
unsharded parameters stale unless every FSDP unit is resharded. The parity check must catch a
regression: run ZeRO-2 with the reshard removed and require that it diverges."""

from __future__ import annotations

import sys

from ray import cloudpickle
import pytest

from raymp.config import config_from_dict
from raymp.reference import train_single_process
from raymp.runtime.actor_group import ActorGroup
from raymp.runtime.worker import Worker
from raymp.trainer import Trainer

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # so actors can load this class


class WorkerWithoutReshard(Worker):
    def setup(self, *args, **kwargs):
        info = super().setup(*args, **kwargs)
        self.engine.after_optimizer_step = lambda: None  # the bug this test guards against
        return info


def test_zero2_without_reshard_is_caught_by_parity(ray_local, tiny_cfg):
    cfg = tiny_cfg(
        parallel={"dp": 2, "zero": 2, "micro_batch_size": 2},
        train={"steps": 3, "global_batch_size": 8, "seq_len": 32},
    )
    group = ActorGroup(2, "cpu", worker_cls=WorkerWithoutReshard, placement_timeout_s=60)
    try:
        with Trainer(cfg, actor_group=group, progress=False) as t:
            losses = [m["loss"] for m in t.fit()]
    finally:
        group.shutdown()
    ref, _ = train_single_process(config_from_dict(cfg))
    assert losses[0] == pytest.approx(ref[0], rel=1e-5)  # first step has fresh weights
    assert abs(losses[2] - ref[2]) > 1e-3 * abs(ref[2]), "stale ZeRO-2 weights went unnoticed"
