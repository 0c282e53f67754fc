"""DCP's checkpoint writer process (checkpoint.async_save: process): started by raymp rather than
by torch, and closed when the ranks it was made for change.

torch (2.13) starts one writer per training process at the first process-based save and keeps it
in a module global, with a gloo world of its own sized to the ranks of that save; it has no public
call to start or close it. What raymp needs differently: the writer's INFO log lines (four per save
per rank) kept out of the actor's stderr, which Ray prints on the driver, and a closed writer once
survivors re-form their group (it would wait on writers that are gone)."""

from __future__ import annotations

import os
import sys
import tempfile

import ray
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from raymp.torch_compat import dcp_writer_process, forget_dcp_writer_process, start_dcp_writer_process

# checkpoint.async_save -> who writes. A process keeps serialization off the training process's GIL.
WRITERS = {True: AsyncCheckpointerType.THREAD, "process": AsyncCheckpointerType.PROCESS}


def start_writer_process(group) -> None:
    """Start DCP's writer process now (every rank at once: the children form a gloo world), with
    its stderr in a log file. torch would start it at the first save with the actor's stderr, and
    the child logs at INFO on every save (four lines per rank), which Ray prints on the driver."""
    if dcp_writer_process() is not None:
        return
    log_path = os.path.join(_log_dir(), f"raymp-checkpoint-writer-{os.getpid()}.log")
    sys.stderr.flush()
    kept = os.dup(2)
    try:
        with open(log_path, "ab") as log:
            os.dup2(log.fileno(), 2)  # what the child inherits; this process's own is put back below
            start_dcp_writer_process(group)
    finally:
        os.dup2(kept, 2)
        os.close(kept)


def _log_dir() -> str:
    """Ray's log directory of this node's session (where `ray logs` and the dashboard find it, and
    which goes with the session), or the temp directory outside Ray."""
    if not ray.is_initialized():
        return tempfile.gettempdir()
    context = ray.get_runtime_context()
    path = os.path.join(context.get_temp_dir(), context.get_session_name(), "logs")
    return path if os.path.isdir(path) else tempfile.gettempdir()


def close_writer_process() -> None:
    """End DCP's checkpoint writer process (async_save: process), if this process started one. It
    joined a gloo world of its own at its first save, sized to the ranks then: once they change
    (survivors re-forming their group) it would wait on writers that are gone. torch keeps it in a
    module global and has no public way to close it."""
    process = dcp_writer_process()
    if process is not None:
        forget_dcp_writer_process()
        process.__del__()  # asks it to stop, terminates it after 5 s
