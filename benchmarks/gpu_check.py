"""The GPU check, in one command: `python -m benchmarks.gpu_check` on a machine with CUDA GPUs.

Trains a Llama-1B-shaped model (preset `llama-1b`) in bf16:
- a plain single-process torch loop (raymp.reference, the loop every parity test compares with:
  the same model builder, learning-rate schedule, autocast and fused AdamW): the yardstick;
- raymp dp=1 on one GPU, and dp=N ZeRO-3 over NCCL when N >= 2 GPUs are visible;
- raymp dp=1 ZeRO-2 with the optimizer state offloaded to the CPU (optimizer.cpu_offload).
For each: tokens/s, MFU against the GPU's dense bf16 peak and against the plain loop, and the
CUDA peak memory beside the planner's estimate. Writes a "GPU check" section into BENCHMARKS.md
(replacing an earlier one) and prints it. The parts that need no GPU (arguments, the peak
lookup, MFU arithmetic, the section text) are tested on CPU in tests/test_gpu_check.py.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from benchmarks.common import REPO, median, peak_tflops_of, run_config, steady

TITLE = "## GPU check"
OFFLOAD_STEPS = 5


def options(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama-1b", help="built-in model shape (default llama-1b)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-per-gpu", type=int, default=4, help="sequences per GPU per step")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run (the first two are dropped)")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs for the dp=N run (default: all visible)")
    parser.add_argument("--gpu-name", default=None, help=argparse.SUPPRESS)  # tests: the name to look up
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="dense bf16 peak per GPU (default: looked up from the GPU's name)")
    parser.add_argument("--out", default=os.path.join(REPO, "BENCHMARKS.md"),
                        help="the Markdown file whose GPU check section is replaced (or appended)")
    opts = parser.parse_args(argv)
    if opts.steps < 3:
        parser.error("--steps must be at least 3 (the first two steps are warm-up)")
    return opts


def resolve_gpus(opts, visible: int, name: str | None) -> argparse.Namespace:
    """Fill the GPU count and peak from what torch sees; SystemExit with one line when it cannot."""
    if visible == 0:
        raise SystemExit("gpu_check: torch sees no CUDA device (a CPU build of torch, or no GPU here); "
                         "nothing was run")
    opts.gpus = min(opts.gpus or visible, visible)
    if opts.peak_tflops is None:
        opts.peak_tflops = peak_tflops_of(name or "")
    return opts


def mfu(step_flops: float, step_s: float, gpus: int, peak_tflops: float) -> float:
    """Model FLOPs utilisation: the model's FLOPs per second per GPU over the GPU's dense peak."""
    return step_flops / step_s / gpus / (peak_tflops * 1e12)


def section(rows: list[dict], setup: str) -> str:
    """The GPU check's Markdown section from its runs (each: run, gpus, tokens_per_s, mfu, vs_plain,
    peak_gib, estimate_gib, first_loss, loss). The first step's loss (same weights, same batch)
    shows every run trained the same model on the same data; later losses drift apart in bf16."""
    lines = [TITLE, "", setup, "",
             "| run | GPUs | tokens/s | MFU | MFU vs plain loop | CUDA peak (GiB) | planner's estimate (GiB) | first loss | last loss |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        estimate = "-" if r.get("estimate_gib") is None else f"{r['estimate_gib']:.1f}"
        lines.append(f"| {r['run']} | {r['gpus']} | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | "
                     f"{r['vs_plain']:.2f}x | {r['peak_gib']:.1f} | {estimate} | {r['first_loss']:.4f} | {r['loss']:.4f} |")
    return "\n".join(lines) + "\n"


def replace_section(text: str, new: str, title: str = TITLE) -> str:
    """`text` with its section headed `title` (up to the next "## " heading) replaced by `new`,
    or `new` appended (run_all --update replaces its sections the same way)."""
    start = text.find(title + "\n")
    if start < 0:
        return text.rstrip("\n") + "\n\n" + new
    end = text.find("\n## ", start + len(title))
    return text[:start] + new + ("" if end < 0 else text[end + 1:])


def existing_section(text: str, title: str = TITLE) -> str | None:
    """The section headed `title` of a BENCHMARKS.md text (default: the GPU check, which
    run_all keeps), if it has one."""
    start = text.find(title + "\n")
    if start < 0:
        return None
    end = text.find("\n## ", start + len(title))
    return text[start:] if end < 0 else text[start:end + 1]


def _plain_loop(cfg_dict: dict, steps: int) -> dict:
    """One process, no Ray, no raymp runtime: raymp's single-process reference (the same loop
    every layout's parity test compares with), timed step by step on the GPU."""
    import torch

    from raymp.config import config_from_dict
    from raymp.reference import train_single_process

    device = torch.device("cuda", 0)
    ends = []

    def step_done(step: int) -> None:
        torch.cuda.synchronize(device)
        ends.append(time.perf_counter())

    torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    losses, _ = train_single_process(config_from_dict(cfg_dict), steps, device, step_done)
    times = [b - a for a, b in zip([start] + ends, ends)]
    return {"step_s": median(steady(times)), "losses": losses,
            "peak_bytes": torch.cuda.max_memory_allocated(device), "estimate_bytes": None}


def _raymp(cfg_dict: dict) -> dict:
    from raymp.config import config_from_dict
    from raymp.trainer import Trainer

    with Trainer(config_from_dict(cfg_dict), progress=False) as trainer:
        history = trainer.fit()
    return {"step_s": median(steady([m["step_time_s"] for m in history])), "losses": [m["loss"] for m in history],
            "peak_bytes": history[-1]["peak_mem_bytes_max"], "estimate_bytes": history[-1]["memory_estimate_bytes_max"]}


PARITY_RUNS = {"raymp dp=1 (DDP)": {}, "raymp dp=1 ZeRO-2 (FSDP2)": {"zero": 2},
               "raymp dp=1 ZeRO-3 (FSDP2)": {"zero": 3},
               "raymp dp=1 ZeRO-2, optimizer on CPU": {"zero": 2, "optimizer": {"cpu_offload": True}}}


def parity_rows(device: str, out: str, steps: int = 5) -> list[dict]:
    """raymp's parity standard on this device: fp32, model `small`, each engine against the
    single-process reference on the same device; the largest relative difference of the
    per-step losses. (The timed bf16 runs cannot show this: bf16 kernels are not bitwise
    reproducible, and ten steps at full learning rate amplify that.)"""
    from raymp.config import config_from_dict
    from raymp.reference import train_single_process

    shape = dict(preset="small", seq_len=256, global_batch=8, micro_batch=2, steps=steps, device=device,
                 cpus_per_actor=1)
    reference, _ = train_single_process(config_from_dict(run_config("gpu-parity", out, **shape)), steps, device)
    rows = []
    for name, extra in PARITY_RUNS.items():
        if device == "cpu" and "optimizer" in extra:
            continue  # optimizer offload is refused on CPU ranks
        losses = _raymp(run_config("gpu-parity", out, **shape, **extra))["losses"]
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
        rows.append({"run": name, "steps": steps, "worst": worst})
        print(rows[-1], flush=True)
    return rows


def parity_table(rows: list[dict]) -> str:
    lines = ["fp32 parity on this GPU (model `small`, seq_len 256, global batch 8 in micro-batches of 2): "
             "per-step losses against raymp's single-process reference run on the same GPU:", "",
             "| run | steps | largest relative loss difference | within 1e-5 |", "|---|---|---|---|"]
    lines += [f"| {r['run']} | {r['steps']} | {r['worst']:.1e} | {'yes' if r['worst'] <= 1e-5 else 'NO'} |"
              for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    import torch

    from raymp.config import config_from_dict
    from raymp.models import model_args
    from raymp.step_time import step_flops

    opts = options(argv)
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    resolve_gpus(opts, visible, torch.cuda.get_device_name(0) if visible else None)
    out = tempfile.mkdtemp(prefix="raymp-gpu-check-")
    shape = dict(preset=opts.preset, seq_len=opts.seq_len, device="cuda", precision="bf16", steps=opts.steps,
                 micro_batch=1, cpus_per_actor=4, optimizer={"fused": True})
    runs = {"plain torch loop (1 process)": (1, lambda cfg: _plain_loop(cfg, opts.steps), {}),
            "raymp dp=1": (1, _raymp, {})}
    if opts.gpus >= 2:
        runs[f"raymp dp={opts.gpus} ZeRO-3 (NCCL)"] = (opts.gpus, _raymp, {"zero": 3})
    runs["raymp dp=1 ZeRO-2, optimizer on CPU"] = (1, _raymp, {"zero": 2, "cpu_offload": True})
    parity = parity_rows("cuda", out)
    rows, plain_mfu = [], None
    for name, (gpus, fn, extra) in runs.items():
        offload = extra.pop("cpu_offload", False)
        cfg = run_config(f"gpu-check-{gpus}", out, dp=gpus, global_batch=opts.batch_per_gpu * gpus, **extra, **shape)
        if offload:  # a step is bound by the host's optimizer: fewer of them
            cfg["optimizer"]["cpu_offload"] = True
            cfg["train"]["steps"] = min(opts.steps, OFFLOAD_STEPS)
        cfg["tracking"] = {"enabled": False, "peak_tflops_per_device": opts.peak_tflops}
        r = fn(cfg)
        flops = step_flops(model_args(config_from_dict(cfg).model, 256), cfg["train"]["global_batch_size"], opts.seq_len)
        utilisation = mfu(flops, r["step_s"], gpus, opts.peak_tflops)
        plain_mfu = plain_mfu or utilisation
        rows.append({"run": name, "gpus": gpus, "tokens_per_s": cfg["train"]["global_batch_size"] * opts.seq_len / r["step_s"],
                     "mfu": utilisation, "vs_plain": utilisation / plain_mfu, "peak_gib": r["peak_bytes"] / 2**30,
                     "estimate_gib": None if r["estimate_bytes"] is None else r["estimate_bytes"] / 2**30,
                     "first_loss": r["losses"][0], "loss": r["losses"][-1]})
        print(rows[-1], flush=True)
    setup = (f"`python -m benchmarks.gpu_check` on {visible} x {torch.cuda.get_device_name(0)} (dense bf16 peak "
             f"{opts.peak_tflops:g} TFLOP/s per GPU), torch {torch.__version__}. Model `{opts.preset}`, bf16, "
             f"seq_len {opts.seq_len}, {opts.batch_per_gpu} sequences per GPU per step, micro-batch 1, fused AdamW, "
             f"median step of steps 3..{opts.steps} (3..{min(opts.steps, OFFLOAD_STEPS)} with the optimizer on the CPU). CUDA peak is torch.cuda.max_memory_allocated (the largest rank); the planner's "
             "estimate is model state and saved activations wherever they live (offloaded state included).")
    text = section(rows, setup) + "\n" + parity_table(parity)
    print(text)
    with open(opts.out) as f:
        current = f.read()
    tmp = opts.out + ".tmp"
    with open(tmp, "w") as f:
        f.write(replace_section(current, text))
    os.replace(tmp, opts.out)
    print(f"wrote the GPU check section of {opts.out}")


if __name__ == "__main__":
    main()
