"""Run by system/test_fault_matrix_cluster.py in its own process (a simulated cluster needs a Ray of its
own): node-loss scenarios, one after another on one cluster whose worker nodes are set up anew
for each. Nodes are removed and added on the main thread (cluster_utils wants that), so training
runs in a background thread, and every fault waits on an event of the run (a step done, a save in
flight, a group placed), never on a clock. Each scenario's result goes to OUT as one JSON line
when it ends; a scenario past its bound is recorded as hung and ends the probe.

    python -m helpers.fault_cluster_probe DATA_CACHE OUT [SCENARIO ...]    (in tests/)
    python -m helpers.fault_cluster_probe --driver CONFIG_JSON HISTORY_JSONL   (one driver, for SIGKILL)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import ray

from raymp import Trainer
from raymp.runtime.simulated_cluster import SimulatedCluster
from raymp.runtime.worker import Worker

from helpers import faults
from helpers.faults import MOE_MODEL, Hung, matrix_cfg

TESTS = Path(__file__).resolve().parents[1]  # the probe runs as `python -m helpers.fault_cluster_probe` there

BOUND_S = 240  # per scenario: past this it counts as hung


class SlowWriteWorker(Worker):
    """The writes of step 4's checkpoint and later ones wait until <output_dir>/release-writes
    exists: a save stays in flight on demand. Defined in the probe's __main__, so Ray ships the
    class by value."""

    def setup(self, cfg, vocab_size: int, *args):
        info = super().setup(cfg, vocab_size, *args)
        make_writer = self.checkpointer.writer_factory
        release = cfg.output_dir + "/release-writes"

        def writer_factory(path: str):
            writer = make_writer(path)
            write_data = writer.write_data

            def slow(plan, planner):
                if int(path.rstrip("/").rsplit("-", 1)[-1]) >= 4:
                    faults.wait_until(lambda: os.path.exists(release), f"{release} (the writes' release)",
                                      BOUND_S)
                return write_data(plan, planner)

            writer.write_data = slow
            return writer

        if not getattr(self.checkpointer, "_slowed", False):
            self.checkpointer.writer_factory = writer_factory
            self.checkpointer._slowed = True
        return info


class HoldStepWorker(Worker):
    """The rank that finds <output_dir>/hold-<step>-<rank> stops at the start of that step and
    stays there until it is killed with its node, after renaming the file to held-<step>-<rank>:
    the node is then lost while every peer is inside that step, waiting on it, however fast the
    machine is (lost at a random moment, it can land after the step's commit vote, when the
    survivors have taken the step and go on after it rather than from it). One-shot: the rank of
    that number after the loss runs the step. Shipped by value, like SlowWriteWorker."""

    def setup(self, cfg, vocab_size: int, *args):
        self._hold_dir = cfg.output_dir
        return super().setup(cfg, vocab_size, *args)

    def train_step(self, step: int, save=None):
        hold = Path(self._hold_dir, f"hold-{step}-{self.rank}")
        try:
            hold.rename(hold.with_name(f"held-{step}-{self.rank}"))
        except FileNotFoundError:
            return super().train_step(step, save)
        while True:  # until the node goes, and this process with it
            time.sleep(0.05)


class Probe(SimulatedCluster):
    """The simulated cluster every scenario runs on (a 1-CPU head for the driver and its data)."""

    def __init__(self, cache: str):
        super().__init__(head_cpus=1)
        self.cache = cache

    def reset(self, count: int, cpus: int) -> None:
        """`count` worker nodes of `cpus` CPUs: nodes of the last scenario that fit are kept."""
        self.resize(count, cpus)
        wait_until(lambda: ray.available_resources().get("CPU", 0) >= count * cpus + 1, "the cluster's CPUs")


def wait_until(predicate, what: str) -> None:
    faults.wait_until(predicate, what, BOUND_S)


def cfg_for(root: str, cache: str, **sections) -> dict:
    """1.5 CPUs per actor: one actor per 2-CPU node. Blocking saves, so the checkpoint of step 2
    is committed with step 3's results (the mid-write scenario makes its own save slow)."""
    # The defaults a user has (wait_for_resources_s=30): a shrink must not wait for it.
    sections["elastic"] = {"wait_for_resources_s": 30, "poll_s": 0.1, "max_restarts": 3,
                           **sections.get("elastic", {})}
    sections["resources"] = {"cpus_per_actor": 1.5, **sections.get("resources", {})}
    sections["checkpoint"] = {"async_save": False, **sections.get("checkpoint", {})}
    return matrix_cfg(Path(root), cache, **sections)


def steps_done(n: int, committed: int | None = None):
    """A hold (see Run) after `n` steps, once the checkpoint of step `committed` is committed too."""
    return lambda trainer, done: done >= n and (
        committed is None or any(c.step == committed for c in trainer.checkpoints.committed))


class Run:
    """A Trainer fitting in a background thread. `holds`: predicates of (trainer, steps done),
    taken in order: after the first step for which the next one is true, the training thread
    waits (between two steps, bounded by BOUND_S) until release(). A node removed while it is
    held meets the next step: one removed while the run went on once came after its last step."""

    def __init__(self, cfg: dict, on_event=None, holds=(), **kwargs):
        self.trainer = Trainer(cfg, progress=False, **kwargs)
        self.holds = list(holds)
        self.held, self.go = threading.Event(), threading.Event()

        def hook(name, info):
            if on_event is not None:
                on_event(name, info)
            if name == "step" and self.holds and self.holds[0](self.trainer, info["done"]):
                self.holds.pop(0)
                self.go.clear()
                self.held.set()
                self.go.wait(BOUND_S)

        self.trainer.on_event = hook
        self.trainer.setup()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._fit, daemon=True)
        self.thread.start()

    def _fit(self):
        try:
            self.trainer.fit()
        except BaseException as exc:  # reported in the result
            self.error = exc

    def after_steps(self, n: int, committed: int | None = None) -> None:
        """Once `n` steps are done (and, if given, the checkpoint of step `committed` is)."""
        def ready():
            steps = len(self.trainer.history) >= n
            saved = committed is None or any(c.step == committed for c in self.trainer.checkpoints.committed)
            return (steps and saved) or not self.thread.is_alive()

        wait_until(ready, f"{n} steps" + (f" and the checkpoint of step {committed}" if committed else ""))

    def when_held(self, what: str) -> None:
        """Once the run is held (see `holds`), or has ended."""
        wait_until(lambda: self.held.is_set() or not self.thread.is_alive(), what + ", the run held")

    def release(self) -> None:
        self.held.clear()
        self.go.set()

    def node_of_rank(self, rank: int) -> str:
        return self.trainer.group.nodes[rank]["node_id"]

    def finish(self) -> dict:
        self.thread.join(BOUND_S)
        if self.thread.is_alive():
            raise Hung("the run did not finish")
        t = self.trainer
        out = {
            "history": [
                {
                    "step": m["step"],
                    "loss": m["loss"],
                    "dp": m["dp"],
                    "finished_at": m["finished_at"],
                    "sample_ids": m["sample_ids"].tolist(),
                }
                for m in t.history
            ],
            "restarts": t.restarts,
            "failures": t.failures,
            "pids_after": [n["pid"] for n in t.group.nodes] if t.group else None,
            "error": None if self.error is None else f"{type(self.error).__name__}: {self.error}",
        }
        t.close()
        return out


# -- scenarios --------------------------------------------------------------------------------


def node_loss(probe, root, zero=0, dp=2, nodes=2, cpus=2, after=3, rank=1, committed=2, **sections):
    """The node of `rank` is lost once `after` steps are done (and the checkpoint of step
    `committed` is), while that rank holds step `after` (HoldStepWorker)."""
    probe.reset(nodes, cpus)
    parallel = {"dp": dp, "zero": zero, **sections.pop("parallel", {})}
    cfg = cfg_for(root, probe.cache, parallel=parallel, **sections)
    hold = Path(cfg["output_dir"], f"hold-{after}-{rank}")  # rank `rank` stops at step `after`
    hold.parent.mkdir(parents=True, exist_ok=True)
    hold.touch()
    run = Run(cfg, worker_cls=HoldStepWorker)
    run.after_steps(after, committed)
    wait_until(lambda: hold.with_name(f"held-{after}-{rank}").exists() or not run.thread.is_alive(),
               f"rank {rank} inside step {after}")
    pids = [n["pid"] for n in run.trainer.group.nodes]
    spares = run.trainer.group.spares  # elastic.spares: started before the loss
    if spares:
        wait_until(lambda: spares.ready() == spares.count, "the warm spares started")
    spare_pids = spares.pids() if spares else []
    copies = run.trainer.session.peer_copies
    if copies.every:  # elastic.peer_copy_every: the loss meets the copy of step `after` whole on its nodes
        wait_until(lambda: _newest_copy_whole(copies, after) or not run.thread.is_alive(),
                   f"the peer copy of step {after} on its nodes")
    lost_at = time.time()
    probe.remove(run.node_of_rank(rank))
    result = run.finish()
    # Node lost -> the next step completed (the benchmark-style number the README quotes).
    after_loss = [m["finished_at"] for m in run.trainer.history if m["finished_at"] > lost_at]
    return {
        **result,
        "lost_to_next_step_s": after_loss[0] - lost_at if after_loss else None,
        "pids_before": pids,
        "spare_pids": spare_pids,
    }


SCENARIOS = {
    "node loss mid-run, dp2 -> dp1, zero 0": lambda p, r: node_loss(p, r, zero=0),
    "node loss mid-run, dp2 -> dp1, zero 2": lambda p, r: node_loss(p, r, zero=2),
    "node loss mid-run, dp2 -> dp1, zero 3": lambda p, r: node_loss(p, r, zero=3),
    "node loss, dp4 -> dp3, global batch kept": lambda p, r: node_loss(
        p, r, zero=2, dp=4, nodes=4, rank=3, parallel={"micro_batch_size": 1}, train={"global_batch_size": 12}
    ),
    "node loss, dp2 x pp2 -> dp1 x pp2": lambda p, r: node_loss(
        p, r, zero=1, nodes=2, cpus=4, rank=0, parallel={"pp": 2, "schedule": "1f1b"}
    ),
    "node loss, dp2 x pp2 x tp2 -> dp1 x pp2 x tp2": lambda p, r: node_loss(
        p, r, zero=0, nodes=2, cpus=7, rank=0, parallel={"pp": 2, "tp": 2, "micro_batch_size": 1}
    ),
    "node loss, survivors keep their state, dp2 -> dp1": lambda p, r: node_loss(
        p, r, parallel={"micro_batch_size": 1}, elastic={"keep_survivors": True}
    ),
    "node loss of the rendezvous rank, survivors keep their state, dp4 -> dp2": lambda p, r: node_loss(
        p, r, dp=4, nodes=4, rank=0, parallel={"micro_batch_size": 1}, elastic={"keep_survivors": True}
    ),
    # One rank per node (2 CPUs, 1.5 per actor): the lost node takes rank 0, its group's other rank is let go, and the
    # other HSDP group (two ZeRO-3 shards on two more nodes) goes on with what it holds.
    "node loss of an HSDP group's rank, survivors keep their state, 2x2 -> 1x2": lambda p, r: node_loss(
        p,
        r,
        zero=3,
        dp=4,
        nodes=4,
        rank=0,
        parallel={"micro_batch_size": 1, "dp_replicate": 2},
        elastic={"keep_survivors": True},
    ),
    # One whole pipeline (1.5 CPUs per actor: two ranks per 4-CPU node) or one whole pipeline of TP
    # pairs (four per 7-CPU node) per node: the lost node takes replica 0, replica 1 goes on.
    "node loss, survivors keep their state, dp2 x pp2 -> dp1 x pp2": lambda p, r: node_loss(
        p,
        r,
        nodes=2,
        cpus=4,
        rank=0,
        parallel={"pp": 2, "schedule": "1f1b", "micro_batch_size": 1},
        elastic={"keep_survivors": True},
    ),
    "node loss, survivors keep their state, dp2 x pp2 x tp2 -> dp1 x pp2 x tp2": lambda p, r: node_loss(
        p,
        r,
        nodes=2,
        cpus=7,
        rank=0,
        parallel={"pp": 2, "tp": 2, "micro_batch_size": 1},
        elastic={"keep_survivors": True},
    ),
    # One rank per 2-CPU node and a fifth node for the spare: the lost node takes rank 3 (stage 1 of
    # replica 1), whose part of the ZeRO-1 optimizer state is only in its peer copies.
    "node loss of a pipeline stage, dp2 x pp2 ZeRO-1, a warm spare reloads it from the peer copy": (
        lambda p, r: node_loss(p, r, zero=1, nodes=5, rank=3,
                               parallel={"pp": 2, "schedule": "1f1b", "micro_batch_size": 1},
                               elastic={"keep_survivors": True, "peer_copy_every": 1, "spares": 1})),
    # Expert parallelism can not outlive its ep group (the ep ranks hold one copy of the experts
    # between them): the restart at dp1 re-plans ep to 1 and reshards the experts from storage.
    "node loss, MoE dp2 x ep2 -> dp1 x ep1, experts resharded": lambda p, r: node_loss(
        p, r, parallel={"ep": 2, "micro_batch_size": 1}, model=MOE_MODEL
    ),
    "node loss before the first checkpoint": lambda p, r: node_loss(
        p, r, after=1, committed=None, checkpoint={"every": 4}
    ),
}


def scenario(name):
    def register(fn):
        SCENARIOS[name] = fn
        return fn
    return register


@scenario("node loss mid-async-write (slow storage)")
def _mid_write(probe, root):
    probe.reset(2, 2)
    run = Run(cfg_for(root, probe.cache, checkpoint={"async_save": True}), worker_cls=SlowWriteWorker)
    Path(root, "runs").mkdir(parents=True, exist_ok=True)
    pending = lambda: run.trainer.checkpoints.pending  # noqa: E731
    wait_until(lambda: pending() is not None and pending().step == 4, "the save of step 4 in flight")
    probe.remove(run.node_of_rank(1))
    wait_until(lambda: run.trainer.restarts or not run.thread.is_alive(), "the restart")
    Path(root, "runs", "release-writes").touch()  # storage answers again
    return run.finish()


@scenario("two node losses in a row")
def _two_losses(probe, root):
    probe.reset(3, 2)
    run = Run(cfg_for(root, probe.cache), holds=[steps_done(2), lambda trainer, _: bool(trainer.restarts)])
    run.when_held("2 steps done")
    probe.remove(run.node_of_rank(1))
    run.release()
    run.when_held("a step done after the first restart")
    probe.remove(run.node_of_rank(0))
    run.release()
    return run.finish()


def _loss_mid_restart(probe, root, bundle: int):
    """A node lost after step 3; while the restart's new group is placed (before its actors
    start), the node holding bundle `bundle` of it is lost too."""
    probe.reset(3, 2)
    placed, go = threading.Event(), threading.Event()
    where: dict = {}

    def on_event(name, info):
        if name == "placed" and where.get("armed") and not placed.is_set():
            where["nodes"] = info["bundle_nodes"]
            placed.set()
            go.wait(BOUND_S)

    # The group sees its placement group being re-placed and gives up at once (no timeout involved).
    run = Run(cfg_for(root, probe.cache), on_event=on_event, holds=[steps_done(3, committed=2)])
    run.when_held("3 steps and the checkpoint of step 2")
    where["armed"] = True
    probe.remove(run.node_of_rank(1))
    run.release()
    wait_until(placed.is_set, "the restart's placement")
    probe.remove(where["nodes"][bundle])
    go.set()
    return run.finish()


SCENARIOS["node loss mid-restart, on the node of the first bundle"] = lambda p, r: _loss_mid_restart(p, r, 0)
SCENARIOS["node loss mid-restart, on the node of another bundle"] = lambda p, r: _loss_mid_restart(p, r, 1)


@scenario("node loss, then the node returns: grow back")
def _grow_back(probe, root):
    """The node returns while the restart's group is placed, so it is there by the next save."""
    probe.reset(2, 2)
    placed = threading.Event()
    armed: dict = {}

    def on_event(name, info):
        if name == "placed" and armed and not placed.is_set():
            placed.set()
            armed["go"].wait(BOUND_S)

    tracking = {"enabled": True, "tracking_uri": f"sqlite:///{root}/mlflow.db"}
    run = Run(cfg_for(root, probe.cache, tracking=tracking), on_event=on_event, holds=[steps_done(2)])
    run.when_held("2 steps done")
    armed["go"] = threading.Event()
    probe.remove(run.node_of_rank(1))
    run.release()
    wait_until(placed.is_set, "the restart's placement")
    probe.add(2)
    armed["go"].set()
    run_id, uri = run.trainer.tracker.run_id, run.trainer.tracker.uri
    result = run.finish()
    return {**result, "mlflow": mlflow_record(uri, run_id)}


@scenario(
    "node loss, survivors keep their state, the node returns and joins from a live peer, dp2 -> dp1 -> dp2"
)
def _join_back(probe, root):
    """The run waits (on_event, after a step) until the node is back and Ray has placed the lost
    bundle there again; the next step starts with the join."""
    probe.reset(2, 2)
    back, state = threading.Event(), {}

    def on_event(name, info):
        t = state["run"].trainer if name == "step" else None
        if t is not None and t.restarts and not back.is_set():
            back.wait(BOUND_S)
            wait_until(lambda: len(t.restarts) > 1 or t.group.joinable() > 0, "the lost bundle placed again")

    run = state["run"] = Run(cfg_for(root, probe.cache, parallel={"zero": 0, "micro_batch_size": 1},
                                     elastic={"keep_survivors": True}), on_event=on_event,
                              holds=[steps_done(3, committed=2)])
    run.when_held("3 steps and the checkpoint of step 2")
    pids = [n["pid"] for n in run.trainer.group.nodes]
    probe.remove(run.node_of_rank(1))
    run.release()
    wait_until(lambda: run.trainer.restarts or not run.thread.is_alive(), "the survivors going on")
    probe.add(2)
    back.set()
    return {**run.finish(), "pids_before": pids}


@scenario(
    "node loss with a spare node, survivors keep their state, a replacement joins from a live peer, dp2"
)
def _replacement(probe, root):
    """Three nodes for two ranks: Ray re-places the lost rank's bundle on the spare node at once,
    and the missing replica starts there (from the survivor's memory) before a next step."""
    return node_loss(probe, root, nodes=3, parallel={"micro_batch_size": 1}, elastic={"keep_survivors": True})


@scenario("node loss with a warm spare on a third node, the spare joins from a live peer, dp2")
def _warm_spare(probe, root):
    """Three nodes: two ranks and a spare (elastic.spares=1). The lost rank's bundle has no room
    to be re-placed (its placement group waits, RESCHEDULING); the spare, in a placement group of
    its own, joins from the survivor's memory in the survivor's recovery."""
    return node_loss(probe, root, nodes=3, parallel={"micro_batch_size": 1},
                     elastic={"keep_survivors": True, "spares": 1})


@scenario("node loss, ZeRO-3 dp2 -> dp1 from the peer copy on the other node, nothing on storage")
def _peer_copy(probe, root):
    """One rank per 2-CPU node: rank 1's own part goes with its node, the copy of it on rank 0's
    node is what the dp=1 restart loads."""
    return _node_loss_after_a_whole_peer_copy(probe, root, 2, {"dp": 2, "zero": 3}, rank=1)


def _newest_copy_whole(copies, step: int | None = None) -> bool:
    """Whether the newest peer copy (of `step`, if given) is in the object store on its nodes:
    a loss now finds it whole, however busy the machine was while it was handed over."""
    newest = copies.kept[-1] if copies.kept else None
    if newest is None or (step is not None and newest.step != step):
        return False
    kept = newest.copies
    if not kept:
        return False
    ready, _ = ray.wait(kept, num_returns=len(kept), timeout=0, fetch_local=False)
    return len(ready) == len(kept)


def _node_loss_after_a_whole_peer_copy(probe, root, cpus: int, parallel: dict, rank: int, **sections) -> dict:
    """No checkpoint on storage before the end; a peer copy every 2 steps. The run is held after
    step 3 (on its training thread, between two steps) while the copy of step 2 becomes whole on
    both its nodes (an event, not a clock) and the node of `rank` is lost; step 4 meets the loss.
    Not held, the run once finished its 8 steps before the copy was seen whole, and the node was
    lost after the end."""
    probe.reset(2, cpus)
    run = Run(cfg_for(root, probe.cache, parallel=parallel, checkpoint={"every": 100},
                      elastic={"peer_copy_every": 2}, **sections), holds=[steps_done(3)])
    run.when_held("3 steps done")
    copies = run.trainer.session.peer_copies
    wait_until(lambda: _newest_copy_whole(copies) or not run.thread.is_alive(),
               "a peer copy on both its nodes")
    placed = {"nodes": [n["node_id"] for n in run.trainer.group.nodes],
              "copy_nodes": copies.kept[-1].copy_nodes, "step": copies.kept[-1].step}
    probe.remove(run.node_of_rank(rank))
    run.release()
    return {**run.finish(), "copy": placed}


def mlflow_record(uri: str, run_id: str) -> dict:
    """What the MLflow run shows: its status and tags, every logged loss step, the events."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    run = client.get_run(run_id)
    return {"status": run.info.status, "tags": run.data.tags,
            "loss_steps": sorted(m.step for m in client.get_metric_history(run_id, "fit/loss")),
            "elastic_dp": [m.value for m in client.get_metric_history(run_id, "restart/dp")],
            "events": sorted(a.path for a in client.list_artifacts(run_id, "events"))}


@scenario("node loss, MoE dp2 x ep2 -> dp1 x ep1 from the peer copies, experts resharded")
def _peer_copy_expert_parallel(probe, root):
    """One rank per 2-CPU node: half of the experts lived only on the lost node and in its peer
    copy on the other; the dp=1 restart (ep re-planned to 1) gathers every expert from the copies."""
    return _node_loss_after_a_whole_peer_copy(probe, root, 2, {"dp": 2, "ep": 2, "micro_batch_size": 1}, rank=1,
                                              model=MOE_MODEL)


@scenario("node loss of the node holding every rank, dp2 restarts from the peer copy on another node")
def _peer_copy_one_node(probe, root):
    """Both ranks on one 3-CPU node of two: the copies go to the other node of the cluster, so
    the loss of the ranks' node still leaves them (the second copy once went to the group's own
    node here, and the restart read the checkpoint)."""
    return _node_loss_after_a_whole_peer_copy(probe, root, 3, {"micro_batch_size": 1}, rank=0)


@scenario("no room for one replica: the wait times out and names its knob")
def _no_room(probe, root):
    probe.reset(1, 2)
    run = Run(cfg_for(root, probe.cache, parallel={"dp": 1}, elastic={"wait_for_resources_s": 2}),
              holds=[steps_done(2)])
    run.when_held("2 steps done")
    for node in list(probe.nodes):
        probe.remove(node.node_id)
    run.release()
    return run.finish()


@scenario("driver killed with SIGKILL, the command run again")
def _driver_killed(probe, root):
    probe.reset(2, 2)
    cfg = cfg_for(root, probe.cache)
    cfg_path, history = Path(root, "cfg.json"), Path(root, "history.jsonl")
    cfg_path.write_text(json.dumps(cfg))
    env = {**os.environ, "RAY_ADDRESS": probe.address}
    cmd = [sys.executable, "-m", "helpers.fault_cluster_probe", "--driver", str(cfg_path), str(history)]
    first = subprocess.Popen(cmd, cwd=TESTS, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    committed = Path(cfg["checkpoint"]["dir"], "step-00000004", "raymp.json")
    wait_until(lambda: committed.exists() or first.poll() is not None, "the checkpoint of step 4")
    first.send_signal(signal.SIGKILL)
    first.wait()
    second = subprocess.run(cmd, cwd=TESTS, env=env, capture_output=True, text=True, timeout=BOUND_S)
    lines = [json.loads(line) for line in history.read_text().splitlines()]
    final = {}
    for m in lines:  # the rerun's steps replace the killed driver's
        final[m["step"]] = m
    return {"history": [final[s] for s in sorted(final)], "restarts": [], "failures": [],
            "resumed_step": next((m["step"] for m in lines if m.get("driver") == 2), None),
            "error": None if second.returncode == 0 else second.stderr[-2000:]}


def driver(cfg_path: str, history_path: str) -> None:
    """One driver of a run: appends each step to HISTORY as it finishes."""
    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    cfg = json.loads(Path(cfg_path).read_text())
    attempt = 2 if Path(history_path).exists() else 1
    with Trainer(cfg, progress=False) as trainer, open(history_path, "a") as out:
        trainer.setup()
        while trainer.global_step < cfg["train"]["steps"]:
            m = trainer.step()
            out.write(json.dumps({"step": m["step"], "loss": m["loss"], "driver": attempt,
                                  "sample_ids": m["sample_ids"].tolist()}) + "\n")
            out.flush()


def main() -> None:
    if sys.argv[1] == "--driver":
        driver(sys.argv[2], sys.argv[3])
        return
    cache, out_path, names = sys.argv[1], sys.argv[2], sys.argv[3:] or list(SCENARIOS)
    probe = Probe(cache)
    with open(out_path, "a") as out:
        for name in names:
            root = tempfile.mkdtemp(prefix="scenario-", dir=os.path.dirname(os.path.abspath(out_path)))
            t0 = time.monotonic()
            try:
                result = SCENARIOS[name](probe, root)
            except Hung as exc:
                result = {"error": f"hung: {exc}", "hung": True}
            except Exception as exc:
                import traceback

                result = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"}
            result.update(name=name, elapsed_s=time.monotonic() - t0)
            out.write(json.dumps(result, default=str) + "\n")
            out.flush()
            if result.get("error") is None:
                shutil.rmtree(root, ignore_errors=True)  # its checkpoints: only a failure's are kept
            if result.get("hung"):
                os._exit(3)  # a thread is stuck: the scenarios after it cannot share this cluster
    probe.shutdown()


if __name__ == "__main__":
    main()
