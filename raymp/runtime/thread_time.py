"""A rank's own time: how long its training thread ran on a CPU or waited, runnable, for one.
A step's wall time is the same on every rank (their collectives line them up), so it cannot say
which rank the others wait for; the time a rank was blocked (in a collective, on data) is not its
own, and what is left is: a rank slowed by its own work (more CPU) or by a busy core (a longer run
queue) shows a larger own time than its peers (raymp.driver.stragglers). Linux's per-thread
schedstat gives both parts; elsewhere the thread's CPU time alone."""

from __future__ import annotations

import os
import threading
import time

_OPEN: dict[int, int] = {}  # thread id -> its schedstat, open: a read is then one pread (~3 us)


def own_time_s() -> float:
    """The calling thread's CPU time plus its run-queue wait so far, in seconds."""
    tid = threading.get_native_id()
    for _ in range(2):  # a second try reopens: a thread id reused after its thread ended
        try:
            if tid not in _OPEN:
                # "<ns on a CPU> <ns runnable, waiting for one> <time slices>"
                _OPEN[tid] = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
            on_cpu, waiting, _ = os.pread(_OPEN[tid], 128, 0).split()
            return (int(on_cpu) + int(waiting)) / 1e9
        except (OSError, ValueError):
            if (fd := _OPEN.pop(tid, None)) is not None:
                os.close(fd)
    return time.thread_time()
