"""The pipeline tests' run config and their gradient check: every parameter's full gradient after
one forward/backward, gathered from all stages, against one process's."""

from __future__ import annotations

import torch

from raymp.data import replica_slice
from raymp.trainer import Trainer


def pp_cfg(tiny_cfg, pp, schedule, dp=1, zero=0, n_layers=None, **parallel):
    # 8 micro-batches per replica: enough for every schedule at pp=4 (V-shaped ones need 2p).
    return tiny_cfg(
        model={"preset": "tiny", "max_seq_len": 64, **({"n_layers": n_layers} if n_layers else {})},
        parallel={"dp": dp, "pp": pp, "zero": zero, "micro_batch_size": 1, "schedule": schedule, **parallel},
        train={"steps": 5, "global_batch_size": 8 * dp, "seq_len": 32, "log_every": 1},
    )


def pipeline_gradients(cfg, group):
    """Every parameter's full gradient after one forward/backward, gathered from all stages."""
    with Trainer(cfg, actor_group=group, progress=False) as t:
        t.setup()
        batch, lay = t.order.batch(0), t.config.parallel.layout
        args = [
            (
                (
                    t.data.gather(replica_slice(batch, lay.local_batch(len(batch)), lay.coords(r)["dp"]))
                    if lay.coords(r)["pp"] == 0
                    else None
                ),
            )
            for r in range(lay.world_size)
        ]
        grads = {}
        for part in group.call_per_rank("gradients", args):
            if part is not None:
                grads.update(part)
    return grads


def assert_gradients_match(grads, ref, atol=1e-6):
    assert set(grads) == set(ref), f"parameters differ: {set(grads) ^ set(ref)}"
    for name, expected in ref.items():
        assert grads[name] is not None, f"{name}: missing gradient"
        torch.testing.assert_close(grads[name], expected, rtol=1e-4, atol=atol, msg=lambda m: f"{name}: {m}")
