"""What MLflow logging costs the driver, per step, side by side in one run.

    python benchmarks/tracking_overhead.py [--steps 40]

The tiny config (dp=2, ZeRO-2) trains with its metrics going to the embedded sqlite store and to
an `mlflow server --workers 1` over HTTP (started here), each with metrics written every step
(flush_every=1) and batched (flush_every=10). For each: the driver's time inside MLflow calls per
step (RunTracker.time_in_mlflow_s: set-up params and tags, metrics, the final artifacts),
the median step time, and the ratio of the two. The same actors train every row.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from raymp.runtime.actor_group import ActorGroup
from raymp.ray_connection import connect
from raymp.trainer import Trainer


def start_server(root: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "mlflow"), "server", "--workers", "1", "--host", "127.0.0.1",
         "--port", str(port), "--backend-store-uri", f"sqlite:///{root}/server.db",
         "--artifacts-destination", f"{root}/server-artifacts"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=root)
    url = f"http://127.0.0.1:{port}"
    for _ in range(240):
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            return server, url
        except OSError:
            time.sleep(0.5)
    server.terminate()
    raise RuntimeError("mlflow server did not start")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="raymp-mlflow-bench-")
    server, url = start_server(root)
    connect(None, 3)  # a local Ray with room for the data stream beside the 2 actors
    group = ActorGroup(2, "cpu", placement_timeout_s=120)
    rows = []
    try:
        for store, uri in (("sqlite", f"sqlite:///{root}/bench.db"), ("http server", url)):
            for flush_every in (1, 10):
                overrides = [f"output_dir={root}/runs", f"train.steps={args.steps}", "train.log_every=1000",
                             f"tracking.tracking_uri={uri}", f"tracking.flush_every={flush_every}",
                             "checkpoint.every=0", "optimizer.warmup_steps=2"]
                with Trainer("configs/tiny.yaml", overrides, actor_group=group, progress=False) as t:
                    history = t.fit()
                    in_mlflow = t.tracker.time_in_mlflow_s
                step = statistics.median(m["step_time_s"] for m in history)
                per_step = in_mlflow / len(history)
                rows.append((store, flush_every, per_step * 1e3, step * 1e3, per_step / step))
    finally:
        group.shutdown()
        server.terminate()
        server.wait(timeout=30)
    print(f"\nMLflow time on the driver, {args.steps} steps of configs/tiny.yaml (dp=2 ZeRO-2)")
    print("| store | flush_every | MLflow ms/step | step ms (median) | MLflow / step |")
    print("|---|---|---|---|---|")
    for store, flush, ms, step_ms, ratio in rows:
        print(f"| {store} | {flush} | {ms:.1f} | {step_ms:.0f} | {ratio:.1%} |")


if __name__ == "__main__":
    main()
