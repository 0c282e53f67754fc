"""The tensor-parallel plans of the Hugging Face families (Megatron style, on transformers' own
module names), kept beside the glue in hf.py and out of the model code: which linear is split by
columns or rows, where sequence parallelism shards the norms' activations, and a
vocabulary-parallel embedding and head whose logits stay sharded.

Applied by `HFSpec.tensor_parallel` with torch's `parallelize_module`.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)


def top_plan(module, sequence_parallel: bool = False) -> dict:
    """Vocabulary-parallel embedding (output whole, or this rank's slice of the sequence under
    SP, as the blocks take it) and head (logits left sharded over the vocabulary for raymp's
    loss_parallel cross-entropy)."""
    between = Shard(1) if sequence_parallel else Replicate()
    plan = {}
    if module.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if module.norm is not None and sequence_parallel:
        plan["norm"] = SequenceParallel()
    if module.output is not None:
        plan["output"] = ColwiseParallel(
            input_layouts=between, output_layouts=Shard(-1), use_local_output=False
        )
    return plan


def llama_block_plan(sequence_parallel: bool = False) -> dict:
    """Megatron: q/k/v and gate/up split by output (heads, hidden units), o/down by input; the
    attention's view(..., -1, head_dim) then sees this rank's heads only. With sequence
    parallelism the norms run on sequence slices; attention and MLP gather the whole sequence
    in and reduce-scatter back out."""
    between = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=between),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=between),
    }
    if sequence_parallel:
        plan.update({
            "input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel(),
            # The decoder layer calls self_attn(hidden_states=...) by keyword, mlp(x) by position.
            "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                            use_local_output=True),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                      use_local_output=True),
        })
    return plan


def gpt2_block_plan() -> dict:
    """GPT-2's split c_attn (q, k, v by heads) and c_fc by output, the c_proj layers by input."""
    return {"attn.c_attn.q": ColwiseParallel(), "attn.c_attn.k": ColwiseParallel(),
            "attn.c_attn.v": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
            "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()}
