"""Document masking for packed samples (data.document_mask): a token attends only within its own
document. The masked logits equal each document run alone (transformers' own forward for the
Hugging Face families, sliding windows included); a factory model cannot be masked and is refused."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from raymp.config import ConfigError, config_from_dict  # noqa: E402
from raymp.models import build_model  # noqa: E402
from raymp.models.builtin import BuiltinSpec  # noqa: E402
from raymp.models.hf import HFSpec, load_hf_config  # noqa: E402
from raymp.models.llama import ModelArgs  # noqa: E402
from raymp.models.masks import document_ids  # noqa: E402
from helpers.documents import EOT, documents, packed_tokens  # noqa: E402
from helpers.hf_cases import FAMILIES, SLIDING, hf_reference  # noqa: E402

HF_CONFIGS = {
    **FAMILIES,
    **{f"{name}-window8": {**cfg, "sliding_window": 8} for name, cfg in SLIDING.items()},
}


def test_document_ids_close_each_document_at_its_end_of_text():
    ids = document_ids(packed_tokens(), EOT)
    assert ids[0].tolist() == [0] * 6 + [1] * 15 + [2] * 11
    assert ids[1].tolist() == [0] * 13 + [1] * 19


def test_builtin_model_sees_each_document_alone():
    """RoPE scores depend on relative positions only: a document's logits inside the packed
    row equal those of the document run by itself; without the mask they do not."""
    args = ModelArgs(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64)
    model = build_model(BuiltinSpec(args, 1), 1).eval()
    tokens = packed_tokens()
    with torch.no_grad():
        masked, plain = model(tokens, document_ids=document_ids(tokens, EOT)), model(tokens)
        for b in range(len(tokens)):
            for start, end in documents(tokens[b]):
                alone = model(tokens[b:b + 1, start:end])
                torch.testing.assert_close(masked[b:b + 1, start:end], alone, rtol=0, atol=1e-5)
    assert (masked - plain).abs().max() > 0.1  # the later documents did see the earlier ones


# A transformers release that renames a mask builder's keyword warns a user on every step: an error here.
@pytest.mark.filterwarnings("error::FutureWarning")
@pytest.mark.parametrize("family", HF_CONFIGS)
def test_hf_model_sees_each_document_alone_as_transformers_computes_it(family):
    """Each document's logits equal transformers' own forward of that document alone at its
    positions in the row (sliding windows of 8 inside documents of up to 19 tokens)."""
    spec = HFSpec(load_hf_config(None, HF_CONFIGS[family]), None, seed=3)
    model = build_model(spec, 3).eval()
    reference = hf_reference(spec, model)
    tokens = packed_tokens()
    with torch.no_grad():
        masked = model(tokens, document_ids=document_ids(tokens, EOT))
        for b in range(len(tokens)):
            for start, end in documents(tokens[b]):
                alone = reference(
                    tokens[b : b + 1, start:end], position_ids=torch.arange(start, end)[None]
                ).logits
                torch.testing.assert_close(masked[b:b + 1, start:end], alone, rtol=0, atol=1e-5)


def test_document_mask_with_a_factory_model_is_refused():
    with pytest.raises(
        ConfigError, match="data.document_mask needs the built-in model or a Hugging Face one"
    ):
        config_from_dict(
            {"model": {"factory": "helpers.custom_model:build"}, "data": {"document_mask": True}}
        )
