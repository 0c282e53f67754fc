"""Streaming into training: every sample exactly once per epoch, exact resume across a change of
dp, validation loss equal to single-process, data wait reported."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raymp import Trainer
from raymp.config import ConfigError, config_from_dict
from raymp.data import DataPosition, TrainOrder
from raymp.data.ray_context import local_node_if_local_path, on_node
from raymp.reference import single_process_val_loss

SEQ = 16


@pytest.fixture(scope="module")
def group1(ray_local):
    from raymp.runtime.actor_group import ActorGroup

    group = ActorGroup(1, "cpu", cpus_per_actor=1, placement_timeout_s=60, collective_timeout_s=120)
    yield group
    group.shutdown()


@pytest.fixture
def small_corpus_cfg(tiny_cfg, tmp_path):
    """A corpus of ~45 samples, so a few steps cover several epochs."""
    text = " ".join(f"verse {i}: and it came to pass." for i in range(28))
    (tmp_path / "small.txt").write_text(text)

    def make(dp, steps, **parallel):
        return tiny_cfg(
            parallel={"dp": dp, "zero": 0, "micro_batch_size": 2, **parallel},
            train={"steps": steps, "global_batch_size": 8, "seq_len": SEQ, "eval_batches": 0},
            data={"source": str(tmp_path / "small.txt"), "val_fraction": 0.1},
        )

    return make


def consumed(history) -> list[list[int]]:
    return [m["sample_ids"].tolist() for m in history]


def test_every_sample_once_per_epoch_over_three_epochs(small_corpus_cfg, group2):
    cfg = small_corpus_cfg(dp=2, steps=18)
    with Trainer(cfg, actor_group=group2, progress=False) as t:
        history = t.fit()
        train_ids = t.order.train_ids
        position = t.data_position()
    n = len(train_ids)
    assert 30 < n < 60
    stream = np.concatenate([m["sample_ids"] for m in history])
    assert len(stream) == 18 * 8 >= 3 * n
    for epoch in range(3):
        assert sorted(stream[epoch * n:(epoch + 1) * n].tolist()) == sorted(train_ids.tolist())
    # Each step's rows came from the two replicas' streams: replica 0 the first half.
    assert np.array_equal(stream[:8], TrainOrder(t.data.num_samples, 0.1, cfg["seed"], 8).batch(0))
    assert (position.step, position.consumed) == (18, 144)
    assert (position.epoch, position.offset) == divmod(144, n)
    assert all(m["data_wait_s"] >= 0 and 0 <= m["data_wait_fraction"] < 1 for m in history)


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2)])
def test_resume_with_another_dp_reads_the_same_samples(small_corpus_cfg, group1, group2, before, after):
    groups = {1: group1, 2: group2}
    steps, stop = 12, 5
    with Trainer(small_corpus_cfg(dp=2, steps=steps), actor_group=group2, progress=False) as t:
        uninterrupted = consumed(t.fit())
    with Trainer(small_corpus_cfg(dp=before, steps=steps), actor_group=groups[before], progress=False) as t:
        first = consumed(t.fit(stop))
        saved = t.data_position().to_dict()  # what a checkpoint keeps
    with Trainer(small_corpus_cfg(dp=after, steps=steps), actor_group=groups[after], progress=False,
                 data_position=saved) as t:
        assert t.setup().global_step == stop
        rest = consumed(t.fit())
        assert [m["step"] for m in t.history] == list(range(stop, steps))
    assert first + rest == uninterrupted


def test_resume_refuses_another_dataset_or_seed(small_corpus_cfg, group2):
    with Trainer(small_corpus_cfg(dp=2, steps=3), actor_group=group2, progress=False) as t:
        t.fit()
        saved = t.data_position().to_dict()
    other_seed = small_corpus_cfg(dp=2, steps=6)
    other_seed["seed"] = 99
    with pytest.raises(ValueError, match=r"seed 7 \(now seed=99\)"):
        Trainer(other_seed, actor_group=group2, progress=False, data_position=saved).setup()
    bad = dict(saved, dataset="0000-byte-L16")
    with pytest.raises(ValueError, match="cannot resume the data position: it was saved with dataset"):
        Trainer(
            small_corpus_cfg(dp=2, steps=6), actor_group=group2, progress=False, data_position=bad
        ).setup()
    assert DataPosition.from_dict(saved).step == 3


@pytest.mark.parametrize("group_name, parallel", [
    ("group2", {"dp": 2, "zero": 3}),
    ("group2", {"dp": 1, "pp": 2, "schedule": "1f1b"}),
    ("group4", {"dp": 1, "pp": 2, "tp": 2, "schedule": "zbv", "micro_batch_size": 2}),
])
def test_validation_loss_matches_single_process(tiny_cfg, request, group_name, parallel):
    """The held-out loss each layout reports equals a plain forward of the same weights over the
    same held-out batches."""
    group = request.getfixturevalue(group_name)
    dp = parallel.pop("dp")
    cfg = tiny_cfg(parallel={"dp": dp, "micro_batch_size": 2, **parallel},
                   train={"steps": 3, "eval_every": 2, "eval_batches": 2})
    if parallel.get("tp"):
        cfg["model"]["vocab_size"] = 256
    with Trainer(cfg, actor_group=group, progress=False) as t:
        history = t.fit()
        weights = t.state_dict()
    assert "val_loss" not in history[0] and "val_loss" in history[1] and "val_loss" in history[2]
    expected = single_process_val_loss(config_from_dict(cfg), weights)
    assert history[2]["val_loss"] == pytest.approx(expected, rel=1e-5)
    assert torch.isfinite(torch.tensor(history[2]["val_loss"]))


def test_stream_without_free_cpus_fails_early_naming_the_field(tiny_cfg, group2):
    cfg = tiny_cfg(data={"stream_cpus": 1000})
    with pytest.raises(ConfigError, match=r"need data.stream_cpus=1000.0 free CPU, but the driver's node"):
        Trainer(cfg, actor_group=group2, progress=False).setup()


def test_local_shards_are_read_on_the_driver_node_and_uris_anywhere(ray_local):
    node = ray_local.get_runtime_context().get_node_id()
    assert local_node_if_local_path("/data/prepared") == node
    assert local_node_if_local_path("s3://bucket/prepared") is None
    assert local_node_if_local_path("file:///mnt/shared/prepared") is None
    assert on_node(node) == {"label_selector": {"ray.io/node-id": node}}
    assert on_node(None) == {}
