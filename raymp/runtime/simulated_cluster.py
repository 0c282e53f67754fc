"""A multi-node Ray cluster simulated on one machine (ray.cluster_utils.Cluster): the one harness
behind cluster/local_cluster.py (the elastic demo), the fault and placement tests and the
recovery benchmarks. cluster_utils wants nodes added and removed on the main thread: callers do
that, and let training threads wait on an event until it is done."""

from __future__ import annotations

import ray
from ray.cluster_utils import Cluster

# Object store per simulated node. cluster_utils gives each 150 MiB (so many fit on one machine);
# a real node's default is 30% of its memory. Measured (model `small`, dp=2, a peer copy every 5
# steps, two 3-CPU nodes): at 150 MiB the copies spilled to disk and cost 1.16x the step time.
OBJECT_STORE_BYTES = 1 << 30


class SimulatedCluster:
    def __init__(self, head_cpus: float):
        """A head of `head_cpus` CPUs (0: it runs no actor and no task), this process connected."""
        # No metrics export: measured on Ray 2.60, a few steps after a node is removed the GCS and
        # the head's dashboard agent (ingesting the GCS's metric histograms) took both cores of
        # this machine for minutes in 4 runs of 5 (steps 1.1 s -> 15-45 s); with metrics off, in
        # none of 5. docs/design.md, traps.
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": head_cpus, "object_store_memory": OBJECT_STORE_BYTES,
            "_system_config": {"enable_metrics_collection": False}})
        self.nodes: list = []  # worker nodes, oldest first
        ray.init(address=self.cluster.address, log_to_driver=False)

    @property
    def address(self) -> str:
        return self.cluster.address

    def add(self, cpus: float, gpus: int = 0, wait: bool = True):
        """A worker node (`gpus` fake GPUs, for placement); with `wait`, registered before this returns."""
        node = self.cluster.add_node(num_cpus=cpus, object_store_memory=OBJECT_STORE_BYTES,
                                     **({"num_gpus": gpus} if gpus else {}))
        node.num_cpus = cpus
        self.nodes.append(node)
        if wait:
            self.cluster.wait_for_nodes()
        return node

    def remove(self, node_or_id) -> None:
        """A worker node removed (by its node or its node id), as a lost machine."""
        node = next(n for n in self.nodes if n is node_or_id or n.node_id == node_or_id)
        self.nodes.remove(node)
        self.cluster.remove_node(node)

    def resize(self, count: int, cpus: float) -> None:
        """`count` worker nodes of `cpus` CPUs; nodes already there that fit are kept."""
        keep = [n for n in self.nodes if n.num_cpus == cpus][:count]
        for node in [n for n in self.nodes if n not in keep]:
            self.remove(node)
        for _ in range(count - len(keep)):
            self.add(cpus, wait=False)
        self.cluster.wait_for_nodes()

    def shutdown(self) -> None:
        ray.shutdown()
        self.cluster.shutdown()
