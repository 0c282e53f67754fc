"""The actor groups tests share: one rank per actor, on the session's Ray."""

from __future__ import annotations


def shared_group(world_size: int):
    from raymp.runtime.actor_group import ActorGroup

    return ActorGroup(world_size, "cpu", cpus_per_actor=1, placement_timeout_s=60, collective_timeout_s=120)
