"""12. What the step's commit vote costs: the plain DDP loop of torch's tutorial (benchmarks.plain_loop)
in spawned gloo processes, whose gradient norm is one all-reduce over every rank as raymp's is,
once with that all-reduce carrying only the norm and once carrying the ballots too (as raymp's
does: raymp.runtime.commit_vote), in interleaved rounds; the ballots change nothing the training
computes, so both lose the same. Both variants meet at a barrier before the all-reduce, so the
time taken from the ballot's making to its record holds no wait for the other rank.

    python -m benchmarks.run_all --only vote --update
"""

from __future__ import annotations

import contextlib
import tempfile
import time

import numpy as np

from benchmarks.common import global_batches, median, run_config, spread, window
from benchmarks.peers_plain import _spawn


def _rank_main(rank: int, world: int, port: int, cfg_dict: dict, vocab_size: int, batches, with_ballot: bool,
               results) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.plain_loop import model_and_optimizer
    from raymp.loss import lm_loss
    from raymp.runtime.commit_vote import Ballot

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    device = torch.device("cpu")
    cfg, model, optimizer, scheduler, _ = model_and_optimizer(cfg_dict, vocab_size, "ddp", device)
    per_rank = cfg.train.global_batch_size // world
    ends, losses, reduce_s = [], [], []
    for step, tokens in enumerate(batches):
        batch = torch.from_numpy(np.array_split(tokens, world)[rank].astype(np.int64))
        micro = batch.split(cfg.parallel.micro_batch_size)
        total = 0.0
        for i, mb in enumerate(micro):
            ctx = model.no_sync() if i < len(micro) - 1 else contextlib.nullcontext()
            with ctx:
                loss = lm_loss(model(mb[:, :-1]), mb[:, 1:])
                (loss / len(micro)).backward()
            total += float(loss.detach()) / len(micro)
        # The norm as raymp takes it: the squares of this rank's share, one all-reduce over every rank.
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        squares = torch.nn.utils.get_total_norm(grads).double().square().reshape(1) / world
        dist.barrier()  # both variants: the timed part below then holds no wait for the other rank
        t0 = time.perf_counter()
        if with_ballot:
            ballot = Ballot(step, total, np.arange(per_rank) + rank * per_rank, per_rank, rank, world)
            summed = torch.cat([squares, ballot.tensor])
            dist.all_reduce(summed)
            ballot.tensor.copy_(summed[1:])
            ballot.record()
            squares = summed[:1]
        else:
            dist.all_reduce(squares)
        reduce_s.append(time.perf_counter() - t0)
        norm = float(squares.sqrt())
        coef = min(1.0, cfg.optimizer.grad_clip / (norm + 1e-6))
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        mean = torch.tensor([total])
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        losses.append(float(mean))
        ends.append(time.time())
    results.put((rank, ends, losses, reduce_s))
    dist.destroy_process_group()


def _run(cfg: dict, batches, vocab: int, with_ballot: bool, world: int = 2) -> dict:
    """One run in `world` spawned processes: the slowest rank's step ends, the losses, and per
    step the slowest rank's time in the norm's all-reduce."""
    out = _spawn(_rank_main, world, (cfg, vocab, batches, with_ballot))
    out["reduce_s"] = np.array([more[0] for more in out["more"]]).max(axis=0).tolist()
    return out


VARIANTS = {"norm only": False, "norm + ballots (raymp)": True}


def measure(opts) -> dict:
    steps = max(20, 2 * opts.steps)
    cfg = run_config("vote", tempfile.mkdtemp(prefix="raymp-bench-vote-"), preset="small", dp=2, steps=steps,
                     global_batch=16, seq_len=128)
    batches, vocab = global_batches(cfg)
    runs: dict[str, list] = {name: [] for name in VARIANTS}
    for _ in range(opts.reps):
        for name, with_ballot in VARIANTS.items():
            runs[name].append(_run(cfg, batches, vocab, with_ballot))
    base = runs["norm only"]
    base_mean = median([window(r["step_times"])["mean"] for r in base])
    rows = []
    for name, rs in runs.items():
        means = [window(r["step_times"])["mean"] for r in rs]
        reduce_us = [median(r["reduce_s"][2:]) * 1e6 for r in rs]
        gap = max(max(abs(a - b) / abs(b) for a, b in zip(r["losses"], base[0]["losses"])) for r in rs)
        rows.append([name, f"{median(means) * 1e3:.1f}", spread([m * 1e3 for m in means]),
                     f"{median(reduce_us):.0f}", spread(reduce_us), f"{median(means) / base_mean:.3f}x",
                     f"{gap:.1e}"])
    extra = median([median(r["reduce_s"][2:]) for r in runs["norm + ballots (raymp)"]]) - median(
        [median(r["reduce_s"][2:]) for r in base])
    return {
        "title": "12. Commit vote: its cost per step",
        "setup": (f"model `small` (section 5's), dp=2 DDP (torch's tutorial loop, benchmarks.plain_loop, in 2 spawned gloo "
                  f"processes x 1 thread), global batch 16 x 128, fp32, {steps} steps per run, {opts.reps} "
                  "interleaved rounds. The gradient norm is one all-reduce over every rank (as raymp takes "
                  "it); raymp's ballots (each rank's loss and sample ids, raymp.runtime.commit_vote) ride on "
                  "it. Means over steps 3.."f"{steps}. Both variants meet at a barrier just before the "
                  "all-reduce (so its time holds no wait for the other rank; the step times include the "
                  "barrier on both sides); the all-reduce time runs from the ballot's making to its record, "
                  "the slowest rank's, median over steps."),
        "columns": ["norm all-reduce carries", "step (ms, mean)", "per round", "ballot + all-reduce (us)", "per round",
                    "step vs norm only", "max loss gap"],
        "rows": rows,
        "raw": {name: [{"step_times_s": r["step_times"], "reduce_s": r["reduce_s"], "losses": r["losses"]}
                       for r in rs] for name, rs in runs.items()},
        "notes": [
            f"The ballots add {extra * 1e6:.0f} us to the all-reduce, "
            f"{extra / base_mean:.2%} of a step here; there is no collective of the vote's own. "
            "The whole-step ratio also carries the rounds' noise on this shared machine.",
        ],
    }
