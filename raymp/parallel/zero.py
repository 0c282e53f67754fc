"""Data parallelism with ZeRO, on torch's own building blocks.

    zero 0: DistributedDataParallel (everything replicated)
    zero 1: DDP + ZeroRedundancyOptimizer (optimizer state sharded)
    zero 2: FSDP2, parameters kept unsharded for the whole step (gradients + optimizer sharded)
    zero 3: FSDP2, parameters resharded after forward and backward (everything sharded)

Each engine exposes the same small surface the worker's step needs: the module to call, a
context for micro-batches that must not sync gradients yet, clipping, and the post-step hook.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from raymp.optim import adamw_kwargs, build_optimizer, param_groups


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _unique_bytes(tensors) -> int:
    """Bytes of distinct storages (tied weights and aliases counted once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = _local(t)
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if t.numel() and key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


class DataParallelEngine:
    """Common surface. `model` is what forward is called on; `optimizer` does the update."""

    model: nn.Module
    optimizer: torch.optim.Optimizer

    def no_sync(self, is_last_micro_batch: bool):
        return contextlib.nullcontext()

    def clip_grad_norm(self, max_norm: float | None) -> float:
        """Global gradient norm (over every shard), clipping to max_norm when set. The norm is
        made a plain tensor before clipping: scaling sharded grads by a Partial DTensor would not
        be the global coefficient."""
        # The optimizer's parameters, not the module's: under ZeRO-2 the module holds unsharded
        # working copies without .grad, and the gradients live on the sharded parameters.
        params = [p for p in self.optimizer_params() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        if max_norm:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
        return float(norm)

    def after_optimizer_step(self) -> None:
        pass

    def optimizer_params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def local_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer whose state lives on this rank."""
        return self.optimizer

    def optimizer_state_tensors(self):
        for state in self.local_optimizer().state.values():
            for v in state.values():
                if torch.is_tensor(v) and v.dim() > 0:  # skip scalar 'step' counters
                    yield v

    def state_bytes(self) -> dict[str, int]:
        """Model-state bytes this rank holds right now: call after optimizer.step(), before
        zero_grad(), when parameters, gradients and optimizer state all exist."""
        params = list(self.model.parameters()) + self.optimizer_params()
        return {
            "param_bytes": _unique_bytes(params),
            "grad_bytes": _unique_bytes(p.grad for p in self.optimizer_params()),
            "optim_bytes": _unique_bytes(self.optimizer_state_tensors()),
        }

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError


class DDPEngine(DataParallelEngine):
    def __init__(self, module: nn.Module, dp_mesh, opt_cfg, zero: int, device: torch.device):
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.module = module
        self.model = DDP(
            module,
            device_ids=[device.index] if device.type == "cuda" else None,
            process_group=dp_mesh.get_group(),
        )
        if zero == 1:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            self.optimizer = ZeroRedundancyOptimizer(
                param_groups(list(module.parameters()), opt_cfg.weight_decay),
                optimizer_class=torch.optim.AdamW,
                process_group=dp_mesh.get_group(),
                **adamw_kwargs(opt_cfg),
            )
        else:
            self.optimizer = build_optimizer(module.parameters(), opt_cfg)

    def no_sync(self, is_last_micro_batch: bool):
        # Gradient accumulation: only the last micro-batch's backward all-reduces.
        return contextlib.nullcontext() if is_last_micro_batch else self.model.no_sync()

    def local_optimizer(self) -> torch.optim.Optimizer:
        return getattr(self.optimizer, "optim", self.optimizer)  # ZeRO-1: this rank's shard

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone().cpu() for k, v in self.module.state_dict().items()}


class FSDPEngine(DataParallelEngine):
    def __init__(self, module: nn.Module, dp_mesh, opt_cfg, zero: int, mp_dtype, block_names):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        self.zero = zero
        reshard = zero == 3
        mp = MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=torch.float32) if mp_dtype else MixedPrecisionPolicy()
        offload = CPUOffloadPolicy() if opt_cfg.cpu_offload else None
        kwargs = dict(mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)
        if offload is not None:
            kwargs["offload_policy"] = offload
        for name in block_names:  # one FSDP unit per transformer block, then the root
            fully_shard(module.get_submodule(name), **kwargs)
        fully_shard(module, **kwargs)
        if zero == 2:
            # ZeRO-2 keeps full parameters through the step (one all-gather per step, not per
            # micro-batch). The optimizer then updates the *sharded* parameters, leaving the
            # unsharded copies stale: after_optimizer_step() drops them (DESIGN.md trap).
            module.set_reshard_after_backward(False)
        self.model = module
        self.optimizer = build_optimizer(module.parameters(), opt_cfg)

    def after_optimizer_step(self) -> None:
        if self.zero == 2:
            from torch.distributed.fsdp import FSDPModule

            # reshard() acts on one FSDP unit only: every block's unit must drop its copy.
            for m in self.model.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        # cpu_offload full state dicts can alias live storage: copy (DESIGN.md trap).
        return {k: v.detach().clone() for k, v in sd.items()}


def apply_data_parallel(module, dp_mesh, opt_cfg, zero: int, device, mp_dtype, block_names):
    if zero >= 2:
        return FSDPEngine(module, dp_mesh, opt_cfg, zero, mp_dtype, block_names)
    return DDPEngine(module, dp_mesh, opt_cfg, zero, device)
