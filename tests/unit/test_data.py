"""Data without Ray: the tokenizers, the global order (each sample once per epoch, whatever dp), the
held-out validation split, and a batch larger than the dataset refused."""

from __future__ import annotations

import numpy as np
import pytest

from raymp.data import GlobalOrder, TrainOrder, replica_slice
from raymp.data.tokenizers import get_tokenizer


def test_gpt2_tokenizer_works_offline_with_known_ids():
    tok = get_tokenizer("gpt2")
    ids = tok.encode("In the beginning God created the heaven and the earth.")
    assert list(ids[:3]) == [818, 262, 3726]  # "In", " the", " beginning" in GPT-2's vocab
    assert tok.decode(ids) == "In the beginning God created the heaven and the earth."


def test_byte_tokenizer_round_trip():
    tok = get_tokenizer("byte")
    assert tok.decode(tok.encode("naïve café")) == "naïve café"


def test_global_order_covers_each_sample_once_per_epoch_independent_of_dp():
    order = GlobalOrder(num_samples=103, seed=5)
    stream = order.take(0, 3 * 103 + 7)
    for epoch in range(3):
        assert sorted(stream[epoch * 103:(epoch + 1) * 103].tolist()) == list(range(103))
    # Any split of the same positions gives the same samples: that is what makes resume exact.
    assert np.array_equal(
        np.concatenate([order.take(0, 50), order.take(50, 200), order.take(250, 66)]), stream
    )
    batch = stream[:8]
    for dp in (1, 2, 4, 8):
        shares = [replica_slice(batch, len(batch) // dp, r) for r in range(dp)]
        assert np.array_equal(np.concatenate(shares), batch)
    assert not np.array_equal(order.permutation(0), order.permutation(1))


def test_validation_split_is_held_out_and_fixed():
    a = TrainOrder(1000, 0.05, seed=3, global_batch=8)
    assert len(a.val_ids) == 50 and not set(a.val_ids) & set(a.train_ids)
    assert len(a.val_ids) + len(a.train_ids) == 1000
    assert np.array_equal(TrainOrder(1000, 0.05, seed=3, global_batch=16).val_ids, a.val_ids)
    assert not set(np.concatenate([a.batch(s) for s in range(200)])) & set(a.val_ids)


def test_batch_larger_than_dataset_is_refused():
    with pytest.raises(ValueError, match="exceeds the 9 training samples"):
        TrainOrder(10, 0.1, seed=0, global_batch=16)
