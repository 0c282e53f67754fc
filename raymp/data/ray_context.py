"""Where Ray Data tasks run and how they behave: the settings every process that builds or runs a
dataset needs, and keeping tasks on the node whose disk holds local files."""

from __future__ import annotations

import logging
import time

import ray

from raymp.data.corpus import DataError
from raymp.storage import is_uri


def on_node(node_id: str | None) -> dict:
    """Ray remote args that keep tasks on `node_id` (None: anywhere). A label selector on the
    node-id label Ray gives every node: read_binary_files takes it as a named parameter (its
    ray_remote_args, which a NodeAffinity strategy would need, is deprecated)."""
    return {} if node_id is None else {"label_selector": {"ray.io/node-id": node_id}}


def node_cpus(node_id: str) -> float:
    """The CPUs `node_id` gives Ray in all (0 for a node that is gone)."""
    return next((n["Resources"].get("CPU", 0) for n in ray.nodes() if n["NodeID"] == node_id), 0)


def free_cpus(node_id: str | None) -> float:
    """Free CPUs in the cluster; with a node, no more than that node has at all."""
    free = ray.available_resources().get("CPU", 0)
    return free if node_id is None else min(free, node_cpus(node_id))


def wait_for_free_cpu(node_id: str | None, wait_s: float, what: str) -> None:
    """Wait, at most `wait_s` (resources.placement_timeout_s), until a CPU is free for `what`'s
    Ray Data tasks (on `node_id`, or anywhere). Ray would queue them without a word, and a run
    whose actors hold every CPU (a shared cluster, an actor group made beforehand) hung forever."""
    deadline = time.monotonic() + wait_s
    while (free := free_cpus(node_id)) < 1:
        if time.monotonic() >= deadline:
            where = "the driver's node (the data is a local path there)" if node_id else "the cluster"
            waited = f" for {wait_s:g} s (resources.placement_timeout_s)" if wait_s else ""
            raise DataError(
                f"{what} needs 1 free CPU for its Ray Data tasks, but {where} had {free:g} free{waited}: "
                "free CPUs there (fewer actors or a lower resources.cpus_per_actor), add a node, or raise "
                "resources.placement_timeout_s")
        time.sleep(0.2)


def offers_no_cpu(node_id: str | None) -> bool:
    """Whether `node_id` gives Ray no CPU at all: a head started with --num-cpus=0, as the AWS, GCP
    and KubeRay configs start it to keep work off the head. Tasks that read a local path there
    still run there, reserving no CPU: the data is on that disk and nowhere else, and reading it
    is light next to training (they used to stay unschedulable, and the job failed)."""
    return node_id is not None and node_cpus(node_id) == 0


def local_node_if_local_path(root: str) -> str | None:
    """A plain path is on this (the driver's) node's disk: tasks that read it must run here. A
    URI (s3://, gs://, file:// on a shared mount, ...) is readable from every node."""
    if is_uri(root):
        return None

    return ray.get_runtime_context().get_node_id()


def ordered_context():
    """Ray Data settings raymp needs in every process that builds or runs a dataset: blocks in
    order (a Dataset keeps the context it was created under), and no progress bars of its own."""
    ctx = ray.data.DataContext.get_current()
    # Ray Data logs each execution's start/finish (and that its bars are off) from every actor;
    # raymp reports data wait itself. After the line above: importing ray.data sets its own level.
    logging.getLogger("ray.data").setLevel(logging.ERROR)
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    return ctx


def place_ray_data_services_here() -> None:
    """Ray Data runs three cluster-wide actors of its own (execution stats, its autoscaling
    coordinator, usage collection), detached and pinned to the node of the first process that
    runs a dataset. In raymp that process was a rank (its stream runs in it), so they sat on a
    rank's node: when that node was lost they started again beside the survivors' first step,
    a Python process each (~0.75 s of CPU), and that step took 2.7-3.4 s instead of 1.2 s
    (simulated cluster, model `small`, 2 runs of 4). One tiny dataset run here first (the
    driver, before any stream) puts them on the driver's node, which a run cannot lose and go on.
    Its one task asks for no CPU: a head node may offer none."""
    ordered_context()
    for _ in ray.data.from_items([0]).map_batches(_same, num_cpus=0, batch_format="numpy").iter_batches():
        pass


def _same(batch):
    return batch
