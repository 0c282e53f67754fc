"""5. Elasticity, side by side on one simulated cluster (ray.cluster_utils: a head node for the
driver and two 3-CPU worker nodes): the same dp=2 training (DDP, a checkpoint every 4 steps)
under raymp's elastic restart (from the checkpoint, or from peer copies), raymp's keep_survivors
and Ray Train's FailureConfig restart. After step 6 the node holding rank 0 is removed; the other
node can host both ranks, so restarts are at full size. Then raymp's checkpoint cost
(benchmarks/recovery.py's measurement)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import threading
import time
from typing import NamedTuple

from benchmarks.common import global_batches, median, run_config, spread
from raymp.runtime.simulated_cluster import SimulatedCluster

KILL_AFTER, EVERY, STEPS = 6, 4, 14


# one rank per node, so one survives with its state (grow_back off: the row is the recovery alone)
SURVIVORS = {"keep_survivors": True, "grow_back": False}

STOPPED = "raymp, rank 0 stopped (SIGSTOP), shipped defaults"
PP_RESTART = "raymp dp2 x pp2 ZeRO-1, a stage's node lost: restart from storage"
PP_SPARE = "raymp dp2 x pp2 ZeRO-1, a stage's node lost: survivors + warm spare reload the peer copy"
PIPELINE = {"pp": 2, "zero": 1, "schedule": "1f1b"}  # ZeRO-1: a rank's optimizer shard is its own


class Mode(NamedTuple):
    elastic: dict  # the elastic section
    nodes: int  # worker nodes
    cpus: int  # CPUs per node
    replacement: bool  # a replacement node added at the loss
    parallel: dict = {}  # beside dp=2, ZeRO-0
    lost: int = 0  # the rank whose node is lost (or process stopped)


RAYMP_MODES = {
    # both ranks on one 3-CPU node
    "raymp restart": Mode({"keep_survivors": False}, 2, 3, True),
    # the same restart, but each rank's part of the state is also kept in the object store on the
    # other node after every step (elastic.peer_copy_every): the restart loads that, not the checkpoint
    "raymp peer-memory restore": Mode({"peer_copy_every": 1, "keep_survivors": False}, 2, 3, True),
    # 2-CPU nodes hold one rank each
    "raymp keep_survivors": Mode(SURVIVORS, 2, 2, True),
    # the same without the replacement node: its raylet and idle workers start on this machine's two
    # cores, beside the survivor's recovery; on a real cluster they boot on another machine
    "raymp keep_survivors, no replacement node": Mode(SURVIVORS, 2, 2, False),
    # a third 2-CPU node holds a warm spare (elastic.spares), which joins from the survivor's memory:
    # the next step runs at dp=2 again
    "raymp keep_survivors + warm spare, no replacement node": Mode(
        {"keep_survivors": True, "grow_back": True, "spares": 1}, 3, 2, False),
    # no node lost: rank 0's process is stopped, the elastic section left at its defaults (the
    # automatic step deadline: elastic.hang_factor x the slowest step, at least elastic.hang_floor_s)
    STOPPED: Mode({}, 2, 3, False),
    # one rank per 2-CPU node and a fifth node (the spare's, or room for the restart at dp=2); the
    # node of rank 3 (stage 1 of replica 1) is lost, no replacement node
    PP_RESTART: Mode({"keep_survivors": False}, 5, 2, False, PIPELINE, lost=3),
    PP_SPARE: Mode({"keep_survivors": True, "peer_copy_every": 1, "spares": 1}, 5, 2, False, PIPELINE,
                   lost=3),
}


def _raymp_recovery(cluster, root: str, rep: int, row: str) -> dict:
    from raymp.config import config_from_dict
    from raymp.elastic.peer_copies import PEER_MEMORY
    from raymp.trainer import Trainer

    mode = RAYMP_MODES[row]
    tag = "-".join(row.replace(",", "").replace(":", "").split()[1:])
    cfg = run_config(f"elastic-{tag}-{rep}", f"{root}/runs", dp=2, steps=STEPS, cpus_per_actor=1.5,
                     checkpoint={"every": EVERY, "dir": f"{root}/raymp-ck-{tag}-{rep}"}, elastic=mode.elastic,
                     zero=mode.parallel.get("zero", 0), pp=mode.parallel.get("pp", 1), parallel=mode.parallel)
    trainer = Trainer(config_from_dict(cfg), progress=False)
    trainer.setup()
    thread = threading.Thread(target=trainer.fit, daemon=True)
    thread.start()
    spares = trainer.group.spares
    while len(trainer.history) < KILL_AFTER or (spares and spares.ready() < spares.count):
        time.sleep(0.01)
    if row == STOPPED:
        stopped, killed = trainer.group.nodes[mode.lost]["pid"], time.time()
        os.kill(stopped, signal.SIGSTOP)
    else:
        killed = _remove(cluster, trainer.group.nodes[mode.lost]["node_id"], mode.replacement)
    thread.join()
    if row == STOPPED:
        with contextlib.suppress(ProcessLookupError):  # the restart let the actor go; it may remain
            os.kill(stopped, signal.SIGKILL)
    event = trainer.restarts[0]  # the recovery from the loss (a spare joins in it)
    after = min(m["finished_at"] for m in trainer.history if m["finished_at"] > killed)
    source = event["checkpoint"]
    read = _size(source) if source not in (None, PEER_MEMORY) else 0
    out = {"to_next_step_s": after - killed, "redone": event["failed_step"] - event["resumed_step"],
           "resume_s": event["detected_at"] + event["restart_s"] - killed, "read_bytes": read,
           "losses": [m["loss"] for m in trainer.history], "dp_after": trainer.config.parallel.dp,
           "state_from": "survivors' memory" if source is None else
           f"{'peer memory' if source == PEER_MEMORY else 'checkpoint'} of step {event['resumed_step']}"}
    trainer.close()
    return out


def _size(restored: str) -> int:
    """Bytes of the checkpoint a restart loaded: what each DDP rank reads (each loads the whole
    replicated state), on raymp's side and Ray Train's alike. By the end of the run
    checkpoint.keep_last has pruned it; every checkpoint of the run has its size, so the newest is
    measured."""
    parent = os.path.dirname(restored)
    newest = os.path.join(parent, max(d for d in os.listdir(parent) if d.startswith("step-")))
    return sum(os.path.getsize(os.path.join(newest, f)) for f in os.listdir(newest))


def _ray_train_recovery(cluster, root: str, rep: int, cfg: dict, batches, vocab: int) -> dict:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from benchmarks.peers_ray_train import recovery_loop

    log = f"{root}/ray-train-{rep}.jsonl"
    trainer = TorchTrainer(
        recovery_loop,
        train_loop_config={"cfg": cfg, "vocab_size": vocab, "batches": batches, "threads": 1, "every": EVERY,
                           "log": log},
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1.5}),
        run_config=RunConfig(name=f"ray-train-elastic-{rep}", storage_path=f"{root}/ray-train",
                             failure_config=FailureConfig(max_failures=1)),
    )
    failure: list[BaseException] = []

    def fit() -> None:
        try:
            trainer.fit()
        except BaseException as exc:  # reported below: a peer that did not recover is a result to explain
            failure.append(exc)

    thread = threading.Thread(target=fit, daemon=True)
    thread.start()
    while len(records := _read(log, "step")) < KILL_AFTER:
        time.sleep(0.01)
    killed = _remove(cluster, records[0]["node"])
    thread.join()
    steps = _read(log, "step")
    resumed = [r for r in _read(log, "started") if r["at"] > killed]
    if not resumed:
        why = (
            f"{type(failure[0]).__name__}: {str(failure[0]).splitlines()[0]}"
            if failure
            else "no error raised"
        )
        seen = [(r["step"], r["node"][:8]) for r in steps]
        raise RuntimeError(
            f"Ray Train did not restart after the node loss in round {rep} ({why}); node "
            f"{records[0]['node'][:8]} removed after step {KILL_AFTER}; steps logged (step, node): {seen}"
        )
    after = min(r["at"] for r in steps if r["at"] > killed)
    failed_step = max(r["step"] for r in steps if r["at"] <= killed)
    by_step = {r["step"]: r["loss"] for r in steps}  # the redone steps' second losses win
    step = resumed[0]["step"]
    return {
        "to_next_step_s": after - killed,
        "redone": failed_step - step,
        "resume_s": resumed[0]["at"] - killed,
        "read_bytes": resumed[0]["read_bytes"],
        "losses": [by_step[s] for s in sorted(by_step)],
        "dp_after": 2,
        "state_from": f"checkpoint of step {step}" if step else "nothing (from the start)",
    }


def _read(path: str, event: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [r for line in f if line.strip() and (r := json.loads(line)).get("event") == event]


def _remove(cluster, node_id: str, replacement: bool = True) -> float:
    killed = time.time()
    cluster.remove(node_id)
    if replacement:
        cluster.add(3, wait=False)  # a replacement joins, as an autoscaler would bring one
    return killed


def measure(opts) -> dict:
    from benchmarks.recovery import AFFECTED, checkpoint_cost, in_run_text

    root = tempfile.mkdtemp(prefix="raymp-bench-elastic-")
    cluster = SimulatedCluster(head_cpus=1)
    cluster.resize(2, 3)
    runs = {**{row: [] for row in RAYMP_MODES}, "Ray Train": []}
    try:
        cfg = run_config("elastic", f"{root}/runs", dp=2, zero=0, steps=STEPS, cpus_per_actor=1.5)
        batches, vocab = global_batches(cfg)
        for rep in range(opts.reps):
            for row, mode in RAYMP_MODES.items():
                cluster.resize(mode.nodes, mode.cpus)
                runs[row].append(_raymp_recovery(cluster, root, rep, row))
            cluster.resize(2, 3)
            runs["Ray Train"].append(_ray_train_recovery(cluster, root, rep, cfg, batches, vocab))
            cluster.resize(2, 3)
        cost = checkpoint_cost(root, "small", 3 * opts.steps, 5, opts.reps)
    finally:
        cluster.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    reference = runs["raymp restart"][0]["losses"]
    peer = median([r["to_next_step_s"] for r in runs["Ray Train"]])
    rows = []
    for name, rs in runs.items():
        nxt = [r["to_next_step_s"] for r in rs]
        gap = max(abs(a - b) / b for r in rs for a, b in zip(r["losses"], reference))
        ratio = peer / median(nxt)
        rows.append(
            [
                name,
                f"{median(nxt):.1f}",
                spread(nxt),
                f"{median([r['resume_s'] for r in rs]):.1f}",
                str(median([r["redone"] for r in rs])),
                f"{median([r['read_bytes'] for r in rs]) / 2**20:.1f}",
                " / ".join(dict.fromkeys(r["state_from"] for r in rs)),
                str(rs[0]["dp_after"]),
                f"{gap:.1e}",
                (
                    ""  # the peer itself; a stopped rank is another fault than the peer's node loss
                    if name in ("Ray Train", STOPPED, PP_RESTART, PP_SPARE)
                    else f"{ratio:.2f}x ({'raymp faster' if ratio > 1 else 'raymp slower'})"
                ),
            ]
        )
    cost_rows = [
        [
            c["mode"],
            f"{c['step_s'] * 1e3:.0f}",
            f"{c['ratio']:.2f}x",
            in_run_text(c),
            "-" if c["stall_s"] is None else f"{c['stall_s'] * 1e3:.0f}",
            f"{c['blocked_s'] * 1e3:.0f}" if c["size_mb"] else "-",
            f"{c['size_mb']:.1f}" if c["size_mb"] else "-",
        ]
        for c in cost
    ]
    return {
        "title": "5. Elasticity: recovery after node loss, and checkpoint cost",
        "setup": (
            f"Simulated cluster (head: 1 CPU for the driver; two worker nodes of 3 CPUs). dp=2 DDP, "
            f"model `small`, global batch 16, seq_len 128, {STEPS} steps, a checkpoint every {EVERY} "
            f"steps; both ranks (1.5 CPU each) sit on one node, which is removed when step "
            f"{KILL_AFTER} is done; a replacement node is added at once. raymp restart: its elastic restart "
            "(async DCP checkpoints). raymp peer-memory restore: the same, with `elastic.peer_copy_every: 1`, "
            "so each rank's part of the state is also in the object store of the other node, and the restart "
            "loads that. raymp keep_survivors: `elastic.keep_survivors` on two 2-CPU nodes, one rank each; "
            "the node of rank 0 is removed and rank 1 goes on alone with its state in memory (grow_back off, "
            "so the row is the recovery alone); its second row adds no replacement node. raymp keep_survivors + "
            "warm spare: the same on three 2-CPU nodes, the third holding a spare actor (`elastic.spares: 1`) "
            "that joins from rank 1's memory, so the next step runs at dp=2; no replacement node. raymp, rank 0 "
            "stopped: the restart's cluster, no node lost: rank 0's process is stopped (SIGSTOP) when step "
            f"{KILL_AFTER} is done, with the elastic section at its defaults. raymp dp2 x pp2 ZeRO-1: four "
            "ranks, one per 2-CPU node, and a fifth node; the node of rank 3 (stage 1 of replica 1, whose part "
            "of the optimizer state no other rank holds) is removed when step "
            f"{KILL_AFTER} is done, no replacement node: restarted from storage (at dp=2, on the nodes left), or "
            "with `elastic.peer_copy_every: 1` and `elastic.spares: 1` (the spare on the fifth node) the three "
            "survivors and the spare reload the peer copy at dp=2. Ray Train: "
            "`FailureConfig(max_failures=1)`, the loop resumes "
            f"from `ray.train.get_checkpoint()` (rank 0 saves a torch state dict). {opts.reps} runs each, "
            "alternating."
        ),
        "columns": [
            "run",
            "node lost -> next step (s)",
            "runs (s)",
            "node lost -> resumed (s)",
            "steps redone",
            "read from storage per rank (MiB)",
            "state from",
            "dp after",
            "max loss gap vs raymp",
            "raymp vs peer",
        ],
        "rows": rows,
        "extra_tables": [
            {
                "caption": (
                    f"raymp checkpoint cost (dp=2 ZeRO-2, model `small`, {3 * opts.steps} steps, a save every "
                    f"5 steps, median of {opts.reps} interleaved rounds; time per step includes the saves)"
                ),
                "columns": [
                    "checkpoints",
                    "time per step (ms)",
                    "vs none",
                    "in-run cost per step",
                    "loop stall per save (ms)",
                    "ranks blocked per save (ms)",
                    "one checkpoint (MiB)",
                ],
                "rows": cost_rows,
            }
        ],
        "raw": {"recovery": runs, "checkpoint_cost": cost},
        "notes": [
            "\"node lost -> next step\" is the time from `remove_node` to the first training step completed "
            "after it; \"resumed\" is when training state was restored (raymp: its restart done; Ray Train: "
            "the loop's checkpoint load done; with a warm spare: its join done). keep_survivors' next step runs "
            "at dp=1 on one actor, with a warm spare at dp=2. The dp2 x pp2 rows train the same model and batch "
            "(their loss gap is against the dp=2 DDP restart) on four ranks, so their steps take longer; they "
            "compare with each other, not with Ray Train's DDP. In the stopped-rank row \"node lost\" is the "
            "SIGSTOP; nothing tells raymp the rank is gone, so the step waits out the automatic step deadline "
            "(`elastic.hang_factor` x the slowest step so far, at least `elastic.hang_floor_s`, 60 s by default), "
            "then restarts.",
            "The replacement node (3 CPUs) starts on the same two cores as the run: its raylet and the idle "
            "workers Ray starts on it compete with the recovery, which a real cluster's new machine would not. "
            "keep_survivors does not need it (grow_back off), so its second row leaves it out: that row is "
            "raymp's own recovery path. Without a replacement node the lost rank's bundle has no room, and "
            "Ray's GCS retries placing it on every scheduler pass (ray-project/ray#65970), one of the two "
            "cores busy until the run ends: the steps after the loss in those rows (and the warm spare's "
            "\"next step\") run slower than before it (docs/design.md, warm spares).",
            "\"read from storage per rank\" is the size of the checkpoint the restart loaded: under DDP "
            "each rank reads all of it, on both sides. The peer-copy row of the cost table keeps no checkpoint "
            "on storage; its copies (two of each rank's part) are in the object store. A peer copy's \"blocked\" is "
            "the ranks staging their parts in host memory; DCP writes them and the ranks hand them to the object "
            "store (and on to the other node) in the background while the next step runs, which is what the rest "
            "of its cost is. The simulated nodes have 1 GiB object stores (cluster_utils' 150 MiB spilled the copies).",
            "Ray Train registers a reported checkpoint when its controller next polls the workers (every "
            "`RAY_TRAIN_HEALTH_CHECK_INTERVAL_S`, 2 s by default): a node lost before that restarts from the "
            "checkpoint before, or from the start; \"state from\" lists what each run restored.",
            "The loss column compares every step (the redone steps' second pass) with raymp's run, so both "
            "resumed to the same state.",
            "\"vs none\" compares whole runs, and the runs of one mode differ from round to round by a few "
            "percent on this shared machine. \"loop stall per save\" is what a save costs the step loop inside its "
            f"own run: what the interval of the step before it and the {AFFECTED} after took beyond the run's "
            "median interval away from saves (median of the rounds; benchmarks/recovery.py); \"in-run cost per "
            "step\" is that spread over the steps between saves. It cannot see a cost spread evenly over every "
            "step; \"vs none\" can, within its noise. \"ranks blocked\" is the longest a rank's step call was held "
            "by the save's staging: a save rides on the call of the step before it (the next step is queued behind "
            "it), unless the save before was not yet reported done when that step was queued; then it is a call "
            "of its own between the two steps.",
        ],
    }
