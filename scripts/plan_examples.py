"""The README's planner examples, generated from the planner so they never drift from what
`raymp plan` prints for the same arguments.

    python scripts/plan_examples.py            # print the block
    python scripts/plan_examples.py --write    # regenerate it in README.md
    python scripts/plan_examples.py --check    # exit 1 when README.md's block is stale (a test runs this)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BEGIN, END = "<!-- plan-examples:begin (scripts/plan_examples.py --write) -->", "<!-- plan-examples:end -->"
GB = 1e9


def _plan(preset: str, global_batch: int, seq_len: int):
    """(plan, model args, cluster, shape) as `raymp plan --model preset --nodes 8 --gpus-per-node 8
    --gpu-memory-gb 80 --global-batch .. --seq-len ..` computes them."""
    from raymp.config import config_from_dict
    from raymp.models import model_args
    from raymp.models.shape import TOKENIZER_VOCAB, model_shape
    from raymp.planner import plan
    from raymp.step_time import cluster_from_config

    cfg = config_from_dict({"model": {"preset": preset, "max_seq_len": seq_len}, "precision": "bf16",
                            "cluster": {"nodes": 8, "gpus_per_node": 8, "gpu_memory_gb": 80},
                            "train": {"global_batch_size": global_batch, "seq_len": seq_len}})
    vocab = cfg.model.vocab_size or TOKENIZER_VOCAB.get(cfg.data.tokenizer, 256)
    margs, shape = model_args(cfg.model, vocab), model_shape(cfg.model, vocab, cfg.data.tokenizer)
    cluster = cluster_from_config(cfg.cluster)
    return plan(margs, cluster, global_batch, seq_len, True, shape=shape), margs, cluster, shape


def _layout_words(layout) -> str:
    """pp=8, tp=8, no ZeRO, SP: the layout in words."""
    parts = [f"{name}={getattr(layout, name)}" for name in ("dp", "pp", "tp") if getattr(layout, name) > 1]
    parts.append(f"ZeRO-{layout.zero}" if layout.zero else "no ZeRO")
    parts += [flag for flag, on in (("activation checkpointing", layout.activation_checkpointing),
                                    ("SP", layout.sequence_parallel)) if on]
    return ", ".join(parts)


def block() -> str:
    from raymp.layout import Layout
    from raymp.planner import estimate

    lines = []
    llama, *_ = _plan("llama-70b", 512, 4096)
    best = llama.best
    plain_dp = [c for c in llama.candidates if c.layout.pp == c.layout.tp == 1 and c.layout.zero in (1, 2)]
    lines.append(
        f"- Llama 70B (`--model llama-70b`), global batch 512 x 4096: {len(llama.feasible)} of "
        f"{len(llama.candidates)} layouts fit. The best is {_layout_words(best.layout)}, micro-batch "
        f"{best.layout.micro_batch_size}, at {best.peak_bytes / GB:.1f} GB per GPU."
        + (
            " Plain data parallelism with ZeRO-1/2 never fits."
            if plain_dp and not any(c.fits for c in plain_dp)
            else ""
        )
    )
    gpt3, margs, cluster, _ = _plan("gpt3-175b", 256, 2048)
    best = gpt3.best
    usable = cluster.gpu_memory_gb * GB * cluster.usable_fraction

    def need(layout):
        return max(r.total_bytes for r in estimate(margs, layout, 256, 2048, True))

    seed, fixed = Layout(dp=8, pp=4, tp=2, zero=2), Layout(
        dp=8, pp=4, tp=2, zero=3, activation_checkpointing=True
    )
    fits = {True: "fits", False: "does not fit"}
    lines.append(
        f"- GPT-3 175B (`--model gpt3-175b`), global batch 256 x 2048: {len(gpt3.feasible)} of "
        f"{len(gpt3.candidates)} layouts fit. The best is {_layout_words(best.layout)}, micro-batch "
        f"{best.layout.micro_batch_size}, at {best.peak_bytes / GB:.1f} GB per GPU. "
        f"`--compare dp=8,pp=4,tp=2,zero=2` explains the seed document's example layout: it needs "
        f"{need(seed) / GB:.1f} GB per GPU and {fits[need(seed) <= usable]} in {usable / GB:.0f} GB usable; "
        f"with ZeRO-3 and activation checkpointing the same 8 x 4 x 2 layout needs {need(fixed) / GB:.1f} GB "
        f"and {fits[need(fixed) <= usable]}.")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true")
    mode.add_argument("--check", action="store_true")
    args = parser.parse_args()
    text = block()
    if not (args.write or args.check):
        print(text)
        return 0
    readme = README.read_text()
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    fresh = f"{head}{BEGIN}\n{text}\n{END}{tail}"
    if args.write:
        README.write_text(fresh)
        return 0
    if fresh != readme:
        print("README.md: the planner examples are stale; run python scripts/plan_examples.py --write")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
