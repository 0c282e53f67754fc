"""Every peer comparison in one go; writes BENCHMARKS.md.

    python -m benchmarks.run_all                 # CPU, this machine (~30 min on 2 cores)
    python -m benchmarks.run_all --quick         # fewer steps and rounds, to try the command
    python -m benchmarks.run_all --gpu           # GPU mode: data parallel on every GPU, bf16, tokens/s and MFU
    python -m benchmarks.run_all --only dp memory
    python -m benchmarks.run_all --only elastic --update   # regenerate one section in place

Each section runs in a fresh interpreter (its own Ray instance, memory returned between
sections); its full result, raw repetitions included, is kept as JSON next to the report
(benchmarks/results/<time>/), so every number in BENCHMARKS.md can be traced to the runs behind it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

if __package__ in (None, ""):  # `python benchmarks/run_all.py` works too
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import REPO, importable_benchmarks, machine, peak_tflops_of  # noqa: E402
from benchmarks.gpu_check import existing_section, replace_section  # noqa: E402

SECTIONS = (
    "dp",
    "orchestration",
    "pipeline",
    "memory",
    "elastic",
    "scale",
    "driver",
    "long_context",
    "planner",
    "rank_step",
    "moe",
    "vote",
    "ep",
    "gloo",
    "save_stall",
)


_WHERE = {
    "rank_step": "rank_step:measure",
    "dp": "sections:data_parallel",
    "orchestration": "sections:orchestration",
    "pipeline": "sections:pipeline",
    "memory": "sections:memory",
    "elastic": "elastic:measure",
    "scale": "scale:measure",
    "driver": "driver_overhead:measure",
    "long_context": "long_context:measure",
    "planner": "planner_check:measure",
    "moe": "moe:measure",
    "vote": "commit_vote:measure",
    "ep": "expert_parallel:measure",
    "gloo": "gloo_groups:measure",
    "save_stall": "save_stall:measure",
}


def _section(name: str):
    import importlib

    module, function = _WHERE[name].split(":")
    return getattr(importlib.import_module(f"benchmarks.{module}"), function)


def _options(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds (numbers are noisier)")
    parser.add_argument("--gpu", action="store_true", help="GPU mode (needs CUDA): the data-parallel section")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, help="run these sections only")
    parser.add_argument("--out", default=os.path.join(REPO, "BENCHMARKS.md"))
    parser.add_argument("--steps", type=int, default=None, help="steps per timed run (default 10; quick 5)")
    parser.add_argument(
        "--reps", type=int, default=None, help="interleaved rounds per comparison (default 3; quick 1)"
    )
    parser.add_argument("--gpu-preset", default="gpt2-124m")
    parser.add_argument("--gpus", type=int, default=None, help="GPU mode: ranks (default: every visible GPU)")
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="GPU mode: dense bf16 peak per GPU for MFU (default: looked up from the GPU's name)",
    )
    parser.add_argument(
        "--memory-cap-mib", type=int, default=512, help="scale: per-actor cap on resident memory"
    )
    parser.add_argument("--long-cap-mib", type=int, default=256,
                        help="long_context: per-actor cap on resident memory (small: the tiny model's long "
                             "sequences must meet it before attention's quadratic time does)")
    parser.add_argument("--update", action="store_true",
                        help="with --only: replace those sections in the existing file, keep the others")
    parser.add_argument("--resume", metavar="RESULTS_DIR",
                        help="keep the sections already finished in this results folder; run the rest")
    parser.add_argument("--section", help=argparse.SUPPRESS)  # internal: run one section, write --json
    parser.add_argument("--json", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.update and not (opts.only and os.path.exists(opts.out)):
        parser.error(f"--update replaces the sections named by --only in an existing {opts.out}")
    opts.steps = opts.steps or (5 if opts.quick else 10)
    opts.reps = opts.reps or (1 if opts.quick else 3)
    opts.pipeline_steps = 3 if opts.quick else 5
    opts.scale_steps = 2
    if opts.gpu:
        import torch

        if not torch.cuda.is_available():
            parser.error("--gpu: torch sees no CUDA device (a CPU build of torch, or no GPU here)")
        opts.gpus = opts.gpus or torch.cuda.device_count()
        opts.peak_tflops = opts.peak_tflops or peak_tflops_of(torch.cuda.get_device_name(0))
    return opts


def _run_section(name: str, opts, results_dir: str) -> dict:
    """One section in a fresh interpreter; its JSON result."""
    path = os.path.join(results_dir, f"{name}.json")
    if os.path.exists(path):  # --resume: this section finished in an earlier invocation
        print(f"== {name}: kept from {path}", flush=True)
        with open(path) as f:
            result = json.load(f)
        result["kept"] = True
        return result
    argv = [
        sys.executable,
        "-m",
        "benchmarks.run_all",
        "--section",
        name,
        "--json",
        path,
        "--steps",
        str(opts.steps),
        "--reps",
        str(opts.reps),
        "--memory-cap-mib",
        str(opts.memory_cap_mib),
        "--long-cap-mib",
        str(opts.long_cap_mib),
    ]
    if opts.quick:
        argv.append("--quick")
    if opts.gpu:
        argv += ["--gpu", "--gpus", str(opts.gpus), "--peak-tflops", str(opts.peak_tflops),
                 "--gpu-preset", opts.gpu_preset]
    start = time.time()
    print(f"== {name} ...", flush=True)
    proc = subprocess.run(argv, cwd=REPO, env=os.environ.copy())
    if proc.returncode:
        raise SystemExit(f"section {name} failed (exit {proc.returncode}); its output is above. The finished "
                         f"sections are kept: add --resume {results_dir} to run only the rest")
    with open(path) as f:
        result = json.load(f)
    result["wall_s"] = time.time() - start
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"== {name}: {result['wall_s']:.0f} s", flush=True)
    return result


def _markdown(results: list[dict], info: dict, opts, command: str, results_dir: str) -> str:
    lines = [
        "# Benchmarks: raymp side by side with its peers",
        "",
        f"Produced by `{command}` on {info['date']}; nothing in this file is typed by hand. The raw numbers "
        f"behind every median (each repetition, each step) were written to `{os.path.relpath(results_dir, REPO)}/` "
        "(kept out of git; re-run the command to get your own).",
        "",
        "| machine | |",
        "|---|---|",
        f"| CPU | {info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB |",
        f"| GPU | {info['gpu'] or 'none'} |",
        f"| software | Python {info['python']}, torch {info['torch']}, Ray {info['ray']}, raymp {info['raymp']} |",
        f"| OS | {info['os']} |",
        "",
        "Timings on a shared 2-core machine are noisy: compare the ratios measured side by side in one run "
        "(rounds are interleaved), not absolute numbers across runs.",
        "",
    ]
    for r in results:
        lines += _section_lines(r)
    return "\n".join(lines)


def _section_lines(r: dict, regenerated: str = "") -> list[str]:
    lines = [f"## {r['title']}", "", r["setup"], ""]
    lines += _table(r["columns"], r["rows"])
    for extra in r.get("extra_tables", []):
        lines += [extra["caption"] + ":", ""] + _table(extra["columns"], extra["rows"])
    lines += [f"- {note}" for note in r["notes"]]
    wall = f"{r['wall_s']:.0f} s" if "wall_s" in r else "not recorded"
    if r.get("kept"):
        wall += "; kept by --resume: this section ran in an earlier invocation into the same results folder"
    return lines + ["", f"_Section wall time: {wall}{regenerated}._", ""]


def _table(columns: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns),
            *("| " + " | ".join(str(c) for c in row) + " |" for row in rows), ""]


def main(argv=None) -> None:
    opts = _options(argv)
    importable_benchmarks()
    os.environ.setdefault("RAY_TRAIN_ENABLE_STATE_TRACKING", "0")
    if opts.section:
        result = _section(opts.section)(opts)
        with open(opts.json, "w") as f:
            json.dump(result, f, indent=1, default=float)
        return
    names = opts.only or (["dp"] if opts.gpu else list(SECTIONS))
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    results_dir = (
        os.path.abspath(opts.resume) if opts.resume else os.path.join(REPO, "benchmarks", "results", stamp)
    )
    os.makedirs(results_dir, exist_ok=True)
    results = [_run_section(name, opts, results_dir) for name in names]
    info = {**machine(), "date": datetime.date.today().isoformat()}
    command = "python -m benchmarks.run_all" + "".join(
        f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    if opts.update:  # these sections in place; the rest of the file is the run named at its top
        with open(opts.out) as f:
            text = f.read()
        note = (f"; this section alone regenerated on {info['date']} by `{command}` (raw numbers in "
                f"`{os.path.relpath(results_dir, REPO)}/`)")
        for r in results:
            text = replace_section(text, "\n".join(_section_lines(r, note)) + "\n", f"## {r['title']}")
    else:
        text = _markdown(results, info, opts, command, results_dir)
    if os.path.exists(opts.out):  # a GPU check section (benchmarks/gpu_check.py) is kept
        with open(opts.out) as f:
            gpu = existing_section(f.read())
        if gpu is not None:
            text = replace_section(text, gpu)
    tmp = opts.out + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, opts.out)
    print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()
