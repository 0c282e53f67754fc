"""Where a run's MLflow store is, and whether it can be used, asked before anything starts.

Without this, a URI of an unknown scheme failed with MLflow's traceback after the actors were up
(~50 s in), and an unreachable server kept a run silent for minutes (MLflow retries each call with
back-off) before a chained traceback. A reader (`raymp runs`) never creates a store it expected
to find."""

from __future__ import annotations

import logging
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

from raymp.config import ConfigError
from raymp.logs import MLFLOW_DB_SETUP, quiet_loggers
from raymp.storage import default_tracking_uri

FIELD = "tracking.tracking_uri"


def tracking_uri(cfg) -> str:
    """The run's MLflow store: tracking.tracking_uri, else the sqlite file under output_dir."""
    if cfg.tracking.tracking_uri:
        return cfg.tracking.tracking_uri
    try:
        return default_tracking_uri(cfg.output_dir)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def check_tracking_store(uri: str, timeout_s: float, reading: bool = False) -> None:
    """ConfigError, one line naming the field and the fix, unless MLflow can use `uri`: a server
    answers within `timeout_s` (tracking.connect_timeout_s), a database to read exists, a scheme
    is one MLflow knows."""
    scheme = urlparse(uri).scheme
    if scheme in ("http", "https"):
        _check_server(uri, timeout_s)
        return
    if scheme == "sqlite":
        database = Path(uri[len("sqlite:///"):] if uri.startswith("sqlite:///") else uri)
        if reading and not database.exists():
            raise ConfigError(
                f"no MLflow database at {database}: runs are recorded there by `raymp train` with "
                f"this output_dir ({FIELD} unset) or this {FIELD}; pass --tracking-uri for another"
            )
        if not reading:
            _check_writable_dir(database.parent)
        return  # MLflow creates the database when the run starts, not before (a failing start leaves none)
    _check_with_mlflow(uri)


def _check_server(uri: str, timeout_s: float) -> None:
    health = uri.rstrip("/") + "/health"  # what `mlflow server` answers without a query
    try:
        with urllib.request.urlopen(health, timeout=timeout_s):
            return
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            return  # a server that wants credentials: MLflow takes them from MLFLOW_TRACKING_TOKEN etc.
        problem = f"answered {exc.code} at /health"
    except (urllib.error.URLError, OSError) as exc:
        problem = f"did not answer ({getattr(exc, 'reason', exc)}; waited at most {timeout_s:g} s)"
    raise ConfigError(f"{FIELD} {uri}: the MLflow server {problem}; start it (`mlflow server --host 0.0.0.0 "
                      "--port 5000 ...`), fix the address, raise tracking.connect_timeout_s, or set "
                      "tracking.enabled=false")


def _check_writable_dir(directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"{FIELD}: cannot create the MLflow database's directory {directory} ({exc.strerror}); "
            "set output_dir or tracking.tracking_uri to a writable place"
        ) from None


def _check_with_mlflow(uri: str) -> None:
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    try:
        with quiet_loggers(*MLFLOW_DB_SETUP, level=logging.WARNING):  # a new SQL store's set-up
            MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
    except MlflowException as exc:
        reason = (f"it has no store for {urlparse(uri).scheme}:// URIs" if "unsupported URI" in str(exc)
                  else str(exc).strip().split(". ")[0])
        raise ConfigError(f"{FIELD} {uri}: MLflow cannot use it ({reason}); use sqlite:///<path>.db, "
                          "http(s)://<server>, or leave it unset for the store under output_dir") from None
