"""Document masking for packed samples (data.document_mask): every layout trains as one process
masking the same documents does, built-in and Hugging Face models."""

from __future__ import annotations

import pytest

from raymp.config import config_from_dict
from raymp.reference import single_process_val_loss, train_single_process
from raymp.trainer import Trainer
from helpers.hf_cases import FAMILIES, SLIDING, WEIGHT_ATOL, hf_run
from helpers.parity import LOSS_RTOL, assert_losses_match, assert_weights_match

MASKED = {"document_mask": True}


def check_masked_parity(cfg: dict, group, weight_atol=2e-5) -> list[float]:
    """5 fp32 steps and a validation pass at the end: losses within 1e-5 relative of one
    process masking the same documents, the same final weights, the same held-out loss."""
    cfg["train"].update(eval_every=5, eval_batches=1)
    with Trainer(cfg, actor_group=group, progress=False) as trainer:
        history = trainer.fit()
        state = trainer.state_dict()
    ref_losses, ref_state = train_single_process(config_from_dict(cfg))
    assert_losses_match([m["loss"] for m in history], ref_losses, LOSS_RTOL)
    assert_weights_match(state, ref_state, atol=weight_atol)
    assert history[-1]["val_loss"] == pytest.approx(
        single_process_val_loss(config_from_dict(cfg), state), rel=1e-5
    )
    return ref_losses


def test_masking_changes_what_one_process_trains(tiny_cfg):
    """KJV bytes: a newline ends each verse, so 33-token samples often hold two documents."""
    on, _ = train_single_process(config_from_dict(tiny_cfg(data=MASKED)), steps=2)
    off, _ = train_single_process(config_from_dict(tiny_cfg()), steps=2)
    assert abs(on[1] - off[1]) > 1e-4 * abs(off[1]), (on, off)


BUILTIN_LAYOUTS = {
    "dp2-zero3": {"dp": 2, "zero": 3, "micro_batch_size": 2},
    "tp2-sp": {"dp": 1, "tp": 2, "sequence_parallel": True, "micro_batch_size": 2},
    "pp2-1f1b": {"dp": 1, "pp": 2, "micro_batch_size": 1, "schedule": "1f1b"},
    # V-shaped: rank 0 holds the first and the last stage, rank 1 the two in between.
    "pp2-zbv": {"dp": 1, "pp": 2, "micro_batch_size": 2, "schedule": "zbv"},
}


@pytest.mark.parametrize("layout", BUILTIN_LAYOUTS)
def test_builtin_model_with_document_mask_matches_single_process(layout, group2, tiny_cfg):
    cfg = tiny_cfg(parallel=BUILTIN_LAYOUTS[layout], data=MASKED)
    cfg["model"]["vocab_size"] = 256
    check_masked_parity(cfg, group2, weight_atol=2e-4 if "tp" in layout else 2e-5)


HF_LAYOUTS = {
    "mistral-window16-tp2": (SLIDING["mistral"], {"dp": 1, "tp": 2, "micro_batch_size": 2}),
    "gpt2-pp2": (FAMILIES["gpt2"], {"dp": 1, "pp": 2, "micro_batch_size": 1, "schedule": "1f1b"}),
}


@pytest.mark.parametrize("case", HF_LAYOUTS)
def test_hf_model_with_document_mask_matches_single_process(case, group2, tiny_cfg):
    hf_config, parallel = HF_LAYOUTS[case]
    check_masked_parity(hf_run(tiny_cfg, {"hf_config": hf_config}, parallel, data=MASKED), group2,
                        weight_atol=WEIGHT_ATOL)
