"""The data pipeline alone vs what training consumes, side by side in one run.

    python benchmarks/data_pipeline.py [--steps 20] [--tokenizers byte gpt2]

For each model (tiny, small) and tokenizer, on the King James Bible:
  prepare tok/s  Ray Data read -> tokenize -> pack -> parquet, into a fresh cache (one-off work)
  stream tok/s   one replica's stream alone (Ray Data tasks gather the step's samples from the
                 shards), drained as fast as the driver can pull it: what the feed can deliver
  train tok/s    training steps, dp=2 ZeRO-2, median after the first step
  headroom       stream tok/s / train tok/s per replica: above 1 means data is not the bottleneck
  data wait      median fraction of step time the first stages spent waiting for their batch
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import ray

from raymp.config import DataConfig, config_from_dict
from raymp.data import DataPosition, TrainOrder, load_dataset
from raymp.data.prepare import prepare
from raymp.data.stream import ReplicaStream, StreamSpec
from raymp.runtime.actor_group import ActorGroup
from raymp.trainer import Trainer

MODELS = {"tiny": dict(global_batch_size=32, seq_len=128), "small": dict(global_batch_size=16, seq_len=128)}
DP = 2


def prepare_rate(tokenizer: str, seq_len: int) -> float:
    with tempfile.TemporaryDirectory() as cache:
        t0 = time.perf_counter()
        _, manifest = prepare(
            "kjv", tokenizer=tokenizer, seq_len=seq_len, cache_dir=cache, log=lambda *_: None
        )
        return manifest["tokens"] / (time.perf_counter() - t0)


def stream_rate(data_cfg: DataConfig, global_batch: int, seq_len: int, steps: int) -> float:
    """One replica's stream (of DP), drained in the driver: tokens per second it delivers."""
    data = load_dataset(data_cfg, seq_len, log=lambda *_: None)
    order = TrainOrder(data.num_samples, data_cfg.val_fraction, 0, global_batch)
    start = DataPosition.at(0, 0, order, 0, data.identity)
    spec = StreamSpec(
        data.root, data.num_samples, data.seq_len, data_cfg.val_fraction, 0, global_batch, global_batch // DP, 0, start
    )
    stream = ReplicaStream(spec, steps, data_cfg.stream_cpus, data_cfg.prefetch_batches)
    t0 = time.perf_counter()
    for step in range(steps):
        stream.next(step)
    return steps * (global_batch // DP) * seq_len / (time.perf_counter() - t0)


def train_rates(
    group, model: str, tokenizer: str, cache: str, steps: int, out_dir: str
) -> tuple[float, float]:
    shape = MODELS[model]
    cfg = config_from_dict({
        "name": f"data-{model}-{tokenizer}", "output_dir": out_dir,
        "model": {"preset": model},
        "parallel": {"dp": DP, "zero": 2, "micro_batch_size": 8},
        "train": {"steps": steps, **shape, "eval_batches": 0},
        "optimizer": {"warmup_steps": 1},
        "data": {"tokenizer": tokenizer, "cache_dir": cache},
        "tracking": {"enabled": False},
    })
    with Trainer(cfg, actor_group=group, progress=False) as t:
        history = t.fit()[1:]
    return (statistics.median(m["tokens_per_s"] for m in history),
            statistics.median(m["data_wait_fraction"] for m in history))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tokenizers", nargs="+", default=["byte", "gpt2"])
    args = parser.parse_args()
    ray.init(address="local", num_cpus=DP + 2, include_dashboard=False, log_to_driver=False)
    group = ActorGroup(DP, "cpu", cpus_per_actor=1)
    rows = []
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as out_dir:
        for model, shape in MODELS.items():
            for tokenizer in args.tokenizers:
                data_cfg = DataConfig(tokenizer=tokenizer, cache_dir=cache)
                prep = prepare_rate(tokenizer, shape["seq_len"])
                load_dataset(data_cfg, shape["seq_len"], log=lambda *_: None)  # into `cache` for the rest
                stream = stream_rate(data_cfg, shape["global_batch_size"], shape["seq_len"], args.steps * 4)
                train, wait = train_rates(group, model, tokenizer, cache, args.steps, out_dir)
                rows.append((model, tokenizer, prep, stream, train, stream / (train / DP), wait))
    group.shutdown()
    print(f"\ndata pipeline vs training, KJV corpus, dp={DP} CPU actors, {args.steps} steps\n")
    print(
        "| model | tokenizer | prepare tok/s | stream tok/s (1 replica) | train tok/s (all) | headroom | data wait |"
    )
    print("|---|---|---|---|---|---|---|")
    for model, tok, prep, stream, train, headroom, wait in rows:
        print(
            f"| {model} | {tok} | {prep:,.0f} | {stream:,.0f} | {train:,.0f} | {headroom:.1f}x | {wait:.1%} |"
        )


if __name__ == "__main__":
    main()
