"""Connecting to Ray: the cluster this process runs in (ray job submit sets RAY_ADDRESS), an
explicit address, or a fresh local instance sized for the run."""

from __future__ import annotations

import os

import ray

from raymp.config import CPU_OFFLOAD_ON_CPU, ConfigError
from raymp.logs import RAY_LOCAL_START, quiet_loggers


def connect(address: str | None, min_cpus: float, cpus_per_actor: float = 1) -> None:
    """Join the cluster (ray.init), or start a local instance with `min_cpus` logical CPUs.
    On a local instance an actor cannot use more CPUs than the machine has (each runs
    `cpus_per_actor` torch threads): asking for more is refused, not oversubscribed silently."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    if cpus_per_actor > (os.cpu_count() or 1):
        raise ConfigError(f"resources.cpus_per_actor={cpus_per_actor:g} is more than this machine's "
                          f"{os.cpu_count()} CPUs (each actor runs that many threads); set it to at most "
                          f"{os.cpu_count()}, or give resources.address of a cluster with larger nodes")
    # A local instance: logical CPUs are oversubscribed if the run asks for more actors than
    # cores (each actor then runs 1 thread), so a 2-core laptop can still run dp=4.
    cpus = max(os.cpu_count() or 1, int(min_cpus + 0.999))
    # A Ray of its own, even while another instance runs on this machine (a plain ray.init()
    # would join that one, or refuse num_cpus).
    with quiet_loggers(*RAY_LOCAL_START):
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=True)


def resolve_device(requested: str, world_size: int, cpu_offload: bool = False) -> str:
    """'auto' -> cuda when the cluster has a GPU for every actor, else cpu (where optimizer
    state cannot be offloaded: it is in host memory already)."""
    gpus = ray.cluster_resources().get("GPU", 0)
    if requested == "cuda" and gpus < world_size:
        raise ConfigError(f"resources.device=cuda needs a GPU for each of the {world_size} actors, but the "
                          f"cluster has {gpus:g}; set resources.device=cpu (or auto), or add GPU nodes")
    if requested != "auto":
        return requested
    if gpus < world_size and cpu_offload:
        raise ConfigError(CPU_OFFLOAD_ON_CPU + " (resources.device=auto found no GPUs)")
    return "cuda" if gpus >= world_size else "cpu"


def host_memory_problem(rank_bytes: list[float]) -> str | None:
    """Ranks on CPU keep all their state in host memory. When the planner's per-rank estimate
    cannot fit even in the largest node, or all ranks in the whole cluster, setting up can only
    end in Ray's OOM kill a minute later: say so now. (A lower bound: placement is not known.)"""
    gib = 2**30
    nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    sizes = [r.get("memory", 0) + r.get("object_store_memory", 0) for r in nodes]
    one, everything = max(rank_bytes), sum(rank_bytes)
    if one <= max(sizes) and everything <= sum(sizes):
        return None
    return (f"the model does not fit in memory: the planner estimates {one / gib:,.1f} GiB per rank (model "
            f"state, activations, buffers; {everything / gib:,.1f} GiB for all {len(rank_bytes)} ranks), but the "
            f"largest node has {max(sizes) / gib:,.1f} GiB and the cluster {sum(sizes) / gib:,.1f} GiB; shard "
            "it over more actors (parallel.zero=3, pp, tp), use a smaller model or parallel.micro_batch_size, "
            "or add nodes (`raymp plan` ranks layouts by memory)")
