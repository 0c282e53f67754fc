"""train.compile: the combinations compile gets wrong (docs/design.md) are refused with the field."""

from __future__ import annotations

import pytest

from raymp.config import ConfigError, config_from_dict


@pytest.mark.unit
@pytest.mark.parametrize(
    "parallel, model, match",
    [
        (
            {"tp": 2, "sequence_parallel": True},
            {},
            "train.compile with parallel.sequence_parallel is not supported",
        ),
        (
            {"tp": 2},
            {
                "preset": None,
                "factory": "helpers.custom_model:build",
                "factory_tp_plan": "helpers.custom_model:tp_plan",
            },
            "train.compile with a model.factory module under parallel.tp > 1",
        ),
    ],
)
def test_combinations_compile_gets_wrong_are_refused(parallel, model, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict({"parallel": {"micro_batch_size": 2, **parallel}, "model": model,
                          "train": {"compile": True, "global_batch_size": 8}})
