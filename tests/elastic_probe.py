"""Run by test_elastic.py in its own process (it needs its own Ray cluster): a simulated cluster of
a head and two 3-CPU nodes; dp=2 x pp=2 trains once uninterrupted, then again while one node is
removed mid-run and a replacement added later. Prints what happened as JSON on the last line.

Nodes are removed and added on the main thread (cluster_utils wants that), so training runs in a
background thread here.
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time

import ray
from ray.cluster_utils import Cluster

from raymp import Trainer


def config(root: str, name: str, cache: str) -> dict:
    return {
        "name": name, "seed": 11, "output_dir": f"{root}/runs",
        "model": {"preset": "tiny", "max_seq_len": 64},
        "parallel": {"dp": 2, "pp": 2, "zero": 0, "micro_batch_size": 2, "schedule": "1f1b"},
        "train": {"steps": 14, "global_batch_size": 8, "seq_len": 32, "log_every": 1, "eval_batches": 0},
        "optimizer": {"lr": 1e-2, "warmup_steps": 1},
        "data": {"source": "kjv", "tokenizer": "byte", "cache_dir": cache},
        # 1.5 CPUs per actor: two actors per 3-CPU node, none on the 1-CPU head (the data streams').
        "resources": {"cpus_per_actor": 1.5, "collective_timeout_s": 60},
        "checkpoint": {"every": 2, "dir": f"{root}/{name}-checkpoints", "keep_last": 2},
        "elastic": {"wait_for_resources_s": 1, "poll_s": 0.2, "max_restarts": 2},
        "tracking": {"enabled": name == "interrupted", "tracking_uri": f"sqlite:///{root}/mlflow.db"},
    }


def summary(history: list[dict]) -> list[dict]:
    return [{"step": m["step"], "loss": m["loss"], "dp": m["dp"], "lr": m["lr"],
             "sample_ids": m["sample_ids"].tolist(), "finished_at": m["finished_at"]} for m in history]


def main() -> None:
    root = tempfile.mkdtemp(prefix="raymp-elastic-")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    nodes = [cluster.add_node(num_cpus=3) for _ in range(2)]
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    cache = sys.argv[1] if len(sys.argv) > 1 else f"{root}/cache"  # the test session's, if given
    out: dict = {}

    with Trainer(config(root, "uninterrupted", cache), progress=False) as t:
        out["uninterrupted"] = summary(t.fit())

    trainer = Trainer(config(root, "interrupted", cache), progress=False)
    trainer.setup()
    errors: list[BaseException] = []

    def train():
        try:
            trainer.fit()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    thread = threading.Thread(target=train)
    thread.start()
    while len(trainer.history) < 5 and thread.is_alive():
        time.sleep(0.05)
    victim_id = trainer.group.nodes[0]["node_id"]  # the node holding rank 0 (and one more)
    victim = next(n for n in nodes if n.node_id == victim_id)
    out["killed_after_step"] = trainer.history[-1]["step"]
    out["killed_at"] = time.time()
    cluster.remove_node(victim)
    while not trainer.restarts and thread.is_alive():
        time.sleep(0.05)
    out["dp_after_loss"] = trainer.config.parallel.dp
    cluster.add_node(num_cpus=3)  # the replacement: training grows back at its next checkpoint
    thread.join(timeout=300)
    if thread.is_alive() or errors:
        out["error"] = repr(errors[0]) if errors else "training did not finish within 300 s"
    out["interrupted"] = summary(trainer.history)
    out["restarts"] = trainer.restarts
    out["failures"] = trainer.failures
    out["mlflow"] = {"run_id": trainer.tracker.run_id, "uri": trainer.tracker.uri}
    out["checkpoints"] = [c.step for c in trainer.checkpoints.store.committed()]
    trainer.close()
    ray.shutdown()
    cluster.shutdown()
    print(json.dumps(out, default=str))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
