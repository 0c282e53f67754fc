"""What one rank does in the forward/backward half of a step; the worker does the rest (clip,
optimizer, schedule). Two programs: the whole model on this rank (dp/ZeRO only), or this rank's
pipeline stages driven by a torch.distributed.pipelining schedule."""

from __future__ import annotations

from functools import partial

import numpy as np
import torch
import torch.distributed as dist

from raymp.config.rules import compiles
from raymp.layout import runs_under_autocast
from raymp.loss import loss_function
from raymp.models.masks import document_ids, mask_kwargs
from raymp.models.moe import moe_blocks, reset_routing, set_aux_grad_scale
from raymp.models.spec import build_part, keep_only
from raymp.parallel.checkpointing import apply_activation_checkpointing
from raymp.parallel.compile import apply_compile
from raymp.parallel.float8 import apply_float8, check_device
from raymp.parallel.context import apply_context_parallel, sequence_slice
from raymp.parallel.experts import apply_expert_parallel, expert_modules
from raymp.parallel.pipeline import (
    ZERO_BUBBLE,
    ActivationMeter,
    StepClock,
    autocast_context,
    local_stages,
    stage_to_pp_rank,
)
from raymp.parallel.tensor import loss_context
from raymp.parallel.zero import apply_data_parallel, local_tensor


def _autocast_dtype(cfg):
    return torch.bfloat16 if runs_under_autocast(cfg.parallel.zero, cfg.bf16) else None


def _build(spec, cfg, mesh, device, prune=None, fill: bool = True):
    """This rank's part of the model: built on meta, pruned to its stage, tensor-parallel, and
    only then allocated and filled (raymp.models.spec), so no rank holds the whole model."""
    p = cfg.parallel
    model = build_part(spec, device, prune=prune, tp_mesh=mesh["tp"] if p.tp > 1 else None,
                       sequence_parallel=p.sequence_parallel, fill=fill,
                       shard=partial(apply_expert_parallel, ep_mesh=mesh["ep"]) if p.ep > 1 else None)
    if p.cp > 1:
        apply_context_parallel(model, mesh["cp"], cfg.train.seq_len)
    return model


def _cp_mean(value: torch.Tensor, mesh) -> float:
    """A loss averaged over this rank's cp group: each cp rank measured its slice of the same
    sequences (equal slices, so the mean of means is the mean over every token)."""
    if mesh["cp"].size() > 1:
        value = value.detach().clone()
        dist.all_reduce(value, group=mesh["cp"].get_group())
        value /= mesh["cp"].size()
    return float(value)


def _parallelize(modules, spec, cfg, mesh, device, zero_bubble: bool = False, initial_values: bool = True):
    """Activation checkpointing, compilation, then data parallel / ZeRO (after TP: torchtitan's
    order). `initial_values`: as LocalStep's (DDP's first broadcast only with them)."""
    p = cfg.parallel
    compiled = compiles(cfg, device.type)
    if cfg.precision == "fp8":
        check_device(device)
    for module in modules:
        if cfg.precision == "fp8":
            apply_float8(module, cfg.float8.recipe, cfg.float8.fsdp_all_gather)
        if p.activation_checkpointing:
            apply_activation_checkpointing(module, spec.block_names(module))
        if compiled:
            apply_compile(module, spec.block_names(module), tensor_parallel=p.tp > 1)
    return apply_data_parallel(
        modules, mesh["data"], cfg.optimizer, p.zero, device,
        torch.bfloat16 if cfg.bf16 else None, spec.block_names,
        # Zero-bubble + FSDP2 resharding after forward yields wrong weight gradients (docs/design.md).
        reshard_after_forward=False if zero_bubble else None,
        wrap_ddp=p.pp == 1 and p.tp == 1 and p.ep == 1, sync_initial=initial_values,
        expert_data=mesh.get("expert_data"),
    )


class LocalStep:
    """pp = 1: every micro-batch runs through the whole model here; gradients accumulate and
    the data-parallel engine reduces them on the last micro-batch."""

    counted_elsewhere: tuple = ()

    def __init__(self, cfg, spec, mesh, coords, device, document_eot: int | None = None,
                 initial_values: bool = True):
        """`initial_values` False: every value is loaded right after set-up (a survivor's state,
        kept in memory), so none is computed, read or broadcast (a third of a survivor's set-up)."""
        self.cfg, self.device, self.document_eot, self.mesh = cfg, device, document_eot, mesh
        model = _build(spec, cfg, mesh, device, fill=initial_values)
        self.num_params = spec.num_params()
        self.tied_embeddings = spec.tie_embeddings
        self.engine = _parallelize([model], spec, cfg, mesh, device, initial_values=initial_values)
        self.moe_blocks = moe_blocks(model)
        self.expert_shards = expert_modules(model)
        self._autocast_dtype = _autocast_dtype(cfg)
        self.loss_meter = LossMeter(cfg, device)
        self.meter = ActivationMeter()  # saved activations, loss included

    def _micro_batches(self, tokens: np.ndarray) -> list[torch.Tensor]:
        """tokens [local batch, seq_len + 1] as int64 micro-batches on this rank's device."""
        tokens = torch.from_numpy(np.asarray(tokens).astype(np.int64)).to(self.device)
        return list(tokens.split(self.cfg.parallel.micro_batch_size))

    def _split(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """A micro-batch's inputs and labels (this cp rank's slice of the sequence) and the
        forward's mask keywords (document ids of the whole sequence: attention sees all of it)."""
        inputs, cp = batch[:, :-1], self.mesh["cp"]
        return (
            sequence_slice(inputs, cp),
            sequence_slice(batch[:, 1:], cp),
            mask_kwargs(inputs, self.document_eot),
        )

    def forward_backward(self, tokens: np.ndarray) -> dict:
        """tokens: this replica's samples of the step, [local batch, seq_len + 1]."""
        micro = self._micro_batches(tokens)
        n = len(micro)
        reset_routing(self.moe_blocks)
        set_aux_grad_scale(self.moe_blocks, 1 / n)  # as each micro-batch's loss below
        loss_sum = torch.zeros((), device=self.device)
        for i, batch in enumerate(micro):
            inputs, labels, masks = self._split(batch)
            with self.engine.no_sync(i == n - 1), loss_context(self.cfg.parallel.tp):
                with autocast_context(self.device, self._autocast_dtype), self.meter.hooks():
                    logits = self.engine.model(inputs, **masks)
                    loss = self.loss_meter.measure(logits, labels)
                del logits
                (loss / n).backward()
            loss_sum += local_tensor(loss.detach())
        self.engine.finish_gradients()
        out = {"loss": _cp_mean(loss_sum, self.mesh) / n}
        if self.meter.measuring:
            out.update(activation_peak_bytes=self.meter.peak, **self.loss_meter.report())
        return out

    def measure_memory(self, on: bool) -> None:
        """Whether the next forward_backward counts saved activations and the loss's bytes."""
        self.meter.measuring = self.loss_meter.measuring = on
        self.meter.reset_peak()

    @torch.no_grad()
    def evaluate(self, tokens: np.ndarray) -> float:
        """Mean loss over `tokens` (forward only, same micro-batches as training)."""
        micro = self._micro_batches(tokens)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for batch in micro:
            inputs, labels, masks = self._split(batch)
            with loss_context(self.cfg.parallel.tp), autocast_context(self.device, self._autocast_dtype):
                total += local_tensor(
                    self.loss_meter.loss(self.engine.model(inputs, **masks), labels)
                ).double()
        return _cp_mean(total, self.mesh) / len(micro)


class LossMeter:
    """What the loss costs this rank: bytes of the logits it holds (its vocabulary shard under
    TP) and the peak bytes autograd keeps for the loss's backward. Shows that full logits are
    never materialised on one TP rank."""

    def __init__(self, cfg, device):
        self.loss = loss_function(compiles(cfg, device.type), device.type)
        self.meter = ActivationMeter()
        self.logits_bytes = 0
        self.measuring = True

    def measure(self, logits, labels):
        if not self.measuring:
            return self.loss(logits, labels)
        local = local_tensor(logits)
        self.logits_bytes = max(self.logits_bytes, local.numel() * local.element_size())
        with self.meter.hooks():
            return self.loss(logits, labels)

    def report(self) -> dict:
        out = {"logits_bytes": self.logits_bytes, "loss_saved_peak_bytes": self.meter.peak}
        self.logits_bytes = 0
        self.meter.reset_peak()
        return out


def _whole_numel(module) -> int:
    """Parameters of a (possibly tensor-parallel) module as if whole: global sizes."""
    return sum(p.numel() for p in module.parameters())


_TIED_GROUPS: dict = {}
_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def forget_tied_groups() -> None:
    """The process groups are gone (the rank left them): a later layout of the same shape must
    make its tied-embedding groups anew, in the new world, not reuse these."""
    _TIED_GROUPS.clear()


def _tied_group(dims, coords):
    """The process group joining pp rank 0 (embedding) and pp rank p-1 (tied head) of this
    rank's (dp, tp) position; None on the ranks in between. Every rank must call new_group for
    every group in one order, so all are made on first use and cached per layout."""
    key = (dims.dp, dims.cp, dims.pp, dims.tp)
    if key not in _TIED_GROUPS:
        _TIED_GROUPS[key] = {
            (dp, cp, tp): dist.new_group([dims.rank_of(dp=dp, pp=0, tp=tp, cp=cp),
                                          dims.rank_of(dp=dp, pp=dims.pp - 1, tp=tp, cp=cp)])
            for dp in range(dims.dp)
            for cp in range(dims.cp)
            for tp in range(dims.tp)
        }
    if coords["pp"] not in (0, dims.pp - 1):
        return None
    return _TIED_GROUPS[key][(coords["dp"], coords["cp"], coords["tp"])]


class PipelineStep:
    """pp > 1: this rank's stages (one, or two/v for V-shaped/interleaved schedules), each a
    pruned copy of the model wrapped for dp/ZeRO, run by the configured schedule. Only the
    first stage reads data; it sends the labels straight to the last stage and, when documents
    are masked, their document ids to every other stage."""

    LABEL_TAG = 7  # keeps the label message apart from the schedule's activation traffic
    EVAL_TAG = 8
    DOCUMENT_TAG = 9

    def __init__(self, cfg, spec, mesh, coords, device, dims, document_eot: int | None = None,
                 initial_values: bool = True):
        """`initial_values`: as LocalStep's."""
        p = cfg.parallel
        self.cfg, self.device, self.dims, self.document_eot, self.mesh = cfg, device, dims, document_eot, mesh
        self.pp_rank = coords["pp"]
        self.pp_group = mesh["pp"].get_group()
        num_stages = p.num_stages
        layers = p.stage_layers  # the driver always decides the split
        self.stage_ids = local_stages(self.pp_rank, p.pp, num_stages, p.schedule)
        self.stage_layers = {s: layers[s] for s in self.stage_ids}
        modules = [
            _build(spec, cfg, mesh, device, prune=keep_only(layers[s], s == 0, s == num_stages - 1, spec),
                   fill=initial_values)
            for s in self.stage_ids
        ]
        self.num_params = sum(_whole_numel(m) for m in modules)
        self.tied_embeddings = spec.tie_embeddings
        self.engine = _parallelize(
            modules, spec, cfg, mesh, device, zero_bubble=p.schedule in ZERO_BUBBLE,
            initial_values=initial_values
        )
        # The schedule divides gradients by the micro-batches after backward (scale_grads), the
        # balance loss's with them: its gradient keeps scale 1.
        self.moe_blocks = {name: b for m in modules for name, b in moe_blocks(m).items()}
        self.expert_shards = [e for m in modules for e in expert_modules(m)]
        self.clock, self.meter = StepClock(), ActivationMeter()
        self.loss_meter = LossMeter(cfg, device)
        self._autocast_dtype = _autocast_dtype(cfg)
        # Here, not at the top: only a pipeline-parallel rank imports torch's pipelining.
        from raymp.parallel.pipeline_stage import SCHEDULES, TimedStage, runs_several_stages

        self.stages = stages = [
            TimedStage(model, s, num_stages, device, group=self.pp_group, clock=self.clock,
                       meter=self.meter, autocast_dtype=self._autocast_dtype)
            for s, model in zip(self.stage_ids, self.engine.models)
        ]
        self.micro_batches = p.layout.micro_batches(cfg.train.global_batch_size)
        own = stages if runs_several_stages(p.schedule) else stages[0]
        self.schedule = SCHEDULES[p.schedule](own, n_microbatches=self.micro_batches, loss_fn=self._loss)
        self.is_first = 0 in self.stage_ids
        self.is_last = num_stages - 1 in self.stage_ids
        self.last_pp_rank = stage_to_pp_rank(num_stages - 1, p.pp, p.schedule)
        self._tied = self._tied_parameters(spec, num_stages)
        # V-shaped schedules keep embedding and head on one rank: their grads are summed locally.
        cross_rank_tie = spec.tie_embeddings and self.last_pp_rank != 0
        self._tied_group = _tied_group(dims, coords) if cross_rank_tie else None
        # The head's copy of a tied embedding is counted in the norm by the first stage only.
        self.counted_elsewhere = tuple(p_ for name, p_ in self._tied if name == "output.weight")
        self._loss_calls = 0

    def _tied_parameters(self, spec, num_stages) -> list[tuple[str, torch.nn.Parameter]]:
        if not spec.tie_embeddings:
            return []
        tied = []
        for s, model in zip(self.stage_ids, self.engine.modules):
            if s == 0:
                tied.append(("tok_embeddings.weight", model.tok_embeddings.weight))
            if s == num_stages - 1:
                tied.append(("output.weight", model.output.weight))
        return tied

    def _loss(self, logits, labels):
        stage = self.cfg.parallel.num_stages - 1
        with self.clock.span(stage, "F", self._loss_calls):
            self._loss_calls += 1
            return self.loss_meter.measure(logits, labels)

    def _inputs_and_labels(self, tokens):
        """The first stage splits its batch and sends the labels to the last stage, which
        receives them; stages in between get neither. When documents are masked every stage
        gets the batch's document ids. Under context parallelism inputs and labels are this cp
        rank's slice of the sequence, document ids the whole sequence's. Returns (inputs,
        labels, document ids, pending sends)."""
        p, t = self.cfg.parallel, self.cfg.train
        inputs = labels = doc_ids = None
        sends = []
        rows = p.layout.local_batch(t.global_batch_size)
        if self.is_first:
            batch = torch.from_numpy(np.asarray(tokens).astype(np.int64)).to(self.device)
            whole = batch[:, :-1]
            inputs, labels = sequence_slice(whole, self.mesh["cp"]), sequence_slice(
                batch[:, 1:], self.mesh["cp"]
            )
            inputs, labels = inputs.contiguous(), labels.contiguous()
            if not self.is_last:
                sends.append(
                    dist.isend(labels, group=self.pp_group, group_dst=self.last_pp_rank, tag=self.LABEL_TAG)
                )
            if self.document_eot is not None:
                doc_ids = document_ids(whole, self.document_eot)
                sends += [dist.isend(doc_ids, group=self.pp_group, group_dst=r, tag=self.DOCUMENT_TAG)
                          for r in range(1, p.pp)]
        else:
            if self.is_last:
                labels = torch.empty((rows, t.seq_len // p.cp), dtype=torch.int64, device=self.device)
                dist.recv(labels, group=self.pp_group, group_src=0, tag=self.LABEL_TAG)
            if self.document_eot is not None:
                doc_ids = torch.empty((rows, t.seq_len), dtype=torch.int64, device=self.device)
                dist.recv(doc_ids, group=self.pp_group, group_src=0, tag=self.DOCUMENT_TAG)
        return inputs, labels, doc_ids, sends

    @torch.no_grad()
    def evaluate(self, tokens) -> float | None:
        """Forward-only pass of one global batch's share; the mean loss on the last stage.

        Stage by stage, micro-batch by micro-batch, activations sent point to point: torch's
        schedule.eval() asserts under V-shaped schedules (zbv, dualpipev) on torch 2.13, and
        validation is rare enough that overlapping it is not worth a second code path."""
        p = self.cfg.parallel
        inputs, labels, doc_ids, sends = self._inputs_and_labels(tokens)
        n = self.micro_batches
        owner = [stage_to_pp_rank(s, p.pp, p.schedule) for s in range(p.num_stages)]
        modules = dict(zip(self.stage_ids, self.engine.models))
        losses = []
        for mb in range(n):
            x = inputs.chunk(n)[mb] if self.is_first else None
            for s in range(p.num_stages):
                if owner[s] != self.pp_rank:
                    continue
                if s > 0 and owner[s - 1] != self.pp_rank:
                    x = self._recv_activation(owner[s - 1])
                last = s == p.num_stages - 1
                with autocast_context(self.device, self._autocast_dtype), loss_context(p.tp if last else 1):
                    x = modules[s](x, **({} if doc_ids is None else {"document_ids": doc_ids.chunk(n)[mb]}))
                    if last:
                        losses.append(float(local_tensor(self.loss_meter.loss(x, labels.chunk(n)[mb]))))
                if s < p.num_stages - 1 and owner[s + 1] != self.pp_rank:
                    self._send_activation(x, owner[s + 1])
        for send in sends:
            send.wait()
        return (
            _cp_mean(torch.tensor(sum(losses) / len(losses), dtype=torch.float64), self.mesh)
            if self.is_last
            else None
        )

    def _send_activation(self, x: torch.Tensor, dst: int) -> None:
        x = local_tensor(x).contiguous()
        header = torch.tensor([*x.shape, _DTYPES.index(x.dtype)], dtype=torch.int64, device=self.device)
        dist.send(header, group=self.pp_group, group_dst=dst, tag=self.EVAL_TAG)
        dist.send(x, group=self.pp_group, group_dst=dst, tag=self.EVAL_TAG)

    def _recv_activation(self, src: int) -> torch.Tensor:
        header = torch.empty(4, dtype=torch.int64, device=self.device)  # [batch, seq, dim, dtype]
        dist.recv(header, group=self.pp_group, group_src=src, tag=self.EVAL_TAG)
        *shape, dtype = header.tolist()
        x = torch.empty(shape, dtype=_DTYPES[dtype], device=self.device)
        dist.recv(x, group=self.pp_group, group_src=src, tag=self.EVAL_TAG)
        return x

    def forward_backward(self, tokens) -> dict:
        p = self.cfg.parallel
        inputs, labels, doc_ids, sends = self._inputs_and_labels(tokens)
        for stage in self.stages:
            stage.micro_batch_document_ids = None if doc_ids is None else doc_ids.chunk(self.micro_batches)
        # A common start line, so the ranks' clocks describe one timeline.
        dist.barrier(group=self.pp_group)
        self.clock.restart()
        self.meter.reset_peak()
        reset_routing(self.moe_blocks)
        self._loss_calls = 0
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.is_first else ()
        # The last stage's loss (and its backward, inside the schedule) on vocabulary-sharded logits.
        with loss_context(p.tp if self.is_last else 1):
            self.schedule.step(*args, target=labels if self.is_last else None,
                               losses=losses if self.is_last else None)
        for send in sends:
            send.wait()
        self.engine.finish_gradients()
        self._sync_tied_grads()
        out = {
            "loss": _cp_mean(torch.stack([local_tensor(x.detach()) for x in losses]).mean(), self.mesh)
            if self.is_last else None,
            "pipeline_events": list(self.clock.events),
        }
        if self.meter.measuring:
            out.update(
                activation_peak_bytes=self.meter.peak, **(self.loss_meter.report() if self.is_last else {})
            )
        return out

    def measure_memory(self, on: bool) -> None:
        """As LocalStep's."""
        self.meter.measuring = self.loss_meter.measuring = on
        self.meter.reset_peak()

    def _sync_tied_grads(self) -> None:
        """Tied embedding and head live on two stages; each got part of the gradient. Sum the
        parts so both copies take the same optimizer step and stay equal."""
        grads = [param.grad for _, param in self._tied if param.grad is not None]
        if not grads:
            return
        local = [local_tensor(g) for g in grads]
        total = local[0].clone()
        for g in local[1:]:
            total += g
        if self._tied_group is not None:
            dist.all_reduce(total, group=self._tied_group)
        for g in local:
            g.copy_(total)
