"""Re-planning after a loss: how many data-parallel replicas the cluster holds now, and the dp
to restart with. cp x pp x tp is kept (a replica's shape is what the model's memory needs); dp
shrinks to what fits (and ep, which borrows dp ranks, to what divides it), and the global batch
stays the same, each replica taking more micro-batches, so the loss curve goes on as if nothing
happened.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import ray

from raymp.config import RunConfig, derived
from raymp.config.rules import layout_problems, survivors_keep_state


class ElasticError(RuntimeError):
    """The run cannot go on: too many failures, or no room left for even one replica."""


@dataclass
class Capacity:
    """What the live nodes can hold, counted from their total resources (the lost group has been
    torn down, so the cluster is the run's again)."""

    replicas: int
    nodes: int
    detail: str


def capacity(cfg: RunConfig, device: str, reserve_node: str | None, reserve_cpus: float) -> Capacity:
    """Replicas of cp x pp x tp actors the live nodes can hold. A TP group must sit on one node;
    `reserve_cpus` stay free on `reserve_node` (the data streams' tasks) or on the largest node."""
    p, r = cfg.parallel, cfg.resources
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    groups, parts = 0, []
    reserve_on = reserve_node or max(nodes, key=lambda n: n["Resources"].get("CPU", 0), default={}).get(
        "NodeID"
    )
    for n in nodes:
        res = n["Resources"]
        cpus = res.get("CPU", 0) - (reserve_cpus if n["NodeID"] == reserve_on else 0)
        slots = int(cpus // r.cpus_per_actor) if cpus > 0 else 0
        if device == "cuda":
            slots = min(slots, int(res.get("GPU", 0)))
        groups += slots // p.tp
        parts.append(f"{n.get('NodeManagerAddress', '?')}: {slots} actor(s)")
    return Capacity(groups // (p.cp * p.pp), len(nodes), "; ".join(parts))


def largest_valid_dp(cfg: RunConfig, limit: int) -> int | None:
    """The largest dp <= limit the config accepts (the global batch must split into whole
    micro-batches per replica, and the schedule may need a minimum count of them)."""
    return _largest_valid(cfg, limit, with_dp, cfg.parallel.layout.settings_at_dp)


def largest_valid_replicas(cfg: RunConfig, limit: int) -> int | None:
    """The most whole copies of the state (Layout.state_replicas) <= limit that survivors can go
    on with: the layout with_replicas() makes must validate."""
    return _largest_valid(cfg, limit, with_replicas, cfg.parallel.layout.settings_keeping)


def _largest_valid(cfg: RunConfig, limit: int, build, settings) -> int | None:
    """The largest n <= limit whose config `build(cfg, n)` validates. Candidates are screened by
    the layout rules alone (`settings(n)`, the parallel settings build() changes): a whole
    config is built and validated once per candidate that passes them, not once per n."""
    for n in range(limit, 0, -1):
        if layout_problems(cfg, replace(cfg.parallel.layout, **settings(n))):
            continue
        try:
            build(cfg, n)
            return n
        except ValueError:
            continue
    return None


def with_dp(cfg: RunConfig, dp: int) -> RunConfig:
    """The run re-planned to `dp` replicas (Layout.settings_at_dp)."""
    settings = cfg.parallel.layout.settings_at_dp(dp)
    return derived(cfg, {f"parallel.{k}": v for k, v in settings.items()}, f"re-planned to dp={dp}")


def with_replicas(cfg: RunConfig, replicas: int) -> RunConfig:
    """The run with `replicas` of its whole copies of the state (Layout.settings_keeping): dp replicas
    under ZeRO-0, HSDP groups of the same shard size under ZeRO 2-3 (only runs that keep survivors
    get here). Where the survivors of a next loss would hold no state to go on from (one copy under
    ZeRO without peer copies: config.rules.survivors_keep_state), a keep_survivors set to true goes
    back to unset, which is off for that layout and on again once replicas join."""
    changes = {f"parallel.{k}": v for k, v in cfg.parallel.layout.settings_keeping(replicas).items()}
    if cfg.elastic.keep_survivors and not survivors_keep_state(
        cfg.parallel.layout, replicas, cfg.elastic.peer_copy_every
    ):
        changes["elastic.keep_survivors"] = None
    return derived(cfg, changes, f"re-planned to {replicas} copies of the state")


def wait_for_replicas(cfg: RunConfig, target_dp: int, device: str, reserve_node: str | None,
                      log=print) -> tuple[int, float, Capacity]:
    """(dp, seconds waited, capacity): the largest dp <= target_dp the live nodes hold, at once
    if they hold at least one replica (growing back happens later, at a checkpoint). Only when
    not even one fits, wait up to elastic.wait_for_resources_s for room; ElasticError then."""
    el = cfg.elastic
    t0 = time.monotonic()
    deadline = t0 + el.wait_for_resources_s
    announced = False
    while True:
        cap = capacity(cfg, device, reserve_node, cfg.data.stream_cpus)
        fits = largest_valid_dp(cfg, min(cap.replicas, target_dp)) if cap.replicas else None
        if fits is not None or time.monotonic() >= deadline:
            break
        if not announced:
            log(f"elastic: the live nodes hold no replica of {cfg.parallel.layout.replica_text()} "
                f"({cap.detail}); waiting up to {el.wait_for_resources_s:g}s (elastic.wait_for_resources_s)")
            announced = True
        time.sleep(el.poll_s)
    waited = time.monotonic() - t0 if announced else 0.0
    if fits is None:
        raise ElasticError(
            f"after waiting {waited:.0f}s (elastic.wait_for_resources_s) no replica of "
            f"{cfg.parallel.layout.replica_text()} actors fits the live nodes "
            f"({cap.detail or 'none'}); add nodes and resume from the last checkpoint "
            "(checkpoint.resume=auto), or lower parallel.cp/pp/tp"
        )
    return fits, waited, cap
