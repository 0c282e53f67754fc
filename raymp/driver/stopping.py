"""Stopping a run without losing its last save. The first Ctrl-C or SIGTERM (`ray job stop`)
ends the step loop; while the save in flight is then committed, a second one (people press twice,
a supervisor repeats its signal) is noted, not obeyed: obeying it left written shards without the
marker that makes them a checkpoint."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def stop_signals_held(say, doing: str):
    """Within the block, SIGINT and SIGTERM print a line instead of interrupting `doing`. Signal
    handlers belong to the main thread: elsewhere (a notebook's worker thread) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def note(signum, frame):
        say(f"raymp: {signal.Signals(signum).name} received while {doing}; stopping once that is done")

    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    for s in STOP_SIGNALS:
        signal.signal(s, note)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)


def stop_on_signals() -> None:
    """SIGTERM (`ray job stop`, a scheduler's preemption) ends a run as Ctrl-C does: the save in
    flight is committed, the MLflow run marked KILLED, the actors released. Call it after Ray is
    connected: ray.init puts in its own SIGTERM handler, which would end the driver mid-step.

    SIGINT gets Python's own handler back even where the process started with it ignored: a
    command started in the background by a non-interactive shell (`raymp train ... &` in a script,
    CI) inherits SIGINT ignored, and Python then leaves it so, which made `kill -INT` and Ctrl-C do
    nothing and the run train to its end."""
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt
