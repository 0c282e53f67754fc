"""Attention masks: causal, sliding-window, and document masks for packed samples.

A packed sample holds the end of one document, whole documents and the start of another, each
closed by the tokenizer's end-of-text token. With `data.document_mask` a token attends only to
earlier tokens of its own document. The executor derives document ids from the input tokens
(`document_ids`) and hands them to the model's forward; the model turns them into masks here.
Positions are not reset per document: RoPE scores depend on relative positions only, so within
a document nothing changes; GPT-2's learned absolute positions keep their global index (as
Megatron's default `reset_position_ids=False`). The loss is not masked at document ends.
"""

from __future__ import annotations

import inspect
from functools import lru_cache

import torch


def document_ids(tokens: torch.Tensor, eot_id: int) -> torch.Tensor:
    """[b, s] token ids -> [b, s] document index within each row: an end-of-text token belongs
    to the document it closes, the token after it starts the next."""
    ends = (tokens == eot_id).to(torch.int64)
    return ends.cumsum(1) - ends


def mask_kwargs(tokens: torch.Tensor, eot_id: int | None) -> dict:
    """The model-forward keywords for these input tokens: document ids when masking documents
    (eot_id given), nothing otherwise."""
    return {} if eot_id is None else {"document_ids": document_ids(tokens, eot_id)}


def document_eot(cfg, data) -> int | None:
    """The end-of-text id a run masks documents at (data.document_mask on), else None: from
    the prepared data's manifest, the tokenizer its tokens were made with."""
    return data.eot_id if cfg.data.document_mask else None


def causal_document_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] document ids -> [b, 1, s, s] boolean mask for scaled_dot_product_attention (True:
    attend): causal, and within the query's document."""
    s = doc_ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=doc_ids.device).tril()
    return ((doc_ids[:, :, None] == doc_ids[:, None, :]) & causal)[:, None]


def hf_masks(config, layer_types: set[str], h: torch.Tensor, positions: torch.Tensor,
             doc_ids: torch.Tensor | None) -> dict:
    """By transformers layer type ("full_attention", "sliding_attention"): the mask transformers'
    own forward builds for it, intersected with the document mask when `doc_ids` is given. None
    where transformers' SDPA attention is plainly causal (it is, given no mask)."""
    from transformers.masking_utils import (
        create_causal_mask,
        create_sliding_window_causal_mask,
        packed_sequence_mask_function,
    )

    same_document = None if doc_ids is None else packed_sequence_mask_function(doc_ids)
    builders = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
    masks = {}
    for kind in layer_types:
        if kind not in builders:
            raise ValueError(f"attention layer type {kind!r} is not supported by raymp's transformers glue")
        if kind == "full_attention" and same_document is None:
            masks[kind] = None
            continue
        build = builders[kind]
        masks[kind] = build(config=config, inputs_embeds=h, attention_mask=None, position_ids=positions,
                            and_mask_function=same_document, **{_cache_keyword(build): None})
    return masks


@lru_cache(maxsize=None)
def _cache_keyword(build) -> str:
    """transformers 5.24 renamed the mask builders' `past_key_values` to `cache` (the old name
    still works there but warns); raymp accepts transformers >= 5.0, so it asks the builder,
    once per builder (masks are built on every forward)."""
    return "cache" if "cache" in inspect.signature(build).parameters else "past_key_values"
