"""Connecting to Ray: the cluster this process runs in (ray job submit sets RAY_ADDRESS), an
explicit address, or a fresh local instance sized for the run. A module of its own, beside no
subpackage: data preparation and the trainer both connect, and neither may import the other."""

from __future__ import annotations

import os
import signal
import sys
import threading

import ray

from raymp.logs import RAY_LOCAL_START, quiet_loggers


class RayStartError(RuntimeError):
    """A local Ray instance did not start (its raylet or GCS did not come up in time)."""


def _cluster_address(address: str | None) -> str | None:
    """The cluster to join: the one given, else the one this process runs in (ray job submit)."""
    return address or os.environ.get("RAY_ADDRESS") or None


def starts_local(address: str | None) -> bool:
    """Whether connect(address, ...) would start a local instance (none joined yet, no address)."""
    return not ray.is_initialized() and _cluster_address(address) is None


def connect(address: str | None, min_cpus: float) -> None:
    """Join the cluster (ray.init), or start a local instance with at least `min_cpus` logical CPUs."""
    if ray.is_initialized():
        return
    address = _cluster_address(address)
    kept = _python_stop_handlers()
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        # A local instance: logical CPUs are oversubscribed if the run asks for more actors than
        # cores (each actor then runs 1 thread), so a 2-core laptop can still run dp=4.
        cpus = max(os.cpu_count() or 1, int(min_cpus + 0.999))
        # A Ray of its own, even while another instance runs on this machine (a plain ray.init()
        # would join that one, or refuse num_cpus).
        with quiet_loggers(*RAY_LOCAL_START):
            try:
                ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=True)
            except Exception as exc:  # the machine's state, not the run's: one line, no traceback
                raise RayStartError(
                    f"Ray could not start a local instance ({str(exc).strip().splitlines()[0]}); on "
                    "a busy machine Ray's own 30 s start-up bound (not a setting) can pass: try again "
                    "when the load is lower, or join a running cluster with resources.address (or "
                    "RAY_ADDRESS)") from exc
    for signum, handler in kept.items():
        signal.signal(signum, handler)
    _kernel_ends_on_sigterm()


def _python_stop_handlers() -> dict:
    """The SIGINT and SIGTERM handlers this process set in Python before connecting (the CLI's
    stop handler, driver.stopping.stop_on_signals), to put back after ray.init: it gives SIGTERM to
    abseil's failure handler, which prints a stack dump and aborts (exit 134), so a SIGTERM while
    the run is set up (data prepared, actors started) would be a crash instead of a stop."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    return {s: h for s, h in handlers.items() if callable(h) and h is not signal.default_int_handler}


def _kernel_ends_on_sigterm() -> None:
    """In a Jupyter kernel, SIGTERM ends the process at once. ray.init gives SIGTERM to abseil's
    failure handler, which prints a stack dump (twice: stderr and Ray's log) before Ray's own
    graceful exit; and a kernel is sent SIGTERM exactly when it has not exited within seconds of
    its shutdown request (jupyter_client's shutdown_wait_time), as Ray's teardown of a local
    instance on a busy machine does not. The local instance's processes end with the kernel
    (Ray's reaper); a command-line run keeps its own handler (driver.stopping.stop_on_signals)."""
    if "ipykernel" in sys.modules and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(128 + signum))
