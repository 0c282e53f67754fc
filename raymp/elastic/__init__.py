"""Elastic training: what the cluster holds after a loss (capacity.py), the recovery state
machine (controller.py) with its states (states.py) and its recovery and scaling policies
(policy.py), and copies of the state in peers' memory (peer_copies.py)."""

from raymp.elastic.capacity import (
    Capacity,
    ElasticError,
    capacity,
    largest_valid_dp,
    largest_valid_replicas,
    wait_for_replicas,
    with_dp,
    with_replicas,
)

__all__ = [
    "Capacity",
    "ElasticError",
    "capacity",
    "largest_valid_dp",
    "largest_valid_replicas",
    "wait_for_replicas",
    "with_dp",
    "with_replicas",
]
