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
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from raymp.layout import runs_on_fsdp
from raymp.parallel.experts import expert_modules
from raymp.optim import adamw_kwargs, build_optimizer, param_groups
from raymp.torch_compat import flatten_dense_tensors, unflatten_dense_tensors


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor; a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


# CPU's norm kernel sums a tensor's squares one after another in float32: 0.4% off at 5e7
# elements, 1% at 1e8. Norms of 64 Ki-element views, combined, are within 1e-6 at fp32's speed
# (float64 inside the kernel was as exact and 9x slower on a 78M model's gradients).
# CUDA reduces in a tree, exact enough whole.
CPU_NORM_PIECE = 1 << 16


def norm_pieces(grad: torch.Tensor) -> list[torch.Tensor]:
    """Views of a gradient whose 2-norms combine into its norm to float32's precision on its
    device (float32 or wider: a lower-precision gradient is widened first)."""
    if grad.dtype not in (torch.float32, torch.float64):
        grad = grad.float()
    if grad.device.type != "cpu" or grad.numel() <= CPU_NORM_PIECE:
        return [grad]
    return list(grad.reshape(-1).split(CPU_NORM_PIECE))


def _device_of(params) -> torch.device:
    if not params:
        return torch.device("cpu")
    return local_tensor(params[0].grad).device


def _unique_bytes(tensors) -> int:
    """Bytes of distinct storages (tied weights and aliases counted once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = local_tensor(t)
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if t.numel() and key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


class DataParallelEngine:
    """Common surface. `models` are what forward is called on (one per pipeline stage this rank
    holds; one without pipelining, also reachable as `model`); `optimizer` does the update."""

    models: list[nn.Module]
    modules: list[nn.Module]  # the same, unwrapped (attribute access to the model's parts)
    device: torch.device  # where this rank computes, and where its process group communicates
    optimizer: torch.optim.Optimizer

    @property
    def model(self) -> nn.Module:
        if len(self.models) != 1:
            raise AttributeError("this rank holds several pipeline stages: use .models")
        return self.models[0]

    def no_sync(self, is_last_micro_batch: bool):
        return contextlib.nullcontext()

    def clip_grad_norm(self, max_norm: float | None, copies: int, counted_elsewhere=(),
                       also_sum: torch.Tensor | None = None) -> float:
        """Global gradient norm over every rank's gradients, clipping to max_norm when set.

        Ranks hold gradients in many forms: plain tensors (replicated over dp, and over tp for
        modules TP does not split), DTensors sharded over dp (FSDP), over tp, or both, and under
        pipelining each stage its own. One rule covers them all: a stage's parameters live on
        `copies` = dp x tp ranks, and a local piece of a gradient is held by copies / (number of
        shards) of them, so each rank adds its squares divided by that, and one all-reduce over
        every rank gives the norm. `counted_elsewhere` names parameters (a tied head's copy of
        the embedding) whose gradient another stage already counts. `also_sum`: a flat float64
        CPU tensor summed over every rank in place by the same all-reduce (the step's commit
        vote rides on it: raymp.runtime.commit_vote)."""
        params = [p for p in self.optimizer_params() if p.grad is not None]
        skip = {id(p) for p in counted_elsewhere}
        by_weight: dict[float, list[torch.Tensor]] = {}  # shards / copies -> the pieces it weighs
        for p in params:
            if id(p) in skip:
                continue
            grad, shards = p.grad, 1
            if isinstance(grad, DTensor):
                for size, placement in zip(grad.device_mesh.shape, grad.placements):
                    # Not is_shard(): FSDP over TP uses _StridedShard, which is not a Shard.
                    shards *= 1 if placement.is_replicate() else size
            by_weight.setdefault(shards / copies, []).extend(norm_pieces(local_tensor(grad).detach()))
        squares = torch.zeros((), dtype=torch.float64, device=_device_of(params))
        for weight, pieces in by_weight.items():
            norm = torch.nn.utils.get_total_norm(pieces)
            squares += norm.to(squares.device, torch.float64).square() * weight
        if dist.is_initialized():
            # Offloaded gradients are on the CPU, which an NCCL group cannot reduce: the sum
            # travels on the rank's compute device.
            squares = squares.to(self.device)
            if also_sum is None:
                dist.all_reduce(squares)
            else:
                summed = torch.cat([squares.reshape(1), also_sum.to(self.device)])
                dist.all_reduce(summed)
                squares = summed[0]
                also_sum.copy_(summed[1:])
        norm = float(squares.sqrt())
        if max_norm:
            coef = min(1.0, max_norm / (norm + 1e-6))  # as torch.nn.utils.clip_grad_norm_
            if coef < 1.0:
                for p in params:
                    p.grad.mul_(coef)
        return norm

    def finish_gradients(self) -> None:
        """Give every DTensor gradient its parameter's layout. Backward can leave it otherwise:
        sequence parallelism leaves the norms' weight gradients Partial over tp (each rank saw
        its own slice of the sequence), and the vocabulary-parallel embedding's gradient comes
        back replicated. Clipping, the tied-embedding sum and the optimizer all read the local
        piece, which must be this rank's piece of the true gradient."""
        for p in self.optimizer_params():
            grad = p.grad
            if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(p.placements):
                p.grad = grad.redistribute(p.device_mesh, p.placements)

    def after_optimizer_step(self) -> None:
        pass

    def optimizer_params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def local_optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers whose state lives on this rank (their param_groups list exactly the
        parameters whose state this rank holds)."""
        return [self.optimizer]

    def optimizer_state_tensors(self):
        for optimizer in self.local_optimizers():
            for state in optimizer.state.values():
                for v in state.values():
                    if torch.is_tensor(v) and v.dim() > 0:  # skip scalar 'step' counters
                        yield v

    def state_bytes(self) -> dict[str, int]:
        """Model-state bytes this rank holds right now: call after optimizer.step(), before
        zero_grad(), when parameters, gradients and optimizer state all exist."""
        params = [p for m in self.models for p in m.parameters()] + self.optimizer_params()
        return {
            "param_bytes": _unique_bytes(params),
            "grad_bytes": _unique_bytes(p.grad for p in self.optimizer_params()),
            "optim_bytes": _unique_bytes(self.optimizer_state_tensors()),
        }

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full weights of this rank's modules on CPU, gathered over every sharded dimension (ZeRO,
        TP) one tensor at a time, so at most one full tensor is in flight. (DCP's
        get_model_state_dict with cpu_offload returns the result on global rank 0 only, which is
        not the holder of a later pipeline stage.)"""
        full = {}
        for model in self.modules:
            for name, value in model.state_dict().items():
                value = value.full_tensor() if isinstance(value, DTensor) else value
                # .cpu() of a CPU tensor is the same storage: copy (docs/design.md trap).
                full[name] = value.detach().cpu().clone()
        return full


class DDPEngine(DataParallelEngine):
    """zero 0/1. Without pipelining or TP, torch's DDP (bucketed all-reduce overlapped with
    backward). Under a pipeline schedule, DDP's reducer trips an internal assert when GPipe keeps
    several micro-batch graphs alive (torch 2.13: 'rebuilt parameter indices size is not same'),
    and DDP does not take DTensor (TP) parameters; there, modules are left unwrapped and
    finish_gradients() averages their local gradients over dp in one flat all-reduce per module
    after backward: the same traffic, without the overlap."""

    def __init__(self, modules: list[nn.Module], dp_mesh, opt_cfg, zero: int, device: torch.device,
                 wrap: bool = True, sync_initial: bool = True, expert_data=None):
        self.modules, self.device = modules, device
        self.dp_group = dp_mesh.get_group()
        self.dp_size = dp_mesh.size()
        # Expert-parallel weights: their gradients average over the ranks holding the same
        # experts (raymp.parallel.experts), every other one over dp.
        self.expert_group = expert_data.get_group() if expert_data is not None else None
        self.expert_ids = {id(p) for m in modules for e in expert_modules(m) for p in e.parameters()}
        # One replica has nothing to reduce: DDP would only add its buckets, a gradient-sized
        # block kept between steps (a dp=1 rank held 16 bytes per parameter between steps
        # instead of 12). torchtitan, too, applies DDP only when the replicate degree is above 1.
        self.wrapped = wrap and self.dp_size > 1
        self.models = [
            # Gradients as views of DDP's all-reduce buckets: without it DDP holds a second
            # gradient-sized copy (a 1B model in fp32: 5 GB more per rank).
            DDP(m, device_ids=[device.index] if device.type == "cuda" else None,
                process_group=self.dp_group, init_sync=sync_initial, gradient_as_bucket_view=True)
            for m in modules
        ] if self.wrapped else list(modules)
        params = [p for m in modules for p in m.parameters()]
        if zero == 1:
            # Imported here: torch.distributed.optim scripts functional optimizers with
            # torch.jit when imported, a deprecation warning wherever those show; ZeRO-1 only.
            from torch.distributed.optim import ZeroRedundancyOptimizer

            dense = [p for p in params if id(p) not in self.expert_ids]
            experts = [p for p in params if id(p) in self.expert_ids]
            self.optimizer = ZeroRedundancyOptimizer(
                param_groups(dense, opt_cfg.weight_decay), optimizer_class=torch.optim.AdamW,
                process_group=self.dp_group, **adamw_kwargs(opt_cfg))
            if experts:
                self.optimizer = ExpertsApartOptimizer(self.optimizer, build_optimizer(experts, opt_cfg))
        else:
            self.optimizer = build_optimizer(params, opt_cfg)

    def no_sync(self, is_last_micro_batch: bool):
        # Gradient accumulation: only the last micro-batch's backward all-reduces.
        if is_last_micro_batch or not self.wrapped:
            return contextlib.nullcontext()
        return self.model.no_sync()

    def finish_gradients(self) -> None:
        super().finish_gradients()
        if self.wrapped or self.dp_size == 1:
            return

        for module in self.modules:
            with_grads = [p for p in module.parameters() if p.grad is not None]
            self._average([p for p in with_grads if id(p) not in self.expert_ids], self.dp_group)
            self._average([p for p in with_grads if id(p) in self.expert_ids], self.expert_group)

    def _average(self, params, group) -> None:
        """Sum the gradients of `params` over `group` in one flat all-reduce, then divide by dp
        (an expert's gradient already sums its whole ep group's tokens)."""
        grads = [local_tensor(p.grad) for p in params]
        if not grads:
            return
        flat = flatten_dense_tensors(grads)
        if dist.get_world_size(group) > 1:
            dist.all_reduce(flat, group=group)
        flat.div_(self.dp_size)
        for g, reduced in zip(grads, unflatten_dense_tensors(flat, grads)):
            g.copy_(reduced)

    def local_optimizers(self) -> list[torch.optim.Optimizer]:
        optimizer = self.optimizer
        parts = optimizer.parts if isinstance(optimizer, ExpertsApartOptimizer) else [optimizer]
        return [getattr(part, "optim", part) for part in parts]  # ZeRO-1: this rank's shard


class ExpertsApartOptimizer(torch.optim.Optimizer):
    """ZeRO-1 under expert parallelism. ZeroRedundancyOptimizer shards the dense parameters'
    state over dp, but it takes no DTensor: the experts (already split over ep) get a plain AdamW
    whose state is this rank's 1/ep share, the same on every rank that holds those experts
    (raymp.planner prices it so). One optimizer to the schedule and the step: its param groups
    are the parts' own dicts, so the lr the schedule sets reaches both."""

    def __init__(self, dense: torch.optim.Optimizer, experts: torch.optim.Optimizer):
        self.parts = [dense, experts]
        super().__init__([g for part in self.parts for g in part.param_groups], {})

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ExpertsApartOptimizer takes no closure")
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none)

    def state_dict(self):
        raise NotImplementedError("raymp saves optimizer state per parameter (raymp.checkpoint.rank_state); "
                                  "ask each of .parts")


class FSDPEngine(DataParallelEngine):
    def __init__(self, modules: list[nn.Module], dp_mesh, opt_cfg, zero: int, device: torch.device, mp_dtype,
                 block_names, reshard_after_forward: bool, expert_data=None):
        self.zero, self.device = zero, device
        mp = (
            MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=torch.float32)
            if mp_dtype
            else MixedPrecisionPolicy()
        )
        offload = CPUOffloadPolicy() if opt_cfg.cpu_offload else None
        kwargs = dict(mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
        if offload is not None:
            kwargs["offload_policy"] = offload
        for module in modules:
            if expert_data is not None:  # expert-parallel experts: see finish_gradients
                for experts in expert_modules(module):
                    fully_shard(experts, **{**kwargs, "mesh": expert_data})
            for name in block_names(module):  # one FSDP unit per transformer block, then the root
                fully_shard(module.get_submodule(name), **kwargs)
            fully_shard(module, **kwargs)
            if zero == 2:
                # ZeRO-2 keeps full parameters through the step (one all-gather per step, not per
                # micro-batch). The optimizer then updates the *sharded* parameters, leaving the
                # unsharded copies stale: after_optimizer_step() drops them (docs/design.md trap).
                module.set_reshard_after_backward(False)
        self.modules = self.models = modules  # fully_shard wraps in place
        self.optimizer = build_optimizer([p for m in modules for p in m.parameters()], opt_cfg)
        # Expert-parallel experts are sharded over the ranks holding the same experts, whose
        # reduce-scatter averages over those dp / ep ranks; their gradients already sum the
        # tokens of the whole ep group, so a further 1/ep makes it the dp average every other
        # gradient is. (FSDP2's set_gradient_divide_factor would do it in the reduce-scatter,
        # with a PREMUL_SUM that gloo does not have.)
        self.expert_grads_scale = expert_data.size() / dp_mesh.size() if expert_data is not None else 1.0
        self.expert_params = [p for m in modules for e in expert_modules(m) for p in e.parameters()]

    def finish_gradients(self) -> None:
        super().finish_gradients()
        for p in self.expert_params:
            if p.grad is not None:
                local_tensor(p.grad).mul_(self.expert_grads_scale)

    def after_optimizer_step(self) -> None:
        if self.zero == 2:
            from torch.distributed.fsdp import FSDPModule

            # reshard() acts on one FSDP unit only: every block's unit must drop its copy.
            for model in self.models:
                for m in model.modules():
                    if isinstance(m, FSDPModule):
                        m.reshard()

def apply_data_parallel(modules: list[nn.Module], dp_mesh, opt_cfg, zero: int, device, mp_dtype,
                        block_names, reshard_after_forward: bool | None = None,
                        wrap_ddp: bool = True, sync_initial: bool = True,
                        expert_data=None) -> DataParallelEngine:
    """Wrap each of this rank's modules for data parallelism at the given ZeRO stage.
    `block_names(module)` lists the submodules that become FSDP units. `reshard_after_forward`
    overrides ZeRO-3's default (True): zero-bubble pipelines must keep parameters gathered.
    `sync_initial=False`: DDP does not broadcast rank 0's values (they are loaded after).
    `expert_data`: under expert parallelism, the mesh of the ranks holding the same experts."""
    if runs_on_fsdp(zero):
        reshard = zero == 3 if reshard_after_forward is None else reshard_after_forward
        return FSDPEngine(modules, dp_mesh, opt_cfg, zero, device, mp_dtype, block_names, reshard,
                          expert_data)
    return DDPEngine(modules, dp_mesh, opt_cfg, zero, device, wrap=wrap_ddp, sync_initial=sync_initial,
                     expert_data=expert_data)
