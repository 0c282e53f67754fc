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
