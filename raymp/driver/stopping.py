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
    flight is committed, the MLflow run marked KILLED, the actors released. ray.init puts in its
    own SIGTERM handler (a stack dump, then an abort); raymp.ray_connection.connect puts this one
    back after it, so it may be called before Ray is connected.

    SIGINT gets a handler (Python's own behaviour) even where the process started with it ignored: a
    command started in the background by a non-interactive shell (`raymp train ... &` in a script,
    CI) inherits SIGINT ignored, and Python then leaves it so, which made `kill -INT` and Ctrl-C do
    nothing and the run train to its end."""
    for s in STOP_SIGNALS:
        signal.signal(s, _raise_interrupt)


# The signal that stopped this process (stop_on_signals' handler records it): libraries between the
# handler and the command (Ray Tune's fit) may raise a KeyboardInterrupt of their own in its place.
_stopped_by: int = signal.SIGINT


def stop_signal() -> signal.Signals:
    """The signal that stopped this process (SIGINT where none was recorded)."""
    return signal.Signals(_stopped_by)


def _raise_interrupt(signum, frame):
    global _stopped_by
    _stopped_by = signum
    raise KeyboardInterrupt
