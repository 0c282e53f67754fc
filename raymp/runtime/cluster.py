"""What the cluster this run connected to (raymp.ray_connection) offers it: CPUs for a local
instance, GPUs for the device, memory for the model."""

from __future__ import annotations

import os

import ray

from raymp.config import CPU_OFFLOAD_ON_CPU, ConfigError
from raymp.ray_connection import starts_local


def check_local_cpus(address: str | None, cpus_per_actor: float) -> None:
    """On a local instance an actor cannot use more CPUs than the machine has (each runs
    `cpus_per_actor` torch threads): asking for more is refused, not oversubscribed silently.
    (A cluster's nodes are checked by placement.)"""
    if starts_local(address) and cpus_per_actor > (os.cpu_count() or 1):
        raise ConfigError(f"resources.cpus_per_actor={cpus_per_actor:g} is more than this machine's "
                          f"{os.cpu_count()} CPUs (each actor runs that many threads); set it to at most "
                          f"{os.cpu_count()}, or give resources.address of a cluster with larger nodes")


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
    return (
        f"the model does not fit in memory: the planner estimates {one / gib:,.1f} GiB per rank (model "
        f"state, activations, buffers; {everything / gib:,.1f} GiB for all {len(rank_bytes)} ranks), but the "
        f"largest node has {max(sizes) / gib:,.1f} GiB and the cluster {sum(sizes) / gib:,.1f} GiB; shard "
        "it over more actors (parallel.zero=3, pp, tp), use a smaller model or parallel.micro_batch_size, "
        "or add nodes (`raymp plan` ranks layouts by memory)"
    )
