"""A kept state handed to a joining rank (raymp.runtime.transfer): what the receiver rebuilds from
the description and the flat buffers is the state sent, every dtype and shape, scalars and
non-tensor values included. The wire is replaced by a queue; the live joins over gloo are in
tests/integration/test_survivors.py."""

from __future__ import annotations

import torch

from raymp.runtime import transfer


def test_a_state_sent_and_received_is_the_same_state(monkeypatch):
    wire = []
    monkeypatch.setattr(transfer.dist, "send", lambda t, dst: wire.append((dst, t.clone())))

    def recv(t, src):
        dst, sent = wire.pop(0)
        assert dst == 1 and src == 0 and sent.dtype == t.dtype and sent.shape == t.shape
        t.copy_(sent)

    monkeypatch.setattr(transfer.dist, "recv", recv)
    state = {"model.w": torch.randn(3, 4), "model.b": torch.randn(4).bfloat16(),
             "optim.w.step": torch.tensor(7.0), "optim.w.exp_avg": torch.randn(4, 6)[:, ::2],
             "rng.torch": torch.get_rng_state(), "scheduler": '{"last_epoch": 7}'}
    transfer.send_state(state, 1)
    assert len(wire) == 3  # one buffer per dtype: float32, bfloat16, uint8
    got = transfer.receive_state(transfer.describe(state), 0)
    assert list(got) == list(state) and got["scheduler"] == state["scheduler"]
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def test_a_kept_copy_is_the_state_until_it_is_put_back(monkeypatch):
    """Worker.keep_state on a rank that holds a copy already (its step lost a peer, or a join
    failed before the copy went back) keeps that copy: the model it would copy now is not the
    state (a failed step's, or a set-up's without values)."""
    from raymp.runtime import kept_state

    made, loaded = [], []
    monkeypatch.setattr(kept_state, "host_state",
                        lambda *parts: made.append(1) or {"scheduler": '{"last_epoch": 3}', "w": torch.ones(2)})
    monkeypatch.setattr(kept_state, "load_host_state", lambda copy, *parts: loaded.append(copy))
    kept = kept_state.KeptState()
    assert kept.keep(None, None, None) == 3 and kept.keep(None, None, None) == 3 and made == [1]
    assert kept.description()["w"].shape == (2,)
    kept.hand_over((), None, None)  # nothing to send or receive: its own copy goes back
    kept.put_back(None, None, None)
    assert loaded[0]["w"].sum() == 2 and kept.copy is None
