"""A rank's own time: how long its training thread ran on a CPU or waited, runnable, for one.
A step's wall time is the same on every rank (their collectives line them up), so it cannot say
which rank the others wait for; the time a rank was blocked (in a collective, on data) is not its
own, and what is left is: a rank slowed by its own work (more CPU) or by a busy core (a longer run
queue) shows a larger own time than its peers (raymp.driver.stragglers). Linux's per-thread
schedstat gives both parts; elsewhere the thread's CPU time alone."""

from __future__ import annotations

import time

_SCHEDSTAT = "/proc/thread-self/schedstat"  # "<ns on a CPU> <ns runnable, waiting for one> <slices>"


def own_time_s() -> float:
    """The calling thread's CPU time plus its run-queue wait so far, in seconds."""
    try:
        with open(_SCHEDSTAT) as f:
            on_cpu, waiting, _ = f.read().split()
    except (OSError, ValueError):
        return time.thread_time()
    return (int(on_cpu) + int(waiting)) / 1e9
