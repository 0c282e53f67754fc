"""raymp.torch_compat, the one home of the private torch APIs raymp uses: each still exists and
behaves as raymp relies on in the installed torch, which lies in the stated range; and no other
module of raymp reaches into a private torch name."""

from __future__ import annotations

import re

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from raymp import torch_compat as compat
from helpers.cli import ROOT


def test_installed_torch_is_in_the_stated_range_which_is_the_packages():
    assert compat.torch_supported()
    assert not compat.torch_supported("2.7.1") and not compat.torch_supported("3.0.0+cu130")
    (low, high) = compat.SUPPORTED_TORCH
    assert f'"torch>={low[0]}.{low[1]},<{high[0]}"' in (ROOT / "pyproject.toml").read_text()


def test_private_apis_behave_as_relied_on():
    seen = []

    def f(x):
        seen.append(compat.recomputing())
        return x.sin()

    x = torch.randn(3, requires_grad=True)
    checkpoint(f, x, use_reentrant=False).sum().backward()
    assert seen == [False, True]
    a, b = torch.ones(2), torch.zeros(3)
    flat = compat.flatten_dense_tensors([a, b])
    assert [t.tolist() for t in compat.unflatten_dense_tensors(flat, [a, b])] == [a.tolist(), b.tolist()]
    block = nn.Linear(2, 2)
    wrapped = compat.checkpoint_wrapper(block)
    assert compat.unwrapped(wrapped) is block and hasattr(wrapped, compat.CHECKPOINT_WRAPPED)
    w = torch.randn(4, 4)
    assert compat.view_base(w.t()) is w and compat.view_base(w) is w
    m = nn.Module()
    m.register_buffer("b", torch.ones(1))
    assert compat.drop_buffer(m, "b").tolist() == [1.0] and "b" not in dict(m.named_buffers())
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    compat.set_scheduler_position(sched, 7, [0.5])
    assert sched._step_count == 7 and sched.get_last_lr() == [0.5]
    assert compat.dcp_writer_process() is None
    compat.set_compile_threads(1)
    for name in ("flatten_mesh", "unflatten_mesh"):  # DeviceMesh methods (exercised by the HSDP and cp tests)
        assert hasattr(torch.distributed.device_mesh.DeviceMesh, "_" + name.split("_")[0])
    import torch.distributed.checkpoint._fsspec_filesystem as fsspec_storage

    assert hasattr(fsspec_storage, "FsspecWriter") and hasattr(fsspec_storage, "FsspecReader")


def test_no_module_but_torch_compat_reaches_into_private_torch_names():
    private = re.compile(
        r"torch(\.[a-z_]+)*\._[a-z]|\._(flatten|unflatten|pg_registry|local_tensor|base|buffers|"
        r"step_count|last_lr|CHECKPOINT_PROCESS)\b"
    )
    offenders = [f"{path.relative_to(ROOT)}:{n}" for path in (ROOT / "raymp").rglob("*.py")
                 if path.name != "torch_compat.py"
                 for n, line in enumerate(path.read_text().splitlines(), 1)
                 if private.search(line.split("#")[0])]
    assert not offenders, offenders
