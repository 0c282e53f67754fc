"""What a run finds at start in its checkpoint.dir, said once: the lineage it continues (damaged
checkpoints passed over, a rewind's abandoned timeline), and what a resume restores."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import raymp.storage as storage
from raymp.checkpoint.lineage import Lineage, config_overrides
from raymp.checkpoint.store import Checkpoint, CheckpointStore
from raymp.config import ConfigError, RunConfig
from raymp.layout import Layout
from raymp.tracking_store import check_tracking_store, tracking_uri


def check_destinations(cfg: RunConfig) -> None:
    """Where the run will write, checked before anything starts, so a bad place fails in a second
    with one line and leaves nothing behind: output_dir, data.cache_dir (a directory, if it
    exists), a checkpoint.dir of its own (writable, when the run saves), and the tracking store."""
    for field, value in (("output_dir", cfg.output_dir), ("checkpoint.dir", cfg.checkpoint.dir)):
        if value is not None and _in_a_jobs_working_dir_copy(value):
            raise ConfigError(
                f"{field} {value!r} is inside Ray's copy of the job's working directory "
                f"({Path.cwd()}), which Ray deletes after the job: the run's results (checkpoints, "
                f"the MLflow database, the prepared data) would be lost; set {field} to durable "
                f"storage, e.g. --set {field}=/mnt/shared/runs (a path every node reaches) or an "
                "s3:// / gs:// URI"
            )
    try:
        storage.check_writable(cfg.output_dir)
    except Exception as exc:  # OSError locally; each object store raises its own kind
        raise ConfigError(
            f"output_dir {cfg.output_dir} is not writable ({getattr(exc, 'strerror', None) or exc}); "
            "set output_dir to a directory this user can write, or storage these credentials "
            "reach"
        ) from None
    fs, cache = storage.fsspec_fs(cfg.data.cache_dir)
    if fs.exists(cache) and not fs.isdir(cache):
        raise ConfigError(
            f"data.cache_dir {cfg.data.cache_dir} is a file, not a directory; set data.cache_dir to "
            "a directory (it is made if missing), or move the file away"
        )
    if cfg.checkpoint.every and cfg.checkpoint.dir is not None:  # the run's own dir is checked at its lineage
        CheckpointStore(cfg.checkpoint.dir, cfg.checkpoint.keep_last).probe_writable()
    if cfg.tracking.enabled:
        check_tracking_store(tracking_uri(cfg), cfg.tracking.connect_timeout_s)


def _in_a_jobs_working_dir_copy(path: str) -> bool:
    """Whether `path` lands in the copy of a `ray job submit --working-dir` that Ray unpacks for
    the job (<session>/runtime_resources/working_dir_files/...) and removes after it: a relative
    path in a submitted job's entrypoint does. Every such copy lives under that directory."""
    return not storage.is_uri(path) and "runtime_resources" in Path(storage.absolute(path)).parts


@contextmanager
def removed_if_setup_fails(run_dir: str):
    """A set-up that fails (no room for the actors, a model too large) leaves no empty run
    directory behind; whatever was written into it stays."""
    try:
        yield
    except BaseException:
        for directory in (storage.join(run_dir, "checkpoints"), run_dir):
            storage.remove_if_empty(directory)
        raise


def open_lineage(cfg: RunConfig, run_dir: str, log, data_position=None) -> Lineage:
    """The checkpoint.dir's lineage; `data_position` (a start without a checkpoint) only when it has
    none. `log` says what is passed over (damaged, or abandoned by a rewind): whatever the progress
    setting, so the caller's must always print."""
    storage.make_dirs(run_dir)
    store = CheckpointStore(
        cfg.checkpoint.dir or storage.join(run_dir, "checkpoints"), cfg.checkpoint.keep_last
    )
    if cfg.checkpoint.every:
        store.probe_writable()  # a read-only dir fails now, not at the first save
    lineage = Lineage.open(store, cfg.checkpoint.resume)
    for entry in store.scan():
        if entry.problem:
            log(f"checkpoint: step {entry.step} is damaged, passed over: {entry.problem}")
    if lineage.abandoned():
        log(
            f"checkpoint: rewound to step {lineage.rewound_from}: the newer checkpoints of the "
            f"abandoned timeline (steps {[c.step for c in lineage.abandoned()]}) are never loaded "
            "by this run, and move to <checkpoint.dir>/abandoned-<time>/ at its first save"
        )
    if lineage.candidates() and data_position is not None:
        raise ValueError("give a data_position or a checkpoint to resume from, not both "
                         "(set checkpoint.resume=never to use the data position)")
    return lineage


def say_resume(resume: Checkpoint, cfg: RunConfig, log) -> None:
    """One line on what a resume restores, and each setting the config changes against it."""
    log(
        f"resuming from {resume.path} (step {resume.step}, saved with "
        f"{Layout.from_record(resume.meta['layout']).text()}): weights, optimizer state, LR "
        "schedule position and data position restored"
    )
    for change in config_overrides(resume.meta.get("config", {}), cfg):
        log(f"resume: the config's {change}")
    if resume.step >= cfg.train.steps:
        log(f"that checkpoint already completes train.steps={cfg.train.steps}: nothing to train; raise "
            "train.steps to go on, or set checkpoint.resume=never and another checkpoint.dir to start over")
