"""The GPU check, in one command: `python -m benchmarks.gpu_check` on a machine with CUDA GPUs.

Trains a Llama-1B-shaped model (preset `llama-1b`) on one GPU, each run for a few steps:
- a plain single-process torch loop (raymp.reference: the loop every parity test compares with,
  the same model code, learning-rate schedule and fused AdamW), bf16, eager: the yardstick;
- raymp dp=1 in bf16, eager and compiled (regional torch.compile, the default on CUDA);
- raymp dp=1 in fp8 (torchao float8 linears in the blocks), tensorwise and rowwise scaling,
  compiled, each with its guardrail: its per-step losses against the compiled bf16 run's;
- torchtitan 0.3.0's own train script on the same shape, sequence length and batch, bf16 and fp8
  (rowwise, the only float8 recipe its converter offers), compiled as its configs compile
  (benchmarks/torchtitan_peer.py says how it is set up offline);
- raymp dp=N ZeRO-3 over NCCL when N >= 2 GPUs are visible.
Every run trains on the KJV in GPT-2 tokens (the model keeps Llama's 128,256-entry vocabulary).
The micro-batch and activation checkpointing are the planner's choice for the GPU's memory.
For each: tokens/s, MFU against the GPU's dense bf16 peak (fp8 runs too, as torchtitan reports
them) and against the plain loop, the CUDA peak memory beside the planner's estimate, the first
and last loss. A run that fails is a row with its error, not the end of the check; a time budget
(--budget-s) skips what would not fit. Writes a "GPU check" section into BENCHMARKS.md
(replacing an earlier one) and prints it. The parts that need no GPU (arguments, the peak
lookup, MFU arithmetic, the guardrail, the section text) are tested on CPU in
tests/unit/test_gpu_check.py.
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
import traceback

from benchmarks.common import REPO, median, peak_tflops_of, run_config, steady

TITLE = "## GPU check"
# An fp8 run passes its guardrail when the mean of its last three losses is within this fraction
# of the compiled bf16 run's (same weights, same batches); each step's difference is shown too.
GUARD_BAND = 0.03
# A learning rate at which bf16 itself trains smoothly on a 1B model: at raymp's default (3e-3, tuned
# for the tiny presets) bf16 runs spike and part by 8% from each other, too wide for a guardrail.
LR = 3e-4
TORCHTITAN = "torchtitan 0.3.0, its own train script"


def options(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_check", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--preset", default="llama-1b", help="built-in model shape (default llama-1b)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-per-gpu", type=int, default=4, help="sequences per GPU per step")
    parser.add_argument(
        "--steps", type=int, default=10, help="timed steps per run (the first two are dropped)"
    )
    parser.add_argument("--gpus", type=int, default=None, help="GPUs for the dp=N run (default: all visible)")
    parser.add_argument("--gpu-name", default=None, help=argparse.SUPPRESS)  # tests: the name to look up
    # tests: the whole check's flow on CPU ranks (a small preset), with the GPU's numbers made up
    parser.add_argument("--dry-run-on-cpu", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="dense bf16 peak per GPU (default: looked up from the GPU's name)")
    parser.add_argument("--budget-s", type=float, default=390,
                        help="wall-clock budget for all runs; a run that would start past it is skipped")
    parser.add_argument("--skip-parity", action="store_true", help="leave out the fp32 parity table")
    parser.add_argument("--skip-loss", action="store_true", help="leave out the loss-kernel table")
    parser.add_argument("--skip-torchtitan", metavar="WHY", default=None,
                        help="leave out torchtitan's rows, saying why in their place")
    parser.add_argument(
        "--only",
        nargs="+",
        metavar="TEXT",
        default=None,
        help="run only the runs whose names contain one of these (the plain loop always runs)",
    )
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


def guardrail(losses: list[float], reference: list[float], band: float = GUARD_BAND) -> dict:
    """An fp8 run's losses against the bf16 run's: the largest per-step relative difference, the
    difference of the last three steps' means, and whether that is within `band`."""
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
    tail = min(3, len(losses))
    end = abs(sum(losses[-tail:]) - sum(reference[-tail:])) / abs(sum(reference[-tail:]))
    return {"worst_step": worst, "end": end, "within": end <= band}


def section(rows: list[dict], setup: str, notes: list[str] = ()) -> str:
    """The GPU check's Markdown section from its runs (each: run, gpus, tokens_per_s, mfu, vs_plain,
    peak_gib, estimate_gib, first_loss, loss, and for fp8 runs guard; or run and error). The
    first step's loss (same weights, same batch) shows every run trained the same model on the
    same data; later losses drift apart in bf16."""
    lines = [
        TITLE,
        "",
        setup,
        "",
        "| run | GPUs | tokens/s | MFU | vs plain loop | CUDA peak (GiB) | planner's estimate (GiB) | first loss | last loss | fp8 guardrail vs bf16 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['run']} | - | - | - | - | - | - | - | - | {r['error']} |")
            continue
        estimate = "-" if r.get("estimate_gib") is None else f"{r['estimate_gib']:.1f}"
        guard = "-"
        if r.get("guard"):
            g = r["guard"]
            guard = (
                f"{'within' if g['within'] else 'OUTSIDE'} {GUARD_BAND:.0%}: last 3 steps {g['end']:.2%} apart, "
                f"worst step {g['worst_step']:.2%}"
            )
        lines.append(
            f"| {r['run']} | {r['gpus']} | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | "
            f"{r['vs_plain']:.2f}x | {r['peak_gib']:.1f} | {estimate} | {r['first_loss']:.4f} | {r['loss']:.4f} | {guard} |"
        )
    lines += [""] + [f"- {n}" for n in notes]
    return "\n".join(lines).rstrip("\n") + "\n"


def replace_section(text: str, new: str, title: str = TITLE) -> str:
    """`text` with its section headed `title` (up to the next "## " heading) replaced by `new`,
    or `new` appended (run_all --update replaces its sections the same way)."""
    start = text.find(title + "\n")
    if start < 0:
        return text.rstrip("\n") + "\n\n" + new
    end = text.find("\n## ", start + len(title))
    return text[:start] + new.rstrip("\n") + "\n" + ("" if end < 0 else "\n" + text[end + 1:])


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
    from raymp.runtime.process_memory import peak_memory

    cuda = cfg_dict["resources"]["device"] == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    ends = []

    def step_done(step: int) -> None:
        if cuda:
            torch.cuda.synchronize(device)
        ends.append(time.perf_counter())

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    losses, _ = train_single_process(config_from_dict(cfg_dict), steps, device, step_done)
    times = [b - a for a, b in zip([start] + ends, ends)]
    peak = peak_memory(device)
    if cuda:  # this process's allocator would keep the loop's memory from the raymp ranks after it
        gc.collect()
        torch.cuda.empty_cache()
    return {"step_s": median(steady(times)), "losses": losses, "peak_bytes": peak, "estimate_bytes": None}


def _raymp(cfg_dict: dict) -> dict:
    from raymp.config import config_from_dict
    from raymp.trainer import Trainer

    with Trainer(config_from_dict(cfg_dict), progress=False) as trainer:
        history = trainer.fit()
    return {
        "step_s": median(steady([m["step_time_s"] for m in history])),
        "losses": [m["loss"] for m in history],
        "peak_bytes": history[-1]["peak_mem_bytes_max"],
        "estimate_bytes": history[-1]["memory_estimate_bytes_max"],
    }


PARITY_RUNS = {"raymp dp=1 (DDP)": {}, "raymp dp=1 ZeRO-2 (FSDP2)": {"zero": 2},
               "raymp dp=1 ZeRO-3 (FSDP2)": {"zero": 3}}


def parity_rows(device: str, out: str, steps: int = 5) -> list[dict]:
    """raymp's parity standard on this device: fp32, model `small`, each engine against the
    single-process reference on the same device; the largest relative difference of the
    per-step losses. (The timed bf16 runs cannot show this: bf16 kernels are not bitwise
    reproducible, and ten steps at full learning rate amplify that.)"""
    from raymp.config import config_from_dict
    from raymp.reference import train_single_process

    shape = dict(preset="small", seq_len=256, global_batch=8, micro_batch=2, steps=steps, device=device,
                 cpus_per_actor=1, train={"compile": False})  # the engines' math, eager like the reference
    reference, _ = train_single_process(
        config_from_dict(run_config("gpu-parity", out, **shape)), steps, device
    )
    rows = []
    for name, extra in PARITY_RUNS.items():
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


def loss_rows(device: str, tokens: int, vocab: int, repeats: int = 5) -> list[dict]:
    """The loss on its own (bf16 logits of one micro-batch, forward + backward): F.cross_entropy on
    an fp32 copy (what raymp did before), raymp's blockwise loss eager and fused; time (median of
    `repeats` after a warm-up), the memory the loss adds above its inputs, and the gradient's
    largest difference from the fp32 one."""
    import torch
    import torch.nn.functional as F

    from raymp.loss import lm_loss

    g = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(tokens, vocab, device=device, generator=g) * 2).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (tokens,), device=device, generator=g)
    ways = {"F.cross_entropy(logits.float())": lambda x: F.cross_entropy(x.float(), labels),
            "raymp blockwise, eager": lambda x: lm_loss(x[None], labels[None]),
            "raymp blockwise, fused (compiled)": lambda x: lm_loss(x[None], labels[None], fused=True)}
    reference = None
    rows = []
    for name, fn in ways.items():
        times = []
        for _ in range(repeats + 1):
            x = logits.detach().clone().requires_grad_()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            start = time.perf_counter()
            fn(x).backward()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            extra = torch.cuda.max_memory_allocated() - base
        grad = x.grad.float()
        reference = grad if reference is None else reference
        extra -= x.grad.numel() * x.grad.element_size()  # the gradient every way must write
        rows.append({"way": name, "ms": 1000 * median(times[1:]), "extra_gib": extra / 2**30,
                     "grad_diff": float((grad - reference).abs().max() / reference.abs().max())})
        print(rows[-1], flush=True)
        del x, grad
    return rows


def loss_table(rows: list[dict], tokens: int, vocab: int) -> str:
    lines = [
        f"The loss alone on this GPU: bf16 logits of {tokens:,} tokens x {vocab:,} entries (one micro-batch), "
        "forward + backward, median of 5 after a warm-up:",
        "",
        "| loss | ms | memory above the logits and their gradient (GiB) | gradient vs the first row (max rel.) |",
        "|---|---|---|---|",
    ]
    lines += [f"| {r['way']} | {r['ms']:.1f} | {r['extra_gib']:.2f} | {r['grad_diff']:.1e} |" for r in rows]
    return "\n".join(lines) + "\n"


def planned_micro_batch(opts, gpu_gib: float) -> tuple[int, bool]:
    """The planner's micro-batch and activation checkpointing for this shape on one GPU of
    `gpu_gib`: the fastest layout that fits (the larger micro-batch among equals)."""
    from raymp.config import config_from_dict
    from raymp.models import model_args
    from raymp.planner import plan
    from raymp.step_time import Cluster

    cfg = config_from_dict(run_config("plan", tempfile.gettempdir(), preset=opts.preset, seq_len=opts.seq_len,
                                      global_batch=opts.batch_per_gpu, precision="bf16"))
    cluster = Cluster(nodes=1, gpus_per_node=1, gpu_memory_gb=gpu_gib * 2**30 / 1e9)
    best = plan(model_args(cfg.model, 256), cluster, opts.batch_per_gpu, opts.seq_len, True).best
    if best is None:
        raise SystemExit(
            f"gpu_check: the planner finds no layout of {opts.preset} that fits one GPU of {gpu_gib:.0f} GiB"
        )
    return best.layout.micro_batch_size, best.layout.activation_checkpointing


def the_runs(opts) -> dict:
    """name -> (GPUs, runner, config changes), in the order they run: what matters most first."""
    runs = {
        "plain torch loop (1 process), bf16 eager": (1, lambda cfg: _plain_loop(cfg, opts.steps), {}),
        "raymp dp=1, bf16 compiled": (1, _raymp, {"train": {"compile": True}}),
        f"{TORCHTITAN}, bf16 compiled": (1, _torchtitan(opts), {}),
        "raymp dp=1, fp8 tensorwise compiled": (1, _raymp, {"precision": "fp8", "train": {"compile": True}}),
        "raymp dp=1, fp8 rowwise compiled": (
            1,
            _raymp,
            {"precision": "fp8", "train": {"compile": True}, "float8": {"recipe": "rowwise"}},
        ),
        f"{TORCHTITAN}, fp8 rowwise compiled": (1, _torchtitan(opts, "rowwise"), {"precision": "fp8"}),
        "raymp dp=1, bf16 eager": (1, _raymp, {"train": {"compile": False}}),
    }
    if opts.skip_torchtitan is not None or opts.dry_run_on_cpu:
        runs = {name: run for name, run in runs.items() if not name.startswith(TORCHTITAN)}
    if opts.only:
        runs = {name: run for i, (name, run) in enumerate(runs.items())
                if i == 0 or any(text in name for text in opts.only)}
    if opts.gpus >= 2:
        runs[f"raymp dp={opts.gpus} ZeRO-3 (NCCL), bf16 compiled"] = (
            opts.gpus,
            _raymp,
            {"zero": 3, "train": {"compile": True}},
        )
    return runs


def _torchtitan(opts, fp8: str | None = None):
    """The runner of torchtitan's row: its train script on the run's shape (the config's
    global batch on one GPU), its peak as reserved memory (what its log reports)."""
    def run(cfg: dict) -> dict:
        from benchmarks import torchtitan_peer

        r = torchtitan_peer.run(opts.steps, cfg["train"]["global_batch_size"], opts.seq_len, LR, fp8)
        return {"step_s": r["step_s"], "losses": r["losses"], "peak_bytes": r["peak_gib"] * 2**30,
                "estimate_bytes": None, "stand_ins": r["stand_ins"]}
    return run


def _merge(cfg: dict, changes: dict) -> dict:
    for key, value in changes.items():
        if key == "zero":
            cfg["parallel"]["zero"] = value
        elif isinstance(value, dict):
            cfg.setdefault(key, {}).update(value)
        else:
            cfg[key] = value
    return cfg


def main(argv=None) -> None:
    import torch

    from raymp.config import config_from_dict
    from raymp.models import model_args
    from raymp.step_time import step_flops

    opts = options(argv)
    began = time.perf_counter()
    device = "cpu" if opts.dry_run_on_cpu else "cuda"
    if opts.dry_run_on_cpu:
        visible, gpu_name, gpu_gib = 1, "CPU (dry run)", 8.0
    else:
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        gpu_name = torch.cuda.get_device_name(0) if visible else None
        gpu_gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if visible else 0
    resolve_gpus(opts, visible, gpu_name)
    micro, checkpointed = planned_micro_batch(opts, gpu_gib)
    out = tempfile.mkdtemp(prefix="raymp-gpu-check-")
    vocab = model_args(config_from_dict(run_config("vocab", out, preset=opts.preset)).model, 256).vocab_size
    loss_tokens = micro * opts.seq_len
    rows, bf16_losses, plain_mfu, losses, parity = [], {}, None, [], []
    stood_in: set[str] = set()  # torch names torchtitan's process was given a stand-in for
    rows_after = (
        []
        if opts.skip_torchtitan is None
        else [{"run": TORCHTITAN, "error": f"not run: {opts.skip_torchtitan}"}]
    )

    def write() -> None:
        """The section as measured so far, into opts.out (replacing its predecessor)."""
        setup = (
            f"`python -m benchmarks.gpu_check` on {visible} x {gpu_name} (dense bf16 peak "
            f"{opts.peak_tflops:g} TFLOP/s per GPU), torch {torch.__version__}. Model `{opts.preset}` (the KJV in "
            f"GPT-2 tokens), seq_len {opts.seq_len}, {opts.batch_per_gpu} sequences per GPU per step in micro-batches "
            f"of {micro} ({'with' if checkpointed else 'no'} activation checkpointing: the planner's choice for "
            f"{gpu_gib:.0f} GiB), fused AdamW at learning rate {LR:g} after one warm-up step, median step of steps "
            f"3..{opts.steps}. MFU is against the bf16 peak for "
            "every run, fp8 included. CUDA peak is torch.cuda.max_memory_allocated (the largest rank); the "
            "planner's estimate is model state and saved activations. Whole check: "
            f"{time.perf_counter() - began:.0f} s."
        )
        notes = [
            f"fp8 guardrail: the mean loss of the last three steps within {GUARD_BAND:.0%} of the same trainer's "
            "compiled bf16 run's (same initial weights and batches).",
            f"{TORCHTITAN}: its llama3 registry's pieces with its 1B flavor (FlexAttention, its default; chunked "
            "cross-entropy; compiled model and loss), launched by torchrun; tokens/s and the losses are read from "
            "its per-step log (median step of steps 3..N, as above), its peak is the reserved memory that log "
            "reports. Its data loader packs the same KJV text with an end-of-text token after each verse, so its "
            "batches are not raymp's: its losses show it trained a comparable model, not the same batches.",
            "MFU counts 6 x parameters (the tied output projection once) + 12 x layers x dim x seq_len FLOPs per "
            "token for every run, torchtitan's included (its own formula).",
            "The plain loop computes the loss with raymp's eager blockwise loss (see the loss table: slower "
            "than F.cross_entropy on fp32 logits, in an eighth of the memory above the logits).",
        ] + ([f"{TORCHTITAN} ran with a stand-in for {', '.join(sorted(stood_in))}: names it imports at module "
              f"level but does not use on one GPU, which this machine's torch {torch.__version__} lacks "
              "(benchmarks/torchtitan_peer.py; a stand-in raises if constructed)."] if stood_in else [])
        text = (section(rows + rows_after, setup, notes)
                + ("\n" + loss_table(losses, loss_tokens, vocab) if losses else "")
                + ("\n" + parity_table(parity) if parity else ""))
        with open(opts.out) as f:
            current = f.read()
        with open(opts.out + ".tmp", "w") as f:
            f.write(replace_section(current, text))
        os.replace(opts.out + ".tmp", opts.out)

    for name, (gpus, fn, changes) in the_runs(opts).items():
        if time.perf_counter() - began > opts.budget_s:
            rows.append(
                {"run": name, "error": f"not run: the check's {opts.budget_s:.0f} s budget was spent"}
            )
            continue
        cfg = run_config(f"gpu-check-{gpus}", out, preset=opts.preset, seq_len=opts.seq_len, device=device,
                         precision="bf16", steps=opts.steps, dp=gpus, global_batch=opts.batch_per_gpu * gpus,
                         micro_batch=micro, cpus_per_actor=1 if opts.dry_run_on_cpu else 4,
                         optimizer={"fused": True, "lr": LR}, data={"tokenizer": "gpt2"})
        cfg["parallel"]["activation_checkpointing"] = checkpointed
        cfg = _merge(cfg, changes)
        cfg["tracking"] = {"enabled": False, "peak_tflops_per_device": opts.peak_tflops}
        t0 = time.perf_counter()
        try:
            r = fn(cfg)
            stood_in.update(r.get("stand_ins", ()))
        except Exception as exc:  # one failed run is a row, not the end of the check
            traceback.print_exc()
            last = [line for line in str(exc).splitlines() if line.strip()][-1]  # a remote error's own line
            rows.append({"run": name, "error": f"failed: {' '.join(last.split())[:240]}"})
            write()
            continue
        flops = step_flops(
            model_args(config_from_dict(cfg).model, 256), cfg["train"]["global_batch_size"], opts.seq_len
        )
        utilisation = mfu(flops, r["step_s"], gpus, opts.peak_tflops)
        plain_mfu = plain_mfu or utilisation
        row = {
            "run": name,
            "gpus": gpus,
            "tokens_per_s": cfg["train"]["global_batch_size"] * opts.seq_len / r["step_s"],
            "mfu": utilisation,
            "vs_plain": utilisation / plain_mfu,
            "peak_gib": r["peak_bytes"] / 2**30,
            "estimate_gib": None if r["estimate_bytes"] is None else r["estimate_bytes"] / 2**30,
            "first_loss": r["losses"][0],
            "loss": r["losses"][-1],
            "losses": r["losses"],
            "wall_s": time.perf_counter() - t0,
        }
        titan = name.startswith(TORCHTITAN)
        if "bf16 compiled" in name:  # each fp8 run's guardrail is its own trainer's bf16 run
            bf16_losses[titan] = r["losses"]
        if cfg.get("precision") == "fp8" and titan in bf16_losses:
            row["guard"] = guardrail(r["losses"], bf16_losses[titan])
        rows.append(row)
        print({k: v for k, v in row.items() if k != "losses"}, flush=True)
        write()  # what is measured so far, should the machine be taken back before the end
    losses += [] if opts.skip_loss or opts.dry_run_on_cpu else loss_rows(device, loss_tokens, vocab)
    write()
    parity += (
        [] if opts.skip_parity or time.perf_counter() - began > opts.budget_s else parity_rows(device, out)
    )
    write()
    print(existing_section(open(opts.out).read()))
    print(f"wrote the GPU check section of {opts.out}")


if __name__ == "__main__":
    main()
