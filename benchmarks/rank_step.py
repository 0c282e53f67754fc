"""A rank's step against a plain loop of the same model on the same core: raymp's per-rank code
(`raymp.runtime.worker.Worker`, the class inside each actor, on a one-rank gloo group) and a
plain torch loop (model, AdamW, forward, loss, backward, clip, step, zero_grad), in one process
with one thread, the same batches, rounds interleaved. No Ray and no driver: this is the part of
a step the orchestration sections cannot show. Also where a step's time goes, phase by phase."""

from __future__ import annotations

import socket
import statistics
import tempfile
import time

import numpy as np

from benchmarks.common import global_batches, run_config, window

# Sizes: the presets, and a ~50M shape (the `small` preset widened and deepened).
MODELS = {
    "tiny": {"preset": "tiny"},
    "small": {"preset": "small"},
    "50M": {"preset": "small", "dim": 640, "n_layers": 10, "n_heads": 10, "n_kv_heads": 5, "ffn_dim": 1728},
}
PHASES = ("data", "forward + backward", "clip (grad norm)", "optimizer step", "rest")


class _Timed:
    """Wraps a callable and adds its wall time to a phase of the step being timed."""

    def __init__(self, fn, phases: dict, name: str):
        self.fn, self.phases, self.name = fn, phases, name

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.phases[self.name] = self.phases.get(self.name, 0.0) + time.perf_counter() - t


def _plain(cfg, vocab: int, batches: list, phases: list) -> dict:
    import torch

    from raymp.loss import lm_loss
    from raymp.models import build_model, model_spec
    from raymp.optim import build_optimizer, build_scheduler

    model = build_model(model_spec(cfg.model, vocab, cfg.seed), cfg.seed, torch.device("cpu"))
    optimizer = build_optimizer(model.parameters(), cfg.optimizer)
    scheduler = build_scheduler(optimizer, cfg.optimizer, cfg.train.steps)
    times, losses = [], []
    for tokens in batches:
        t0 = time.perf_counter()
        batch = torch.from_numpy(tokens.astype(np.int64))
        t1 = time.perf_counter()
        loss = lm_loss(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.grad_clip)
        t3 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t4 = time.perf_counter()
        scheduler.step()
        losses.append(loss.item())
        t5 = time.perf_counter()
        times.append(t5 - t0)
        phases.append(dict(zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4))))
    return {"step_times": times, "losses": losses}


class _Rank:
    """One Worker on a one-rank gloo group, set up anew for each run (as a launch does)."""

    def __init__(self):
        from raymp.runtime.worker import Worker

        self.worker = Worker(1)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.worker.init_distributed(0, 1, "127.0.0.1", port, "gloo", 300)

    def run(self, cfg, vocab: int, batches: list, phases: list) -> dict:
        from benchmarks.peers_plain import FixedBatches

        w = self.worker
        w.setup(cfg, vocab)
        w.stream = FixedBatches(batches, 1, 0)
        now: dict = {}
        w.stream.next = _Timed(w.stream.next, now, "data")
        w.step_runner.forward_backward = _Timed(w.step_runner.forward_backward, now, "forward + backward")
        w.engine.clip_grad_norm = _Timed(w.engine.clip_grad_norm, now, "clip (grad norm)")
        began = {}
        # Hooks, not a wrapper: the scheduler checks that optimizer.step was not replaced.
        w.engine.optimizer.register_step_pre_hook(lambda *_: began.update(t=time.perf_counter()))
        w.engine.optimizer.register_step_post_hook(
            lambda *_: now.update(
                {"optimizer step": now.get("optimizer step", 0.0) + time.perf_counter() - began["t"]}
            )
        )
        times, losses = [], []
        for step in range(len(batches)):
            now.clear()
            t = time.perf_counter()
            report = w.train_step(step)
            times.append(time.perf_counter() - t)
            losses.append(report.loss)
            phases.append(
                {**{k: now.get(k, 0.0) for k in PHASES[:-1]}, "rest": times[-1] - sum(now.values())}
            )
        return {"step_times": times, "losses": losses}

    def close(self) -> None:
        self.worker.shutdown()


def measure(opts) -> dict:
    import torch

    from raymp.config import config_from_dict

    torch.set_num_threads(1)
    out = tempfile.mkdtemp(prefix="raymp-bench-rank-")
    rank = _Rank()
    rows, raw, breakdown = [], {}, {}
    steps = max(opts.steps, 12)
    for label, model in MODELS.items():
        big = label == "50M"
        cfg_dict = run_config(f"rank-{label}", out, steps=steps, global_batch=4 if big else 8, seq_len=128,
                              micro_batch=4 if big else 8, model=model)
        cfg = config_from_dict(cfg_dict)
        batches, vocab = global_batches(cfg_dict)
        runs = {"raymp": [], "plain": []}
        phases = {"raymp": [], "plain": []}
        for _ in range(opts.reps):  # interleaved rounds, raymp first then the plain loop
            runs["raymp"].append(rank.run(cfg, vocab, batches, phases["raymp"]))
            runs["plain"].append(_plain(cfg, vocab, batches, phases["plain"]))
        # Each run's window (its first two steps dropped), the rounds pooled.
        stats = {k: window([t for r in rs for t in r["step_times"][2:]], skip=0) for k, rs in runs.items()}
        gap = max(abs(a - b) / abs(b) for r, p in zip(runs["raymp"], runs["plain"])
                  for a, b in zip(r["losses"], p["losses"]))
        s, p = stats["raymp"], stats["plain"]
        rows.append(
            [
                label,
                f"{cfg.train.global_batch_size} x 128",
                f"{p['mean'] * 1e3:.1f}",
                f"{s['mean'] * 1e3:.1f}",
                f"{s['mean'] / p['mean']:.3f}x",
                f"{s['median'] / p['median']:.3f}x",
                f"{p['tail']:.2f}",
                f"{s['tail']:.2f}",
                f"{gap:.1e}",
            ]
        )
        # Phases of every timed step (the first two of each run dropped, as in the window).
        timed = {k: [x for i, x in enumerate(v) if i % steps >= 2] for k, v in phases.items()}
        breakdown[label] = {
            k: {ph: statistics.fmean(x[ph] for x in v) for ph in PHASES} for k, v in timed.items()
        }
        raw[label] = {k: [r["step_times"] for r in rs] for k, rs in runs.items()}
    rank.close()
    phase_rows = [[label, who] + [f"{b[who][ph] * 1e3:.1f}" for ph in PHASES]
                  for label, b in breakdown.items() for who in ("plain", "raymp")]
    return {
        "title": "10. A rank's step vs a plain loop",
        "setup": (
            f"One process, one thread: raymp's per-rank code (`Worker.train_step` on a one-rank gloo group: "
            f"no Ray, no driver) and a plain torch loop of the same model, same batches, fp32, {steps} steps "
            f"per run, the first two dropped, {opts.reps} interleaved rounds. Every ratio is of means over the "
            "whole timed window (slow steps included); the median ratio and each side's p95 / median "
            "(its slow tail) beside it."
        ),
        "columns": [
            "model",
            "batch",
            "plain loop step (ms, mean)",
            "raymp rank step (ms, mean)",
            "raymp / plain (mean)",
            "raymp / plain (median)",
            "plain p95 / median",
            "raymp p95 / median",
            "max loss gap",
        ],
        "rows": rows,
        "extra_tables": [
            {
                "caption": "Where a step's time goes (ms, mean of the timed window; raymp's 'rest' is "
                "the scheduler, the report and what the worker does around the phases, "
                "its memory measurement on the steps that take one)",
                "columns": ["model", "loop", *PHASES],
                "rows": phase_rows,
            }
        ],
        "notes": [
            "The loss column is the largest relative gap between the two loops' per-step losses: both "
            "trained the same thing.",
            "Data: the plain loop turns a NumPy batch into a tensor; raymp's rank reads a fixed batch "
            "here (its Ray Data stream in a run prefetches on a thread of its own).",
        ],
        "raw": raw,
    }
