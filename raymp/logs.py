"""What raymp keeps out of its users' output: start-up lines of Ray and MLflow that say nothing a
user can act on. They are lowered for the moment they are printed, not removed: Ray's session logs
keep Ray's."""

from __future__ import annotations

import logging
from contextlib import contextmanager

# Ray, starting an instance private to this process: that token auth is on (the right default for
# it), that it started, and each time a busy machine's raylet has not yet registered with the GCS.
RAY_LOCAL_START = ("ray._private.authentication.authentication_token_setup", "ray._private.worker",
                   "ray._private.node")
# MLflow, creating an embedded database: its table set-up, at INFO on MLflow's own handler.
MLFLOW_DB_SETUP = ("mlflow.store.db.utils",)
# MLflow's system-metrics monitor says at INFO that it started, stops, stopped, and skips GPUs.
MLFLOW_SYSTEM_METRICS = ("mlflow.system_metrics.system_metrics_monitor",)


@contextmanager
def quiet_loggers(*names: str, level: int = logging.ERROR):
    """Within the block, the named loggers pass only `level` and above."""
    loggers = [logging.getLogger(n) for n in names]
    before = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(level)
    try:
        yield
    finally:
        for lg, was in zip(loggers, before):
            lg.setLevel(was)
