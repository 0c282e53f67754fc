"""Tensor (and sequence) parallelism: apply a model's TP plan over the mesh's tp dimension with
torch's DTensor `parallelize_module`, and compute the loss on vocabulary-sharded logits."""

from __future__ import annotations

import contextlib

from torch import nn


def apply_tensor_parallel(model: nn.Module, tp_mesh, sequence_parallel: bool) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    from raymp.models.llama_tp import block_plan, model_plan

    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan(sequence_parallel))
    parallelize_module(model, tp_mesh, model_plan(model, sequence_parallel))
    # Embedding (rows = vocabulary) and head (columns = vocabulary) are both sharded on the
    # vocabulary dimension, so a tied pair stays one parameter: parallelize_module gave each
    # its own DTensor, tie them again.
    model.tie_weights()


def loss_context(tp: int):
    """Cross-entropy on vocabulary-sharded logits (DTensor Shard(-1)) without gathering them:
    torch's loss_parallel computes the softmax normaliser with tp all-reduces. It must also be
    active for the backward of that loss."""
    if tp == 1:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()
