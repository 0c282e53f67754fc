"""The checkpoint tests' run: the tiny model on the KJV, saving every `every` steps into `ckpt_dir`."""

from __future__ import annotations

STEPS = 5


def run_cfg(root, cache, ckpt_dir, *, every=0, resume="auto", steps=STEPS, **parallel) -> dict:
    return {
        "name": "ckpt", "seed": 5, "output_dir": str(root / "runs"),
        "model": {"preset": "tiny", "max_seq_len": 64},
        "parallel": {"dp": 1, "micro_batch_size": 2, **parallel},
        "train": {"steps": steps, "global_batch_size": 8, "seq_len": 32, "log_every": 1, "eval_batches": 0},
        "optimizer": {"lr": 1e-2, "warmup_steps": 1, "grad_clip": 1.0},
        "data": {"source": "kjv", "tokenizer": "byte", "cache_dir": cache},
        "tracking": {"enabled": False},
        "checkpoint": {"every": every, "dir": str(ckpt_dir), "resume": resume},
    }
