"""precision fp8's parts that need no GPU: which linears it converts, and the refusals a rank
makes at set-up (the float8 matmuls themselves ran on an H100: BENCHMARKS.md "GPU check")."""

from __future__ import annotations

import pytest
import torch

from raymp.config import config_from_dict
from raymp.models import build_model, model_spec
from raymp.parallel.float8 import Float8Unavailable, check_device, converts


def test_only_the_blocks_linears_with_dimensions_of_sixteen_convert():
    cfg = config_from_dict({"model": {"preset": "tiny"}})
    model = build_model(model_spec(cfg.model, 250, 0), 0, torch.device("cpu"))  # a vocabulary not of 16
    chosen = {fqn for fqn, module in model.named_modules() if converts(fqn, module)}
    linears = {fqn for fqn, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    assert chosen and all(fqn.startswith("layers.") for fqn in chosen)
    assert linears - chosen == {
        fqn for fqn in linears if not fqn.startswith("layers.")
    }  # the head stays bf16
    odd = torch.nn.Linear(64, 250)
    assert not converts("layers.0.feed_forward.w9", odd)


def test_a_rank_without_float8_tensor_cores_refuses_in_one_line():
    with pytest.raises(Float8Unavailable, match="precision fp8 needs a CUDA device; set precision=bf16"):
        check_device(torch.device("cpu"))
