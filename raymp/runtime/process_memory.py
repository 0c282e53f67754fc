"""This process's memory as the kernel counts it (Linux /proc), and the one allocator setting
that keeps freed gather buffers from staying resident. Used by the worker's memory reports and by
the scale benchmark's per-actor cap."""

from __future__ import annotations

import ctypes
import gc
import resource

import torch


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak_rss() -> int | None:
    """Reset the kernel's peak-RSS mark (Linux: clear_refs 5) and return the RSS now, in
    bytes; None where that is not available."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return status_kib("VmRSS") * 1024
    except OSError:
        return None


def peak_rss() -> int:
    return status_kib("VmHWM") * 1024


def peak_memory(device: torch.device) -> int:
    """The step report's peak: CUDA's allocator peak on a GPU, else this process's peak RSS."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def return_large_buffers_to_os() -> None:
    """Fix glibc's mmap threshold at 1 MiB (Linux/glibc only; elsewhere nothing to do).

    glibc raises the threshold to up to 32 MiB after the first large buffer is freed; from then on
    the gathered parameters and gradients ZeRO-3 makes and frees every block come from the heap
    and stay resident after free. Measured (benchmarks/scale.py's ladder, 23.7M parameters, two
    gloo ranks under FSDP2): peak RSS growth over two steps 580 MiB with the default, 215 MiB with
    the threshold fixed, for 135 MiB of model state. It costs time: every buffer of 1 MiB or more
    is mapped and faulted in anew each step, so it is a setting (resources.return_freed_memory),
    off by default; docs/design.md gives the trade."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def freeze_what_is_here() -> None:
    """Leave every object that exists now out of all later garbage collections. Called once an
    actor has imported torch, Ray and Ray Data: ~390,000 objects, nearly all there for good, which
    a full collection scanned in 0.15 s, on the survivors' path after a loss (the worker drops its
    model with one) and in Python's own gen-2 passes mid-step."""
    gc.collect()
    gc.freeze()
