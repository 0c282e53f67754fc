"""The driver: owns the run, decides what each step consumes, and makes one call per actor per step.

    trainer = raymp.Trainer("configs/tiny.yaml", overrides=["parallel.dp=2"])
    trainer.fit()                 # or: trainer.step() repeatedly, inspecting in between
    trainer.history[-1]["loss"]; trainer.layout(); trainer.state_dict()
    trainer.close()
"""

from __future__ import annotations

import datetime as _dt
import time
import uuid
from pathlib import Path

import numpy as np
import ray
import yaml

from raymp.config import CPU_OFFLOAD_ON_CPU, ConfigError, RunConfig, config_from_dict, load_config, resolved_dict
from raymp.data import DataPosition, TrainOrder, load_dataset, replica_slice
from raymp.data.stream import local_node_if_local_path
from raymp.models import model_args, model_spec
from raymp.parallel.mesh import ParallelDims
from raymp.progress import StepProgress
from raymp.checkpoint.coordinator import CheckpointCoordinator
from raymp.checkpoint.lineage import Lineage, config_overrides
from raymp.checkpoint.restore import SETUP_KNOB, restore_newest_intact
from raymp.checkpoint.store import Checkpoint, CheckpointStore, read_marker
from raymp.elastic import with_dp
from raymp.elastic.controller import ElasticController, FailurePolicy, ScalingPolicy
from raymp.parallel.mesh import layout_of as _layout_of_parallel, layout_text as _layout_text
from raymp.runtime.actor_group import ActorGroup, WorkerLostError
from raymp.runtime.cluster import connect, resolve_device


def as_config(config: RunConfig | str | Path | dict, overrides: list[str] | None = None) -> RunConfig:
    if isinstance(config, RunConfig):
        if overrides:
            return config_from_dict(config.model_dump(mode="json"), overrides)
        return config
    if isinstance(config, dict):
        return config_from_dict(config, overrides)
    return load_config(config, overrides)


def with_stage_split(cfg: RunConfig, vocab_size: int) -> RunConfig:
    """`cfg` with parallel.stage_layers decided (balanced by cost) when it pipelines and none was
    given: the config the driver hands its ranks."""
    if cfg.parallel.pp == 1 or cfg.parallel.stage_layers is not None:
        return cfg
    from raymp.parallel.pipeline import balance_stages

    split = balance_stages(_stage_args(cfg, vocab_size), cfg.parallel.num_stages)
    return config_from_dict(resolved_dict(cfg), [f"parallel.stage_layers={split}"])


def _stage_args(cfg: RunConfig, vocab_size: int):
    """The shape the pipeline balancer splits; a factory model's layer count is its own."""
    import dataclasses

    args = model_args(cfg.model, vocab_size)
    if cfg.model.factory is None:
        return args
    spec = model_spec(cfg.model, vocab_size, cfg.seed)
    if not spec.stageable:
        from raymp.models.custom import STAGEABLE_NEEDED

        raise ConfigError(STAGEABLE_NEEDED)
    if spec.num_layers < cfg.parallel.num_stages:
        raise ConfigError(f"parallel.pp makes {cfg.parallel.num_stages} stages but model.factory's "
                          f"module has {spec.num_layers} layers; lower parallel.pp")
    return dataclasses.replace(args, n_layers=spec.num_layers)


class Trainer:
    def __init__(self, config: RunConfig | str | Path | dict, overrides: list[str] | None = None,
                 *, actor_group: ActorGroup | None = None, progress: bool = True,
                 data_position: DataPosition | dict | None = None, worker_cls: type | None = None):
        """`worker_cls` replaces the Worker class of the groups the trainer builds (fault tests
        inject failing storage this way and still get elastic restarts)."""
        self.config = as_config(config, overrides)
        self._shared_group = actor_group
        self._worker_cls = worker_cls
        self.group: ActorGroup | None = None
        self.progress_enabled = progress
        self.history: list[dict] = []
        self.tracker = None
        self.run_name = self.config.tracking.run_name or _default_run_name(self.config)
        self.run_dir = Path(self.config.output_dir) / self.run_name
        self._ready = False
        self._next_step = 0
        self.start = None  # DataPosition the streams started from
        self._resume_position = data_position
        self.elastic: ElasticController | None = None
        # on_event(name, info): ("placed", bundle nodes) while a group is being built, ("step",
        # steps done) between steps. Runs on the training thread, which waits for it to return:
        # scripted faults (tests, cluster/local_cluster.py) happen at an exact point of the run.
        self.on_event = None
        self._say = self._log

    @property
    def failures(self) -> list[dict]:
        """Every lost rank, in order (faults while recovering included)."""
        return self.elastic.failures if self.elastic else []

    @property
    def restarts(self) -> list[dict]:
        """Every restart (after a failure, or growing back), as its event."""
        return self.elastic.restarts if self.elastic else []

    # -- set-up ---------------------------------------------------------------------------

    def setup(self) -> "Trainer":
        if self._ready:
            return self
        cfg = self.config
        p = cfg.parallel
        world = ParallelDims(p.dp, p.pp, p.tp).world_size
        # One CPU beyond the actors' for the Ray Data tasks that prepare and stream the data.
        connect(cfg.resources.address, world * cfg.resources.cpus_per_actor + 1)
        self.data = load_dataset(cfg.data, cfg.train.seq_len, log=self._log)
        self._check_vocab(cfg)
        self.order = TrainOrder(self.data.num_samples, cfg.data.val_fraction, cfg.seed,
                                cfg.train.global_batch_size)
        self.device = resolve_device(cfg.resources.device, world)
        if self.device == "cpu" and cfg.optimizer.cpu_offload:
            raise ConfigError(CPU_OFFLOAD_ON_CPU + " (resources.device=auto found no GPUs)")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        store = CheckpointStore(self._checkpoint_root(), cfg.checkpoint.keep_last)
        if cfg.checkpoint.every:
            store.probe_writable()  # a read-only dir fails now, not at the first save
        self.lineage = Lineage.open(store, cfg.checkpoint.resume)
        for entry in store.scan():
            if entry.problem:
                self._log(f"checkpoint: step {entry.step} is damaged, passed over: {entry.problem}")
        if self.lineage.abandoned():
            self._log(f"checkpoint: rewound to step {self.lineage.rewound_from}: the newer checkpoints of the "
                      f"abandoned timeline (steps {[c.step for c in self.lineage.abandoned()]}) are never loaded "
                      "by this run, and move to <checkpoint.dir>/abandoned-<time>/ at its first save")
        if self.lineage.candidates() and self._resume_position is not None:
            raise ValueError("give a data_position or a checkpoint to resume from, not both "
                             "(set checkpoint.resume=never to use the data position)")
        self.elastic = ElasticController(
            self, FailurePolicy(cfg.elastic, self._shared_group is not None),
            ScalingPolicy(p.dp, self.device, local_node_if_local_path(self.data.root), cfg.elastic.grow_back),
            lambda *a: self._say(*a))
        resume = self._launch(self._resume_position)
        if resume is not None:
            self._said_resume(resume)
        self.resumed_from = resume
        self.initial_position = self.start if resume is None else None
        (self.run_dir / "config.yaml").write_text(yaml.safe_dump(resolved_dict(self.config), sort_keys=False))
        if cfg.tracking.enabled:
            self._start_tracking(resume)
        self._ready = True
        return self

    def _said_resume(self, resume: Checkpoint) -> None:
        """One line on what a resume restores, and each setting the config changes against it."""
        cfg = self.config
        self._log(f"resuming from {resume.path} (step {resume.step}, saved with "
                  f"{_layout_text(resume.meta['layout'])}): weights, optimizer state, LR schedule position "
                  "and data position restored")
        for change in config_overrides(resume.meta.get("config", {}), cfg):
            self._log(f"resume: the config's {change}")
        if resume.step >= cfg.train.steps:
            self._log(f"that checkpoint already completes train.steps={cfg.train.steps}: nothing to "
                      "train; raise train.steps to go on, or set checkpoint.resume=never and another "
                      "checkpoint.dir to start over")

    def _launch(self, position: DataPosition | dict | None = None) -> Checkpoint | None:
        """Actors for self.config's layout, set up, restored from the lineage's newest intact
        state (saved under any layout) or, if it has none, started at `position`; streams
        started. Run at set-up and again after each restart. Returns the checkpoint restored."""
        cfg = self.config
        p, r = cfg.parallel, cfg.resources
        self.dims = ParallelDims(p.dp, p.pp, p.tp)
        if self._shared_group is not None:
            if self._shared_group.world_size != self.dims.world_size:
                raise ValueError(
                    f"the actor group given has {self._shared_group.world_size} actors but the "
                    f"layout needs dp*pp*tp = {self.dims.world_size}"
                )
            self.group = self._shared_group
            self.group.check_tp_groups_share_nodes(self.dims.tp)
        else:
            self.group = ActorGroup(
                self.dims.world_size, self.device, r.cpus_per_actor, r.placement_timeout_s,
                r.collective_timeout_s, tp_size=self.dims.tp, rendezvous_timeout_s=r.rendezvous_timeout_s,
                on_event=self.on_event, **({"worker_cls": self._worker_cls} if self._worker_cls else {}),
            )
        # The driver decides the split (and records it in config.yaml and the MLflow params).
        self.config = cfg = with_stage_split(cfg, self.data.vocab_size)
        self._estimate_memory(cfg)

        def set_up():
            return self.group.call("setup", resolved_dict(cfg), self.data.vocab_size,
                                   timeout_s=r.setup_timeout_s, knob=SETUP_KNOB)

        infos = set_up()
        self.setup_info = infos  # per rank: coords, stages, parameters, setup_peak_bytes
        self.checkpoints = self._checkpoint_coordinator()
        restored = restore_newest_intact(self.group, self.lineage.candidates(), set_up, self._say,
                                         r.setup_timeout_s)
        if restored is not None:
            position = restored.data_position
        start = self._checked_position(position) if position is not None else \
            DataPosition.at(0, 0, self.order, cfg.seed, self.data.identity)
        self._start_streams(start)
        self._send_eval_data()
        self.num_params = model_spec(cfg.model, self.data.vocab_size, cfg.seed).num_params()
        self._stages_by_rank = [info.get("stages", {}) for info in infos]
        if self.dims.pp > 1:
            stages = {s: layers for per_rank in self._stages_by_rank for s, layers in per_rank.items()}
            self.stage_layers = [stages[s] for s in sorted(stages)]
        return restored

    def _start_tracking(self, resume: Checkpoint | None) -> None:
        """The run's MLflow run: a new one, or the one a resumed checkpoint (or
        tracking.resume_run_id) names, which goes on with a resume event."""
        import json

        from raymp.tracking import RunTracker

        cfg = self.config
        # checkpoint.resume=auto continues this run, so its MLflow run goes on; a checkpoint named
        # by path may be another run's (a warm start), which gets a run of its own.
        record = (resume.meta.get("lineage") or {}) if resume is not None else {}
        continuing = resume is not None and (
            record["id"] == self.lineage.id if record.get("id") else cfg.checkpoint.resume == "auto")
        previous = (resume.meta.get("mlflow") or {}) if continuing else {}
        run_id = cfg.tracking.resume_run_id or previous.get("run_id")
        self.tracker = RunTracker(cfg, self.run_name, self._tags(), resume_run_id=run_id,
                                  provisional=cfg.checkpoint.every > 0)
        if cfg.tracking.resume_run_id and not self.tracker.resumed:
            raise ConfigError(f"tracking.resume_run_id {run_id!r} is not a run of experiment "
                              f"{cfg.tracking.experiment!r} in {self.tracker.uri}; check the id (raymp runs)")
        if self.tracker.resumed:
            self.tracker.log_event("resume", {"step": self.global_step, "checkpoint": resume.path if resume else None,
                                              "layout": _layout_of(cfg)}, self.global_step)
        else:
            self.tracker.log_text(yaml.safe_dump(resolved_dict(cfg), sort_keys=False), "config.yaml")
            self.tracker.log_params(self._data_params())
            if resume is not None:
                self.tracker.set_tags({"raymp.resumed_from": resume.path})
        plan = {"layout": self._layout_rows(), "memory_estimate": [vars(e) for e in self.memory_estimate],
                "stage_layers": getattr(self, "stage_layers", None)}
        self.tracker.log_text(json.dumps(plan, indent=1, default=str), "layout.json")

    def _finish_tracking(self, status: str) -> None:
        """The loss curve and where the last checkpoint is, then the run's end status."""
        try:
            if self.history:
                self.tracker.log_figure(_loss_figure(self.history, self.run_name), "loss_curve.png")
            latest = self.checkpoints.store.latest() if self.checkpoints else None
            if latest is not None:
                self.tracker.set_tags({"raymp.checkpoint": latest.path, "raymp.checkpoint_step": str(latest.step)})
        finally:
            self.tracker.finish(status, complete=self.global_step >= self.config.train.steps)

    def _log(self, *args) -> None:
        if self.progress_enabled:
            print(*args, flush=True)

    # -- checkpoints ------------------------------------------------------------------------

    def _checkpoint_root(self) -> str:
        return self.config.checkpoint.dir or str(self.run_dir / "checkpoints")

    def _checkpoint_coordinator(self) -> CheckpointCoordinator:
        c = self.config.checkpoint
        return CheckpointCoordinator(self.lineage, c.every, c.async_save, lambda *a: self._say(*a),
                                     c.write_timeout_s)

    def _checkpoint_meta(self) -> dict:
        import raymp

        meta = {
            "data_position": self.data_position().to_dict(),
            "layout": _layout_of(self.config),
            "run_name": self.run_name,
            "config": resolved_dict(self.config),
            "raymp_version": raymp.__version__,
        }
        if self.tracker is not None:
            meta["mlflow"] = {"run_id": self.tracker.run_id, "tracking_uri": self.tracker.uri}
        return meta

    def save_checkpoint(self) -> Checkpoint:
        """Write a checkpoint of the state after the steps done so far, and wait until it is
        committed (fit() saves every checkpoint.every steps by itself)."""
        self.setup()
        self.checkpoints.start(self.group, self.global_step, self._checkpoint_meta())
        checkpoint = self._committed(self.checkpoints.finish(self.group))
        if checkpoint is None:
            raise RuntimeError(f"the checkpoint of step {self.global_step} was not committed: "
                               f"{self.checkpoints.failed[-1][1]}")
        return checkpoint

    def load_checkpoint(self, checkpoint: str | Checkpoint) -> None:
        """Continue from a committed checkpoint (saved under any layout): weights, optimizer
        state, LR schedule and data position."""
        self.setup()
        checkpoint = read_marker(checkpoint) if isinstance(checkpoint, str) else checkpoint
        restore_newest_intact(self.group, [checkpoint], lambda: None, self._say,
                              self.config.resources.setup_timeout_s)
        self._start_streams(self._checked_position(checkpoint.data_position))
        self.history = [m for m in self.history if m["step"] < self.global_step]

    def _checkpoint_after_step(self, per_rank: list[dict], metrics: dict) -> None:
        self._committed(self.checkpoints.collect([r.pop("checkpoint", None) for r in per_rank]), metrics)
        if self.checkpoints.due(self.global_step, self.config.train.steps):
            cost = self.checkpoints.start(self.group, self.global_step, self._checkpoint_meta())
            metrics["checkpoint_blocked_s"] = cost["blocked_s"]
            if self.elastic.scaling.grow_to(self.config) is not None and self._shared_group is None:
                if self._committed(self.checkpoints.finish(self.group), metrics):
                    self.elastic.grow()  # a checkpoint to grow from: the one just committed

    def _committed(self, checkpoint: Checkpoint | None, metrics: dict | None = None) -> Checkpoint | None:
        """A commit makes the steps before it final: their metrics go to MLflow."""
        if checkpoint is not None:
            if metrics is not None:
                metrics["checkpoint_committed"] = checkpoint.step
            if self.tracker is not None:
                self.tracker.publish_steps_before(checkpoint.step)
        return checkpoint

    # -- data -------------------------------------------------------------------------------

    def _check_vocab(self, cfg) -> None:
        if cfg.model.vocab_size is not None and cfg.model.vocab_size < self.data.vocab_size:
            raise ConfigError(
                f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the {self.data.tokenizer} "
                f"tokenizer's {self.data.vocab_size} tokens; leave it unset to take it from the tokenizer"
            )

    def _data_params(self) -> dict:
        m = self.data.manifest
        params = {"data.root": self.data.root, "data.samples": m["samples"], "data.tokens": m["tokens"],
                  "data.train_samples": len(self.order.train_ids), "data.val_samples": len(self.order.val_ids)}
        params.update({f"data.skipped.{reason}": n for reason, n in m["skipped"].items()})
        return params

    def _first_stage_ranks(self) -> list[int]:
        return [r for r in range(self.dims.world_size) if self.dims.coords(r)["pp"] == 0]

    def _start_streams(self, start: DataPosition) -> None:
        """One Ray Data stream per first-stage rank (each TP rank of the first stage reads its
        replica's stream), beginning at `start`."""
        from raymp.data.stream import StreamSpec

        cfg = self.config
        node = local_node_if_local_path(self.data.root)
        free = _free_cpus(node)
        if free < cfg.data.stream_cpus:
            where = "the driver's node (data.cache_dir is a local path there)" if node else "the cluster"
            raise ConfigError(
                f"the data streams' Ray Data tasks need data.stream_cpus={cfg.data.stream_cpus} free CPU, "
                f"but {where} has {free:g} left after placing the actors; add CPUs, lower "
                "resources.cpus_per_actor or data.stream_cpus"
                + (", or put data.cache_dir on storage every node reads (s3://, gs://, file:// on a shared "
                   "mount)" if node else "")
            )
        steps = cfg.train.steps - start.step
        args = []
        for rank in range(self.dims.world_size):
            c = self.dims.coords(rank)
            spec = None
            if c["pp"] == 0 and steps > 0:
                spec = StreamSpec(self.data.root, self.data.num_samples, self.data.seq_len,
                                  cfg.data.val_fraction, cfg.seed, cfg.train.global_batch_size, self.dims.dp,
                                  c["dp"], start, node)
            args.append((spec, steps, cfg.data.stream_cpus, cfg.data.prefetch_batches))
        self.group.call_per_rank("start_stream", args)
        self.start = start
        self._next_step = start.step

    def _send_eval_data(self) -> None:
        """The held-out batches every validation uses: the first train.eval_batches global
        batches of the validation split, each replica its slice."""
        cfg, t = self.config, self.config.train
        n = min(t.eval_batches, len(self.order.val_ids) // t.global_batch_size)
        if t.eval_batches and n == 0:
            raise ConfigError(
                f"data.val_fraction={cfg.data.val_fraction} holds out {len(self.order.val_ids)} samples, "
                f"fewer than one global batch ({t.global_batch_size}); raise data.val_fraction or set "
                "train.eval_batches=0"
            )
        self.eval_batches = n
        batches = [self.order.val_ids[i * t.global_batch_size:(i + 1) * t.global_batch_size] for i in range(n)]
        args = []
        for rank in range(self.dims.world_size):
            c = self.dims.coords(rank)
            if c["pp"] == 0:
                args.append(([self.data.gather(replica_slice(b, self.dims.dp, c["dp"])) for b in batches],))
            else:
                args.append(([None] * n,))
        self.group.call_per_rank("set_eval_data", args)

    def data_position(self) -> DataPosition:
        """Where the run is in its data (steps done, samples consumed, epoch, offset): saved
        with a checkpoint; restore_data_position() continues from it, with any layout."""
        self.setup()
        consumed = self.order.consumed_before(self._next_step, self.start)
        return DataPosition.at(self._next_step, consumed, self.order, self.config.seed, self.data.identity)

    def restore_data_position(self, position: DataPosition | dict) -> None:
        """Continue from a saved data position: the next step reads exactly what the step after
        the saved one would have read in an uninterrupted run."""
        self.setup()
        self._start_streams(self._checked_position(position))

    def _checked_position(self, position: DataPosition | dict) -> DataPosition:
        if isinstance(position, dict):
            position = DataPosition.from_dict(position)
        position.check_compatible(self.order, self.config.seed, self.data.identity)
        if position.step > self.config.train.steps:
            raise ValueError(f"the data position is at step {position.step}, past train.steps="
                             f"{self.config.train.steps}; raise train.steps to train on")
        return position

    def evaluate(self) -> float | None:
        """Mean loss on the held-out validation batches (None if train.eval_batches is 0)."""
        self.setup()
        if not self.eval_batches:
            return None
        losses = [x for x in self.group.call("evaluate") if x is not None]
        return sum(losses) / len(losses)

    def _estimate_memory(self, cfg) -> None:
        """The planner's per-rank estimate for this layout, logged beside what each rank measures."""
        from raymp.planner import Layout, estimate

        self.memory_estimate = estimate(
            model_args(cfg.model, self.data.vocab_size), Layout.of(cfg.parallel),
            cfg.train.global_batch_size, cfg.train.seq_len, cfg.precision == "bf16",
            cfg.parallel.stage_layers,
        )

    @staticmethod
    def _measured_bytes(r: dict) -> int:
        """Model state + saved activations of one rank: the quantity the planner estimates."""
        return (r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"] + r.get("activation_peak_bytes", 0)
                + r.get("loss_saved_peak_bytes", 0))

    def _tags(self) -> dict[str, str]:
        import torch

        import raymp

        p = self.config.parallel
        return {
            "raymp.layout": f"dp{p.dp}-pp{p.pp}-tp{p.tp}-zero{p.zero}",
            "raymp.dp": str(p.dp), "raymp.pp": str(p.pp), "raymp.tp": str(p.tp),
            "raymp.zero": str(p.zero), "raymp.world_size": str(self.dims.world_size),
            "raymp.schedule": p.schedule if p.pp > 1 else "none",
            "raymp.device": self.device, "raymp.backend": self.group.backend,
            "raymp.num_params": str(self.num_params),
            "raymp.version": raymp.__version__, "torch.version": torch.__version__,
            "ray.version": ray.__version__, "ray.address": ray.get_runtime_context().gcs_address,
            **({"git.commit": commit} if (commit := _git_commit()) else {}),
        }

    # -- stepping ---------------------------------------------------------------------------

    @property
    def global_step(self) -> int:
        """Optimizer steps done (including those before a restored data position)."""
        return self._next_step

    def step(self) -> dict:
        """Run one optimizer step on every actor and return the aggregated metrics."""
        self.setup()
        cfg = self.config
        step = self.global_step
        if step >= cfg.train.steps:
            raise RuntimeError(f"the run is complete: train.steps={cfg.train.steps} steps done")
        try:
            return self._step(step)
        except WorkerLostError as lost:
            raise WorkerLostError(f"step {step}: {lost}", lost.rank, lost.kind, step) from lost

    def _step(self, step: int) -> dict:
        cfg = self.config
        t0 = time.perf_counter()
        per_rank = self.group.call("train_step", step, timeout_s=cfg.elastic.step_timeout_s)
        step_time = time.perf_counter() - t0
        self._next_step += 1
        readers = [per_rank[r] for r in self._first_stage_ranks()]
        data_wait = max(r["data_wait_s"] for r in readers)
        # The global batch as the replicas read it (tp rank 0 of each), in replica order.
        sample_ids = np.concatenate([
            per_rank[self.dims.rank_of(dp=d, pp=0, tp=0)]["sample_ids"] for d in range(self.dims.dp)
        ])
        tokens = cfg.train.global_batch_size * cfg.train.seq_len
        losses = [r["loss"] for r in per_rank if r["loss"] is not None]  # last stages only
        metrics = {
            "step": step,
            "finished_at": time.time(),
            "dp": self.dims.dp,
            "loss": sum(losses) / len(losses),
            "grad_norm": per_rank[0]["grad_norm"],
            "lr": per_rank[0]["lr"],
            "step_time_s": step_time,
            "tokens_per_s": tokens / step_time,
            "data_wait_s": data_wait,
            "data_wait_fraction": data_wait / step_time,
            "sample_ids": sample_ids,
            "peak_mem_bytes_max": max(r["peak_mem_bytes"] for r in per_rank),
            "memory_measured_bytes_max": max(self._measured_bytes(r) for r in per_rank),
            "memory_estimate_bytes_max": max(
                e.model_state_bytes + e.activation_bytes for e in self.memory_estimate
            ),
        }
        metrics.update(self._flops_metrics(step_time))
        metrics["restarts"] = len(self.restarts)
        if self.dims.pp > 1:
            metrics.update(self._pipeline_metrics(per_rank))
        for r in per_rank:
            r.pop("sample_ids", None)
        metrics["per_rank"] = per_rank
        t = cfg.train
        if self.eval_batches and ((t.eval_every and (step + 1) % t.eval_every == 0) or step + 1 == t.steps):
            metrics["val_loss"] = self.evaluate()
        self.history.append(metrics)
        self._checkpoint_after_step(per_rank, metrics)
        if self.tracker is not None:
            keys = ("loss", "val_loss", "grad_norm", "lr", "step_time_s", "tokens_per_s", "data_wait_s",
                    "data_wait_fraction", "bubble_fraction", "bubble_fraction_theory", "checkpoint_blocked_s",
                    "model_tflops_per_device", "mfu", "restarts")
            logged = {k: metrics[k] for k in keys if metrics.get(k) is not None}
            logged["peak_mem_mb_max"] = metrics["peak_mem_bytes_max"] / 2**20
            logged["memory_measured_mb_max"] = metrics["memory_measured_bytes_max"] / 2**20
            logged["memory_estimate_mb_max"] = metrics["memory_estimate_bytes_max"] / 2**20
            for r in per_rank:
                logged[f"peak_mem_mb.rank{r['rank']}"] = r["peak_mem_bytes"] / 2**20
            self.tracker.log_metrics(step, logged)
        return metrics

    def _flops_metrics(self, step_time: float) -> dict:
        """Achieved model TFLOP/s per device and, when the device's peak is known, MFU."""
        from raymp.planner import step_flops

        t = self.config.train
        flops = step_flops(model_args(self.config.model, self.data.vocab_size), t.global_batch_size, t.seq_len)
        achieved = flops / step_time / self.dims.world_size / 1e12
        peak = self.config.tracking.peak_tflops_per_device
        if peak is None and self.device == "cuda" and self.config.cluster is not None:
            peak = self.config.cluster.gpu_tflops
        return {"model_tflops_per_device": achieved, "mfu": achieved / peak if peak else None}

    def _pipeline_metrics(self, per_rank: list[dict]) -> dict:
        """Bubble per replica from the stages' clocks (averaged over replicas), next to theory.
        The step's events are kept aside for timeline(), not in the history."""
        from raymp.parallel.pipeline import bubble_stats, theoretical_bubble

        p = self.config.parallel
        replicas = []
        for dp in range(p.dp):
            ranks = [self.dims.rank_of(dp=dp, pp=pp, tp=0) for pp in range(p.pp)]
            replicas.append([per_rank[r].pop("pipeline_events") for r in ranks])
        for r in per_rank:
            r.pop("pipeline_events", None)
        stats = [bubble_stats(events) for events in replicas]
        self.last_pipeline_events = replicas[0]
        self._last_pipeline_step = self.global_step
        micro = self.config.train.global_batch_size // (p.dp * p.micro_batch_size)
        return {
            "bubble_fraction": sum(s["bubble_fraction"] for s in stats) / len(stats),
            "bubble_fraction_theory": theoretical_bubble(p.schedule, p.pp, micro, p.stages_per_rank),
            "stage_busy_s": stats[0]["busy_s"],
            "stage_idle_s": stats[0]["idle_s"],
            "activation_peak_bytes_max": max(r["activation_peak_bytes"] for r in per_rank),
        }

    def timeline(self, directory: str | Path | None = None) -> dict[str, Path]:
        """Draw the last step's pipeline (dp replica 0) as timeline.png and timeline.json
        (Chrome trace) in `directory` (default: the run directory). Returns the paths."""
        from raymp.timeline import write_timeline

        if self.config.parallel.pp == 1:
            raise RuntimeError("timeline() needs a pipeline: parallel.pp is 1")
        if not getattr(self, "last_pipeline_events", None):
            raise RuntimeError("no step has run yet; call step() or fit() first")
        p = self.config.parallel
        m = self.history[-1]
        theory = m["bubble_fraction_theory"]
        title = (
            f"{self.run_name}: step {self._last_pipeline_step}, schedule {p.schedule}, pp={p.pp}, "
            f"{self.config.train.global_batch_size // (p.dp * p.micro_batch_size)} micro-batches; "
            f"bubble {m['bubble_fraction']:.1%}" + (f" (theory {theory:.1%})" if theory is not None else "")
        )
        return write_timeline(self.last_pipeline_events, directory or self.run_dir, title)

    def fit(self, steps: int | None = None) -> list[dict]:
        """Train to `train.steps` (or `steps` more steps). Returns the per-step metrics."""
        self.setup()
        target = self.config.train.steps if steps is None else self.global_step + steps
        target = min(target, self.config.train.steps)
        bar = StepProgress(self.config.train.steps, self.config.train.log_every, self.progress_enabled)
        self._say = bar.print  # restarts inside a step (growing back) print through the bar
        bar.print(self.describe())
        status = "FAILED"
        try:
            while self.global_step < target:
                try:
                    bar.update(self.step())
                    if self.on_event is not None:
                        self.on_event("step", {"done": self.global_step})
                except WorkerLostError as lost:
                    self.elastic.recover(lost)
            self._finish_checkpoint()
            status = "FINISHED"
        except KeyboardInterrupt:
            status = "KILLED"
            self._finish_checkpoint(best_effort=True)  # `ray job stop`: keep the save in flight
            raise
        finally:
            bar.close()
            if self.config.parallel.pp > 1 and self.history:
                self._save_timeline(bar)
            done = self.global_step >= self.config.train.steps
            if self.tracker is not None and (status != "FINISHED" or done):
                self._finish_tracking(status)
        bar.print(self.summary())
        return self.history

    def _finish_checkpoint(self, best_effort: bool = False) -> None:
        """Commit the save in flight. A save that fails is reported (checkpoint.failed, a log
        line) and never fails a run whose steps all finished."""
        if self.group is None or self.checkpoints.pending is None:
            return
        try:
            self._committed(self.checkpoints.finish(self.group))
        except Exception:
            if not best_effort:
                raise

    # -- elastic restarts: the run interface the controller drives (raymp/elastic/controller.py) --

    def abandon_save(self):
        return self.checkpoints.abandon()

    def teardown(self) -> None:
        self._teardown_group()

    def relaunch(self, dp: int) -> Checkpoint | None:
        """The run again with `dp` replicas, from the lineage's newest intact state."""
        self.config = with_dp(self.config, dp)
        restored = self._launch(self.initial_position)  # the position counts only without a checkpoint
        self.history = [m for m in self.history if m["step"] < self.global_step]
        return restored

    def on_restart(self, event: dict) -> None:
        """A restart is recorded: redone steps leave the MLflow record, and the event is logged,
        numbered after the restarts of earlier drivers of the same run."""
        if self.tracker is None:
            return
        self.tracker.drop_steps_from(event["resumed_step"])
        number = self.tracker.previous_restarts + len(self.restarts)
        self.tracker.log_event(f"restart-{number}", event, event["resumed_step"])
        self.tracker.set_tags({"raymp.layout": _layout_text(event["layout_after"], short=True),
                               "raymp.dp": str(self.config.parallel.dp), "raymp.restarts": str(number)})
        self.tracker.log_metrics(event["resumed_step"], {
            "elastic_restarts": number, "elastic_dp": self.config.parallel.dp,
            "elastic_restart_s": event["restart_s"]}, final=True)

    def _teardown_group(self) -> None:
        if self.group is not None and self.group is not self._shared_group:
            self.group.shutdown()
        self.group = None

    def _save_timeline(self, bar) -> None:
        paths = self.timeline()
        if self.tracker is not None:
            for path in paths.values():
                self.tracker.log_artifact(path)
        bar.print(f"pipeline timeline of the last step: {paths['png']} (Chrome trace: {paths['trace']})")

    # -- inspection -------------------------------------------------------------------------

    def layout(self) -> list[dict]:
        """Which actor holds what, where: rank, mesh coordinates, pipeline stages (stage index ->
        layer indices), node, pid, GPU ids."""
        self.setup()
        return self._layout_rows()

    def _layout_rows(self) -> list[dict]:
        return [
            {"rank": r, **self.dims.coords(r), "stages": self._stages_by_rank[r], **info}
            for r, info in enumerate(self.group.nodes)
        ]

    def memory(self) -> list[dict]:
        """Per-rank model-state bytes (params, grads, optimizer) measured at the last step."""
        if not self.history:
            raise RuntimeError("no step has run yet; call step() or fit() first")
        keys = ("rank", "param_bytes", "grad_bytes", "optim_bytes", "activation_peak_bytes",
                "loss_saved_peak_bytes", "peak_mem_bytes")
        rows = []
        for r in self.history[-1]["per_rank"]:
            e = self.memory_estimate[self.dims.coords(r["rank"])["pp"]]
            rows.append({
                **{k: r.get(k, 0) for k in keys},
                "measured_bytes": self._measured_bytes(r),
                "estimated_bytes": e.model_state_bytes + e.activation_bytes,
                "estimated_transient_bytes": e.buffer_bytes,
            })
        return rows

    def state_dict(self) -> dict:
        """Full, unsharded model weights on the driver (CPU tensors), stages merged."""
        self.setup()
        merged = {}
        for part in self.group.call("full_state_dict"):
            if part is not None:
                merged.update(part)
        return merged

    def describe(self) -> str:
        self.setup()
        p, t = self.config.parallel, self.config.train
        accum = t.global_batch_size // (p.dp * p.micro_batch_size)
        pipeline = ""
        if p.pp > 1:
            pipeline = (f"; pipeline {p.schedule}, {p.num_stages} stages, layers "
                        f"{[len(s) for s in self.stage_layers]}")
        m = self.data.manifest
        return (
            f"raymp run {self.run_name}: {self.num_params / 1e6:.2f}M params, "
            f"data {m['source']!r} ({m['samples']:,} samples, {m['tokenizer']} tokens), "
            f"dp={p.dp} pp={p.pp} tp={p.tp}{' (sequence parallel)' if p.sequence_parallel else ''} zero={p.zero} on {self.dims.world_size} {self.device} "
            f"actor(s) ({self.group.backend}); global batch {t.global_batch_size} x {t.seq_len} tokens "
            f"= {accum} micro-batch(es) of {p.micro_batch_size} per replica; precision {self.config.precision}{pipeline}"
        )

    def summary(self) -> str:
        if not self.history:
            return "no steps run"
        h = self.history
        tail = h[len(h) // 2:] or h
        tps = sorted(m["tokens_per_s"] for m in tail)[len(tail) // 2]
        lines = [
            f"done: {len(h)} steps, loss {h[0]['loss']:.4f} -> {h[-1]['loss']:.4f}, "
            f"median {tps:,.0f} tokens/s, peak memory {h[-1]['peak_mem_bytes_max'] / 2**20:.0f} MiB/rank",
        ]
        last = h[-1]
        vals = [m["val_loss"] for m in h if m.get("val_loss") is not None]
        waits = sorted(m["data_wait_fraction"] for m in tail)
        position = self.data_position()
        lines.append(
            (f"validation loss {vals[-1]:.4f} on {self.eval_batches} held-out batch(es); " if vals else "")
            + f"data: {self.data.manifest['tokens']:,} tokens, epoch {position.epoch} "
            f"offset {position.offset}; median data wait {waits[len(waits) // 2]:.1%} of step time"
        )
        lines.append(
            f"model state + activations per rank: measured {last['memory_measured_bytes_max'] / 2**20:.1f} MiB, "
            f"planner estimate {last['memory_estimate_bytes_max'] / 2**20:.1f} MiB (max over ranks)"
        )
        if self.tracker is not None:
            lines.append(
                f"MLflow run {self.tracker.run_id} in {self.tracker.uri} "
                f"(view: mlflow ui --backend-store-uri {self.tracker.uri})"
            )
        return "\n".join(lines)

    # -- tear-down --------------------------------------------------------------------------

    def close(self) -> None:
        try:
            if self._ready:
                self._finish_checkpoint(best_effort=True)  # a lost rank: the save stays uncommitted
        finally:
            if self.tracker is not None:
                self.tracker.finish("FINISHED", complete=self.global_step >= self.config.train.steps)
            self._teardown_group()
            self._ready = False

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _loss_figure(history: list[dict], title: str):
    """Training (and validation) loss by step; the Figure API, so no global pyplot state."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    ax.plot([m["step"] for m in history], [m["loss"] for m in history], label="train loss")
    val = [(m["step"], m["val_loss"]) for m in history if m.get("val_loss") is not None]
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    return fig


def _git_commit() -> str | None:
    """The commit of the code being run, when it runs from a git checkout (a job's working dir)."""
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _layout_of(cfg: RunConfig) -> dict:
    return _layout_of_parallel(cfg.parallel)


def _default_run_name(cfg: RunConfig) -> str:
    p = cfg.parallel
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{cfg.name}-dp{p.dp}pp{p.pp}tp{p.tp}z{p.zero}-{stamp}-{uuid.uuid4().hex[:4]}"


def _free_cpus(node_id: str | None) -> float:
    """Free CPUs in the cluster; with a node, no more than that node has at all (a head node
    started with --num-cpus=0 can never run the stream's tasks)."""
    free = ray.available_resources().get("CPU", 0)
    if node_id is None:
        return free
    total = next((n["Resources"].get("CPU", 0) for n in ray.nodes() if n["NodeID"] == node_id), 0)
    return min(free, total)
