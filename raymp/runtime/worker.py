"""The Ray actor that owns one device: joins the process group, builds its shard of the model,
and runs one whole training step per driver call (all micro-batches, backward, optimizer)."""

from __future__ import annotations

import gc
import math
import os
import socket
import time
import weakref

import numpy as np
import ray
import torch
import torch.distributed as dist
# Imported before any process group exists: its functions take `group.WORLD` as a default argument
# when first imported, and would keep a group of a later import alive after it is destroyed (so a
# peer of a rank that left it waits out the timeout; docs/design.md, traps).
import torch.distributed.nn  # noqa: F401

from raymp.checkpoint.coordinator import SaveOrder
from raymp.checkpoint.in_memory import PeerCopyWriter
from raymp.checkpoint.rank_state import RankCheckpointer
from raymp.data.ray_context import ordered_context
from raymp.data.stream import ReplicaStream
from raymp.models.build import model_spec
from raymp.models.moe import reset_routing
from raymp.models.spec import clean_name as _clean
from raymp.optim import build_scheduler
from raymp.parallel.experts import exchange_seconds, finish_expert_step
from raymp.runtime.checkpoint_calls import CheckpointCalls
from raymp.runtime.commit_vote import StepRecord
from raymp.runtime.gradients import full_gradients
from raymp.runtime.rank_recovery import RankRecovery, StateParts
from raymp.runtime.process_memory import (freeze_what_is_here, peak_memory, peak_rss, reset_peak_rss,
                                          return_large_buffers_to_os)
from raymp.runtime.report import MemorySampler, RankReport, RankSetup
from raymp.runtime.steps import LocalStep, PipelineStep
from raymp.runtime.thread_time import own_time_s


class Worker(CheckpointCalls):
    """Plain class; the runtime wraps it with ray.remote so tests can also use it in-process."""

    def __init__(self, num_threads: int):
        os.environ["OMP_NUM_THREADS"] = str(num_threads)

        # Each actor gets its share of cores; torch's default (all cores per process) makes
        # co-located actors fight and steps run ~20x slower (docs/design.md).
        torch.set_num_threads(num_threads)
        self.num_threads = num_threads
        self.rank = None
        self.engine = None
        self.step_runner = None  # runs this rank's part of a step: LocalStep, or PipelineStep under pp
        self.stream = None
        self.checkpointer = None
        self.peer_copy = None  # a PeerCopyWriter beside the checkpointer, on its group
        self.recovery = RankRecovery()  # its world, its kept state, its vote: the rank side of faults
        freeze_what_is_here()

    # -- placement and rendezvous ---------------------------------------------------------

    def node_info(self) -> dict:
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "threads": self.num_threads,
        }

    def prepare_to_join(self) -> dict:
        """A warm spare's preparation (raymp.runtime.spares): what a rank's first data stream and
        set-up import, imported now, while the run trains: Ray Data (half a second to a second of
        a join, docs/design.md), and torch's dynamo compiler, which torch imports the first time
        a module is initialised on the meta device (0.56 s of a first set-up, idle). No dataset
        is run here: its first run pins Ray Data's cluster-wide actors to this node
        (place_ray_data_services_here) and asks for CPUs the ranks hold. Returns node_info()."""
        ordered_context()
        with torch.device("meta"):
            torch.nn.Embedding(2, 2)
        return self.node_info()

    def rendezvous_address(self) -> tuple[str, int]:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def init_distributed(self, rank: int, world_size: int, addr: str, port: int, backend: str,
                         timeout_s: float) -> None:
        self.rank, self.world_size, self.backend = rank, world_size, backend
        if backend == "nccl":
            self.device = torch.device("cuda", 0)  # Ray sets CUDA_VISIBLE_DEVICES per actor
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        checkpoint_group = self.recovery.join(rank, world_size, addr, port, backend, timeout_s)
        self.checkpointer = RankCheckpointer(rank, world_size, checkpoint_group)
        if self.peer_copy is not None:
            self.peer_copy.discard()  # written on a group that is gone
        self.peer_copy = PeerCopyWriter(self.checkpointer, timeout_s)

    @ray.method(concurrency_group="control")
    def abandon_step(self, formation: tuple[str, int]) -> bool:
        """The group formed at `formation` lost a peer: drop the step running (StepAbandon).
        Runs in the control thread, beside the step."""
        return self.recovery.abandon(formation)

    def keep_state(self) -> int:
        """A host copy of this rank's whole training state, kept across rejoin() and set-up
        (elastic.keep_survivors; made already if a step lost a peer). Returns the optimizer
        steps it holds, so the driver can check every survivor stopped at the same step."""
        return self.recovery.keep(self._state_parts())

    def rejoin(
        self, rank: int, world_size: int, addr: str, port: int, backend: str, timeout_s: float
    ) -> None:
        """Leave the broken process group (a peer is gone) and join the survivors' new one."""
        self._drop_model()
        self.recovery.leave()
        self.init_distributed(rank, world_size, addr, port, backend, timeout_s)

    def describe_kept(self) -> dict:
        """What a rank joining in this rank's place of another replica needs to receive
        keep_state()'s copy (raymp.runtime.transfer)."""
        return self.recovery.describe_kept()

    def restore_kept(self, send_to: tuple[int, ...] = (), receive_from: int | None = None,
                     description: dict | None = None) -> None:
        """After set-up in the new layout: the state keep_state() copied, back in place. First,
        over the new world's group: a survivor sends its copy to the joining ranks `send_to`
        (each takes its place in another replica); a joining rank receives the copy of the live
        rank `receive_from` (`description`: that rank's describe_kept())."""
        self.recovery.restore(self._state_parts(), send_to, receive_from, description)

    # -- model set-up -----------------------------------------------------------------------

    def setup(self, cfg, vocab_size: int, document_eot: int | None = None,
              from_memory: bool = False) -> RankSetup:
        """Build this rank's part of the model + optimizer from the RunConfig the driver validated
        (sent as the object: not validated again); `document_eot`: the end-of-text id when
        documents are masked (data.document_mask); `from_memory`: restore_kept() follows (the
        state kept here, or received from a live peer), so no initial value is made; else any
        copy kept here is stale and goes. Re-callable: a reused actor group can train another config without
        restarting processes. The data stream is left as it is (start_stream replaces it)."""
        if self.checkpointer is not None:
            self.checkpointer.wait()  # a save of the previous set-up still writing
            self.peer_copy.wait_written()  # a copy of it
        self._drop_model()  # the previous set-up's model goes first
        self.cfg, dims = cfg, cfg.parallel.layout
        if cfg.resources.return_freed_memory:
            return_large_buffers_to_os()
        self.coords = dims.coords(self.rank)
        spec = model_spec(cfg.model, vocab_size, cfg.seed)
        initial_values = self.recovery.begin_setup(from_memory)
        if initial_values:  # else a survivor built this model before: its code is imported
            with torch.device("meta"):
                spec.build_meta()  # imports the model's code first: setup_peak_bytes counts memory, not code
        rss_before = reset_peak_rss()
        with self.recovery.forming():  # the mesh's groups, and a pipeline's tied-embedding groups
            mesh = self.recovery.mesh(dims, self.device.type)
            if dims.pp > 1:
                self.step_runner = PipelineStep(cfg, spec, mesh, self.coords, self.device, dims, document_eot,
                                                initial_values=initial_values)
            else:
                self.step_runner = LocalStep(cfg, spec, mesh, self.coords, self.device, document_eot,
                                             initial_values=initial_values)
        self.engine = self.step_runner.engine
        self.step_runner.meter.on_activation = self.recovery.check_abandoned
        self.memory = MemorySampler(cfg.train.steps, cfg.train.memory_every)
        self.scheduler = build_scheduler(self.engine.optimizer, cfg.optimizer, cfg.train.steps)
        self.eval_tokens = []
        return RankSetup(self.rank, self.coords, self.step_runner.num_params,
                         None if rss_before is None else peak_rss() - rss_before,
                         self.step_runner.stage_layers if dims.pp > 1 else {})

    # -- data -------------------------------------------------------------------------------

    def start_stream(self, spec, steps: int, cpus: float, prefetch_batches: int, wait: bool = True) -> None:
        """First-stage ranks: read this replica's batches (a StreamSpec; None on the other
        stages) for `steps` steps from the spec's start position, in place of the stream before.
        `wait`: return once the first batch is in (else wait_stream() does)."""
        if self.stream is not None:
            self.stream.close()
        self.stream = None if spec is None else ReplicaStream(spec, steps, cpus, prefetch_batches)
        if wait:
            self.wait_stream()

    def wait_stream(self) -> None:
        if self.stream is not None:
            self.stream.wait_first()

    def set_eval_data(self, batches: list[np.ndarray]) -> None:
        """This replica's share of each held-out validation batch (None where activations come in)."""
        self.eval_tokens = batches

    # -- the step ---------------------------------------------------------------------------

    def train_step(self, step: int, save: SaveOrder | None = None) -> RankReport:
        """One optimizer step over this replica's share of global batch `step`; first-stage
        ranks pull it from their stream, the other stages get activations instead. `save`: start
        a checkpoint of the state after it (CheckpointCalls.checkpoint_after_step)."""
        return self.recovery.run_step(lambda: self._train_step(step, save), self._state_parts,
                                      self._release_groups)

    def _state_parts(self) -> StateParts:
        return StateParts(self.step_runner, self.engine, self.scheduler)

    def _release_groups(self) -> None:
        """A peer is gone (RankRecovery.run_step): let go of everything here that holds the
        process groups: the checkpoint writers, and the model (the DDP reducer, the pipeline)."""
        if self.peer_copy is not None:
            self.peer_copy.discard()
        self.checkpointer = self.peer_copy = None
        self._drop_model()

    def _drop_model(self) -> None:
        """Let the model, optimizer and step runner go, their memory and any process group
        they hold with it. A full collection only when reference cycles keep some of it alive
        (FSDP2's do; DDP and unwrapped modules go with their last reference): the collection
        scans everything made since the actor started, and a survivor's recovery waits for it."""
        if self.step_runner is None and self.engine is None:
            return
        parts = [self.step_runner, self.engine, getattr(self.engine, "optimizer", None),
                 next((p for m in getattr(self.engine, "modules", ()) for p in m.parameters()), None)]
        watch = [weakref.ref(part) for part in parts if part is not None]
        self.step_runner = self.engine = self.scheduler = parts = None
        if any(ref() is not None for ref in watch):
            gc.collect()

    def _train_step(self, step: int, save: SaveOrder | None) -> RankReport:
        t0, own0 = time.perf_counter(), own_time_s()
        sample_ids = tokens = None
        data_wait = 0.0
        if self.stream is not None:
            sample_ids, tokens, data_wait = self.stream.next(step)
        measure = self.memory.measures(step)
        self.step_runner.measure_memory(measure)
        exchange_seconds(self.step_runner.expert_shards)  # the step's own exchanges only (not validation's)
        out = self.step_runner.forward_backward(tokens)
        p = self.cfg.parallel
        ballot = self.recovery.ballot(step, out["loss"], sample_ids,
                                      p.layout.local_batch(self.cfg.train.global_batch_size))
        grad_norm = self.engine.clip_grad_norm(  # the step's last collective, and its commit vote
            self.cfg.optimizer.grad_clip,
            p.layout.data_parallel_size * p.tp,
            self.step_runner.counted_elsewhere,
            also_sum=ballot.tensor,
        )
        self.recovery.counted(ballot)
        if math.isfinite(grad_norm):  # the same global norm on every rank: all apply, or none
            self.engine.optimizer.step()
            routing = finish_expert_step(self.step_runner.moe_blocks, self.step_runner.mesh["data"])
        else:  # never applied (train.on_nonfinite): the state stays the last good one
            routing = {}
            reset_routing(self.step_runner.moe_blocks)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        if measure:  # between optimizer.step() and zero_grad(): every kind of state exists
            self.memory.record(step, out, self.engine.state_bytes())
        self.engine.optimizer.zero_grad(set_to_none=True)
        self.engine.after_optimizer_step()
        compute_s, own_s = time.perf_counter() - t0, own_time_s() - own0
        finished, started = self.checkpoint_after_step(save, math.isfinite(grad_norm))
        return RankReport(
            rank=self.rank,
            **out,
            sample_ids=sample_ids,
            data_wait_s=data_wait,
            grad_norm=grad_norm,
            lr=lr,
            compute_s=compute_s,
            own_s=own_s,
            peak_mem_bytes=peak_memory(self.device),
            checkpoint=finished,
            save_started=started,
            routing=routing,
            expert_exchange_s=exchange_seconds(self.step_runner.expert_shards),
            **self.memory.last,
        )

    def step_record(self, step: int) -> StepRecord | None:
        """What the commit vote of `step` gathered, if this rank's last vote was that step's."""
        return self.recovery.step_record(step)

    def evaluate(self) -> float | None:
        """Mean validation loss over the held-out batches (last stages return it)."""
        losses = [self.step_runner.evaluate(batch) for batch in self.eval_tokens]
        return None if not losses or losses[0] is None else sum(losses) / len(losses)

    def gradients(self, tokens: np.ndarray | None) -> dict | None:
        """Forward and backward only: the full gradient of each parameter of this rank's stages, by
        name (all ranks call; dp/tp rank 0 of each stage returns), to pin a wrong gradient down."""
        self.step_runner.forward_backward(tokens)
        reset_routing(self.step_runner.moe_blocks)  # no optimizer step follows: nothing to count
        grads = full_gradients(self.engine)
        return grads if self._holds_stage_copy() else None

    # -- inspection -------------------------------------------------------------------------

    def full_state_dict(self) -> dict | None:
        """Full (unsharded) weights of this rank's stages on CPU. Every rank must call it (the
        ZeRO gather is collective); dp/tp rank 0 of each pipeline stage returns its part."""
        sd = self.engine.full_state_dict()
        return {_clean(k): v for k, v in sd.items()} if self._holds_stage_copy() else None

    def _holds_stage_copy(self) -> bool:
        """Whether this rank answers for its pipeline stages (dp, cp and tp rank 0)."""
        return self.coords["dp"] == 0 and self.coords["cp"] == 0 and self.coords["tp"] == 0

    def shutdown(self) -> None:
        self.engine = self.step_runner = None
        if dist.is_initialized():
            dist.destroy_process_group()
