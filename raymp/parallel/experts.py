"""Mixture-of-experts routing statistics across ranks: the replicas that split a global batch
each count the tokens their micro-batches sent to each expert; the bias update and the metrics
need the global batch's counts (raymp.models.moe.finish_routing)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from raymp.models.moe import finish_routing


def finish_expert_step(blocks: dict, data_mesh) -> dict:
    """finish_routing with the counts summed over `data_mesh` (every rank that holds a share of
    the batch; under HSDP a 2-D mesh, summed along each dimension in turn)."""
    if not blocks:
        return {}
    replicas = data_mesh.size()

    def sum_over_replicas(t: torch.Tensor) -> None:
        on_device = t.to(data_mesh.device_type)  # NCCL reduces device tensors only
        for dim in range(data_mesh.ndim):
            dist.all_reduce(on_device, group=data_mesh.get_group(dim))
        t.copy_(on_device)

    return finish_routing(blocks, sum_over_replicas if replicas > 1 else None, replicas)
