"""Tensor parallelism's loss: cross-entropy on vocabulary-sharded logits. (Each model's TP plan
is applied by its ModelSpec, raymp.models, with torch's DTensor `parallelize_module`.)"""

from __future__ import annotations

import contextlib

from torch.distributed.tensor.parallel import loss_parallel


def loss_context(tp: int):
    """Cross-entropy on vocabulary-sharded logits (DTensor Shard(-1)) without gathering them:
    torch's loss_parallel computes the softmax normaliser with tp all-reduces. It must also be
    active for the backward of that loss."""
    if tp == 1:
        return contextlib.nullcontext()

    return loss_parallel()
