"""The tensor-parallel plan of the built-in Llama model (Megatron-style), kept beside the model and
out of its code: which linear is split by columns or rows, where sequence parallelism shards the
norms' activations, and a vocabulary-parallel embedding and head whose logits stay sharded.

Applied by raymp.parallel.tensor with torch's `parallelize_module`.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)


def block_plan(sequence_parallel: bool, moe: bool = False) -> dict:
    """One transformer block. Between blocks the residual stream is a plain local tensor: the
    whole sequence (replicated) or, with sequence parallelism, this rank's slice of it.

    `moe`: the block's feed-forward is a mixture of experts, which TP does not split: every tp
    rank runs it whole on the whole sequence (gathered under SP, its output sliced back), so
    its routing is one process's and its gradients are the same on every tp rank, like a norm's.
    Its experts are split by expert parallelism instead (docs/design.md, MoE)."""
    between = Shard(1) if sequence_parallel else Replicate()
    feed_forward = {
        "feed_forward": PrepareModuleInputOutput(
            input_layouts=(between,), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(between,), use_local_output=True),
    } if moe else {
        "feed_forward": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=between),
    }
    plan = {
        # forward(x, cos, sin, mask): x is gathered to the full sequence; the RoPE tables and
        # the mask (whole sequence, built from the replicated tokens) are plain.
        "attention": PrepareModuleInput(input_layouts=(between, None, None, None),
                                        desired_input_layouts=(Replicate(), None, None, None)),
        "attention.wq": ColwiseParallel(),  # each rank: n_heads/tp query heads
        "attention.wk": ColwiseParallel(),  # and n_kv_heads/tp key/value heads
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=between),
        **feed_forward,
    }
    if sequence_parallel:
        plan["attention_norm"] = SequenceParallel()
        plan["ffn_norm"] = SequenceParallel()
    return plan


def model_plan(model, sequence_parallel: bool) -> dict:
    """Embedding, final norm and head (those this stage holds). The head's logits stay sharded
    over the vocabulary (a DTensor), for a cross-entropy that never gathers them."""
    between = Shard(1) if sequence_parallel else Replicate()
    plan = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if model.norm is not None and sequence_parallel:
        plan["norm"] = SequenceParallel()
    if model.output is not None:
        plan["output"] = ColwiseParallel(input_layouts=between, output_layouts=Shard(-1),
                                         use_local_output=False)
    return plan
