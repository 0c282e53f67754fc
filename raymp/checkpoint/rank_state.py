"""One rank's side of a checkpoint: what it contributes, how it saves it in the background, and
how it loads a checkpoint written under any other layout.

Every entry is keyed by the plain model's parameter name, never by rank or stage, and sharded
tensors go in as DTensors: torch.distributed.checkpoint records each shard's global offset, so a
checkpoint saved with one (dp, pp, tp, zero) loads into another, each rank reading exactly the
pieces it now holds.

    model.<name>               parameters (FSDP/TP shards as DTensors, replicated ones once)
    optim.<name>.<state>       AdamW state of the parameters this rank's optimizer owns
    optim.param_groups         hyperparameters per group (lr, betas, ...), JSON
    scheduler                  the LR schedule's state, JSON
    rng.rank<r>.torch/.cuda    each rank's generator state (restored only under the same world size)

Why not torch's get_state_dict(): it takes one module and one optimizer, while a pipeline rank
holds several stage modules behind one optimizer, ZeRO-1 keeps a partial optimizer, and a tied
head on the last stage is a copy of the first stage's embedding. The rules below cover all of
those in one place.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from raymp.checkpoint.integrity import rank_files
from raymp.checkpoint.store import CheckpointError, storage_reader, storage_writer
from raymp.checkpoint.writer_process import WRITERS, start_writer_process
from raymp.models.spec import clean_name
from raymp.torch_compat import set_scheduler_position

TIED_HEAD, EMBEDDING = "output.weight", "tok_embeddings.weight"


def canonical(name: str, tied: bool) -> tuple[str, bool]:
    """(key, is_alias): a tied head is the embedding under another name. It is saved once, as
    the embedding (from the first stage), and loaded from there by whoever holds the head."""
    if tied and name == TIED_HEAD:
        return EMBEDDING, True
    return name, False


def _add(entries: dict, key: str, tensor: torch.Tensor, alias: bool) -> None:
    slot = entries.setdefault(key, [])
    if not any(t is tensor for t, _ in slot):
        slot.append((tensor, alias))


def model_tensors(modules, tied: bool) -> dict[str, list[tuple[torch.Tensor, bool]]]:
    """key -> [(tensor, is_alias)]: every parameter and buffer this rank holds. One key can have
    several tensors (a V-shaped pipeline rank holds both the embedding and the tied head)."""
    entries: dict = {}
    for module in modules:
        for name, tensor in module.state_dict(keep_vars=True).items():
            key, alias = canonical(clean_name(name), tied)
            _add(entries, key, tensor, alias)
    return entries


def optimizer_params(engine, tied: bool) -> list[tuple[str, bool, torch.nn.Parameter, dict]]:
    """(key, is_alias, parameter, the state map of the optimizer that holds its state) for the
    parameters whose optimizer state lives on this rank."""
    names = {}
    for module in engine.modules:
        for name, param in module.named_parameters():
            names.setdefault(id(param), clean_name(name))
    out = []
    for optimizer in engine.local_optimizers():
        for group in optimizer.param_groups:
            for param in group["params"]:
                key, alias = canonical(names[id(param)], tied)
                out.append((key, alias, param, optimizer.state))
    return out


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A copy in host memory that training cannot change. Needed even for CPU tensors: DCP's own
    async staging runs in the background and reads live storage (docs/design.md trap)."""
    if isinstance(t, DTensor):
        local = t.to_local().detach().to("cpu", copy=True)
        return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False,
                                  shape=t.shape, stride=t.stride())
    return t.detach().to("cpu", copy=True)


def _group_hyperparameters(optimizer) -> str:
    return json.dumps([{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups])


def host_copy(sd: dict) -> dict:
    return {k: _to_host(v) if torch.is_tensor(v) else v for k, v in sd.items()}


def save_state(step_runner, engine, scheduler, rank: int) -> dict:
    """This rank's entries, copied to host memory (training may go on as soon as this returns)."""
    tied = step_runner.tied_embeddings
    sd = {}
    for key, tensors in model_tensors(engine.modules, tied).items():
        owned = [t for t, alias in tensors if not alias]
        if owned:
            sd[f"model.{key}"] = owned[0]
    for key, alias, param, states in optimizer_params(engine, tied):
        if alias:
            continue
        for name, value in states.get(param, {}).items():
            sd[f"optim.{key}.{name}"] = value
    sd = host_copy(sd)
    sd["optim.param_groups"] = _group_hyperparameters(engine.optimizer)
    sd["scheduler"] = json.dumps(scheduler.state_dict())
    sd[f"rng.rank{rank}.torch"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        sd[f"rng.rank{rank}.cuda"] = torch.cuda.get_rng_state()
    return sd


def nonfinite_entries(sd: dict) -> list[str]:
    """Keys of the floating-point tensors of a host-copied state dict that hold a NaN or an inf:
    such a state is never committed (checked in the background, after the write)."""
    bad = []
    for key, value in sd.items():
        if isinstance(value, DTensor):
            value = value.to_local()
        if torch.is_tensor(value) and value.is_floating_point() and not _all_finite(value):
            bad.append(key)
    return bad


def _all_finite(t: torch.Tensor) -> bool:
    """Whether a tensor holds no NaN or inf: its min and max, which a NaN or an inf anywhere
    becomes (35x faster than isfinite().all(), which writes a mask the size of the tensor)."""
    if t.numel() == 0:
        return True
    low, high = torch.aminmax(t)
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))


class AlreadyStaged:
    """An AsyncStager that hands the state dict on as it is: save_state() has made the host copy,
    and DCP's default stager would make a second one."""

    should_synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def save_in_background(sd: dict, storage_writer, group, writer_kind: AsyncCheckpointerType) -> Future:
    """DCP's async_save of a state dict save_state() has already copied to host memory; the
    future ends when the files are written (torch 2.13 returns an object whose
    upload_completion is that future, older versions the future itself)."""
    future = dcp.async_save(sd, storage_writer=storage_writer, process_group=group,
                            async_stager=AlreadyStaged(), async_checkpointer_type=writer_kind)
    return getattr(future, "upload_completion", future)


class RankCheckpointer:
    """Saves and loads this rank's part; keeps at most one background save in flight."""

    def __init__(self, rank: int, world_size: int, process_group):
        # A process group of its own: a background save's collectives must never interleave with
        # the training step's on the same group.
        self.rank, self.world_size, self.group = rank, world_size, process_group
        self.pending: tuple[int, Future] | None = None
        self.writer_factory = storage_writer  # path -> DCP StorageWriter (tests inject failures here)

    def save(self, path: str, step: int, step_runner, engine, scheduler, async_save: bool | str) -> dict:
        """Start writing step's checkpoint. Waits first for the previous save (reported as
        wait_s: storage slower than the checkpoint interval shows up here)."""
        t0 = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - t0
        sd = save_state(step_runner, engine, scheduler, self.rank)
        staged = time.perf_counter() - t0 - waited
        self.write(sd, path, step, async_save)
        return {"wait_s": waited, "stage_s": staged, "blocked_s": time.perf_counter() - t0}

    def write(self, sd: dict, path: str, step: int, async_save: bool | str) -> None:
        """Write a host-copied state dict (see host_copy), in the background if async_save (True: a
        thread, "process": DCP's writer process), then hash the files this rank wrote (integrity.py)."""
        done: Future = Future()

        def hash_files(written: Future) -> None:
            try:
                written.result()
                if bad := nonfinite_entries(sd):
                    raise CheckpointError(f"the state holds non-finite values ({', '.join(bad[:3])}"
                                          + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
                                          + "): a checkpoint of it is never committed")
                # The raw writer hashed its file as it wrote it; in DCP's writer process it
                # hashed a copy of the writer there, so the files are read back.
                done.set_result(rank_files(path, self.rank, getattr(writer, "digests", None)))
            except BaseException as exc:  # torch's CheckpointException is a BaseException
                done.set_exception(_as_error(exc))

        writer = self.writer_factory(path)
        self.pending = (step, done)
        if async_save == "process":
            start_writer_process(self.group)
        if async_save:
            try:
                future = save_in_background(sd, writer, self.group, WRITERS[async_save])
            except BaseException as exc:
                future = _failed(exc)
            future.add_done_callback(hash_files)
            return
        try:
            dcp.save(sd, storage_writer=writer, process_group=self.group)
            written = Future()
            written.set_result(None)
        except BaseException as exc:
            written = _failed(exc)
        hash_files(written)

    def poll(self) -> dict | None:
        """The finished save's step, the checksums of the files this rank wrote, and its error
        if it failed; None while none finished."""
        if self.pending is None or not self.pending[1].done():
            return None
        step, future = self.pending
        self.pending = None
        error = future.exception()
        if error is not None:
            return {"step": step, "error": f"{type(error).__name__}: {error}", "files": {}}
        return {"step": step, "error": None, "files": future.result()}

    def wait(self, timeout_s: float | None = None) -> dict | None:
        """Block until the save in flight (if any) is on storage, at most `timeout_s`; its poll()
        report, or {"step", "timeout": True} while it is still writing then."""
        if self.pending is None:
            return None
        try:
            self.pending[1].result(timeout=timeout_s)
        except FutureTimeout:
            return {"step": self.pending[0], "timeout": True}
        except BaseException:  # reported by poll()
            pass
        return self.poll()

    # -- loading ------------------------------------------------------------------------------

    def load(self, path: str, step_runner, engine, scheduler) -> dict:
        """Fill this rank's parameters, optimizer state, schedule and RNG from the checkpoint at
        `path`, whatever layout wrote it."""
        t0 = time.perf_counter()
        reader = storage_reader(path)
        saved = reader.read_metadata().state_dict_metadata
        tied = step_runner.tied_embeddings
        model = model_tensors(engine.modules, tied)
        sd = {}
        for key, tensors in model.items():
            target = tensors[0][0]
            _check_entry(saved, f"model.{key}", target, path)
            sd[f"model.{key}"] = target.detach()
        optim_targets = self._optimizer_targets(saved, engine, tied, path)
        for key, (_, state) in optim_targets.items():
            sd.update({f"optim.{key}.{name}": t for name, t in state.items()})
        sd["optim.param_groups"] = ""
        sd["scheduler"] = ""
        rng = {}
        for kind in ("torch", "cuda"):
            key = f"rng.rank{self.rank}.{kind}"
            if key in saved and self._same_world(saved):
                rng[kind] = sd[key] = torch.empty(saved[key].size, dtype=torch.uint8)
        with torch.no_grad():
            try:
                dcp.load(sd, storage_reader=reader, process_group=self.group)
            except BaseException as exc:  # CheckpointException is a BaseException
                raise CheckpointError(f"checkpoint {path} could not be read: {_as_error(exc)}") from None
            for tensors in model.values():  # aliases (a tied head) take the loaded value
                first = tensors[0][0]
                for other, _ in tensors[1:]:
                    _local(other).copy_(_local(first))
        for key, (params, state) in optim_targets.items():
            for i, (param, states) in enumerate(params):
                states[param] = state if i == 0 else {k: v.clone() for k, v in state.items()}
        restore_schedule_position(scheduler, json.loads(sd["scheduler"]))
        if "torch" in rng:
            torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
        return {"load_s": time.perf_counter() - t0, "rng_restored": "torch" in rng}

    def _same_world(self, saved) -> bool:
        return (
            f"rng.rank{self.world_size - 1}.torch" in saved
            and f"rng.rank{self.world_size}.torch" not in saved
        )

    def _optimizer_targets(self, saved, engine, tied, path) -> dict:
        """key -> ([(parameter, its optimizer's state map)], {state name: empty tensor shaped like the
        saved entry}). A parameter the checkpoint has no optimizer state for keeps a fresh (lazy) state."""
        targets: dict = {}
        for key, _, param, states in optimizer_params(engine, tied):
            if key in targets:
                targets[key][0].append((param, states))
                continue
            prefix = f"optim.{key}."
            names = [k[len(prefix):] for k in saved if k.startswith(prefix) and "." not in k[len(prefix):]]
            state = {}
            for name in names:
                meta = saved[prefix + name]
                if tuple(meta.size) == tuple(param.shape):
                    state[name] = torch.zeros_like(param.detach(), dtype=meta.properties.dtype)
                elif len(meta.size) == 0:
                    state[name] = torch.zeros((), dtype=meta.properties.dtype)
                else:
                    raise CheckpointError(
                        f"checkpoint {path}: optimizer state {prefix + name} has shape "
                        f"{tuple(meta.size)}, but the parameter is {tuple(param.shape)}: it was saved "
                        "from a different model (check the model section of the config)")
            if state:
                targets[key] = ([(param, states)], state)
        return targets


def host_state(step_runner, engine, scheduler) -> dict:
    """A host copy of everything this rank holds (a tied head's copy included), for
    load_host_state() on the same rank after it re-forms its process group."""
    for module in engine.modules:  # a step that failed mid-way may have left FSDP blocks gathered
        for block in module.modules():
            if isinstance(block, FSDPModule):
                block.reshard()
    tied = step_runner.tied_embeddings
    sd = {f"model.{key}": tensors[0][0] for key, tensors in model_tensors(engine.modules, tied).items()}
    for key, _, param, states in optimizer_params(engine, tied):
        for name, value in states.get(param, {}).items():
            sd.setdefault(f"optim.{key}.{name}", value)
    # Local pieces only: a DTensor would keep its mesh (and the groups being left) alive.
    sd = {k: _local(v).detach().to("cpu", copy=True) for k, v in sd.items()}
    sd["scheduler"] = json.dumps(scheduler.state_dict())
    sd["rng.torch"] = torch.get_rng_state()
    return sd


def load_host_state(sd: dict, step_runner, engine, scheduler) -> None:
    """Fill a freshly set-up rank from host_state(): how a survivor of a loss keeps what it held
    (no storage). Its new place in the mesh holds the same part of the model as the old one
    (same cp, pp and tp coordinates, and under HSDP the same shard of its group), so each local
    tensor is copied as it was."""
    tied = step_runner.tied_embeddings
    with torch.no_grad():
        for key, tensors in model_tensors(engine.modules, tied).items():
            for tensor, _ in tensors:
                _local(tensor).copy_(sd[f"model.{key}"])
    for key, _, param, states in optimizer_params(engine, tied):
        prefix = f"optim.{key}."
        state = {k[len(prefix):]: _like(param, v) for k, v in sd.items()
                 if k.startswith(prefix) and "." not in k[len(prefix):]}
        if state:
            states[param] = state
    restore_schedule_position(scheduler, json.loads(sd["scheduler"]))
    torch.set_rng_state(sd["rng.torch"])


def _like(param: torch.Tensor, saved: torch.Tensor) -> torch.Tensor:
    """Saved optimizer state as the kind of tensor `param` is now (a DTensor on the new mesh)."""
    local = saved.clone().to(_local(param).device)
    if isinstance(param, DTensor) and local.dim() > 0:
        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return local


def restore_schedule_position(scheduler, saved: dict) -> None:
    """Take the saved schedule's position (steps taken) and nothing else: the optimizer's
    hyperparameters and the schedule's shape (lr, betas, eps, weight decay, warmup, total steps)
    are the config's, so a warm start with a changed optimizer.lr trains with that lr. A resume
    with an unchanged config gets exactly the saved values back."""
    scheduler.last_epoch = saved["last_epoch"]
    lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    set_scheduler_position(scheduler, saved.get("_step_count", saved["last_epoch"] + 1), lrs)


def _failed(exc: BaseException) -> Future:
    future: Future = Future()
    future.set_exception(_as_error(exc))
    return future


def _as_error(exc: BaseException) -> Exception:
    """torch.distributed.checkpoint's CheckpointException derives from BaseException: wrap it,
    so a failed save (a full disk) is an error to report, never an exit of the process."""
    failures = getattr(exc, "failures", None)  # CheckpointException: {rank: the rank's error}
    if failures:
        rank, failure = next(iter(failures.items()))
        inner = failure[0] if isinstance(failure, tuple) else failure  # (exception, its stack)
        return CheckpointError(f"on rank {rank}: {type(inner).__name__}: {inner}")
    if isinstance(exc, Exception):
        return exc
    return CheckpointError(f"{type(exc).__name__}: {str(exc)[:500]}")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _check_entry(saved, key: str, target: torch.Tensor, path: str) -> None:
    if key not in saved:
        raise CheckpointError(
            f"checkpoint {path} has no {key}: it was saved from a different model (check the model "
            "section of the config against the checkpoint's config.yaml)")
    size = tuple(saved[key].size)
    if size != tuple(target.shape):
        raise CheckpointError(
            f"checkpoint {path}: {key} has shape {size}, but this model's is {tuple(target.shape)}: "
            "it was saved from a different model (check the model section of the config)")
