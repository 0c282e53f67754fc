"""Elastic training: what the cluster holds after a loss (capacity.py) and the recovery state
machine with its failure and scaling policies (controller.py)."""

from raymp.elastic.capacity import (Capacity, ElasticError, capacity, largest_valid_dp, largest_valid_replicas,
                                    wait_for_replicas, with_dp, with_replicas)

__all__ = ["Capacity", "ElasticError", "capacity", "largest_valid_dp", "largest_valid_replicas", "wait_for_replicas",
           "with_dp", "with_replicas"]
