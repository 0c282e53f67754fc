"""14. What a rank's gloo groups cost: two spawned gloo processes that each form a world and 26
more groups over both ranks (as many as a rank of the test suite's shared groups holds after its
layouts), once with torch's default (a gloo device per group) and once as raymp forms them (every
group on the world's one device: raymp.torch_compat.gloo_groups_share), in interleaved rounds.
Each round all-reduces a tensor on every group in turn (the sums prove both moved the same data),
then both ranks sit idle while their own CPU time is read.

    python -m benchmarks.run_all --only gloo --update
"""

from __future__ import annotations

import os
import resource
import time

from benchmarks.common import median, spread
from benchmarks.peers_plain import _spawn

GROUPS = 26
ROUNDS = 20
IDLE_S = 10.0
ELEMENTS = 64 * 1024  # 256 KiB of fp32 per all-reduce


def _polling_threads() -> int:
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                count += f.read().strip() == "gloo_tcp_loop"
        except OSError:
            pass
    return count


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _rank_main(rank: int, world: int, port: int, shared: bool, results) -> None:
    import contextlib

    import torch
    import torch.distributed as dist

    from raymp import torch_compat

    torch.set_num_threads(1)
    devices = torch_compat.new_gloo_devices()
    with torch_compat.gloo_groups_share(devices) if shared else contextlib.nullcontext():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        groups = [dist.new_group(list(range(world))) for _ in range(GROUPS)]
    ends, sums = [], []
    for step in range(ROUNDS):
        total = 0.0
        for i, group in enumerate(groups):
            t = torch.full((ELEMENTS,), float(rank + step + i))
            dist.all_reduce(t, group=group)
            total += float(t[0])
        ends.append(time.time())
        sums.append(total)
    dist.barrier()
    cpu0, t0 = _own_cpu_s(), time.perf_counter()
    time.sleep(IDLE_S)
    idle_share = (_own_cpu_s() - cpu0) / (time.perf_counter() - t0)
    polling = _polling_threads()
    dist.barrier()
    results.put((rank, ends, sums, idle_share, polling))
    for group in groups:
        dist.destroy_process_group(group)
    dist.destroy_process_group()


VARIANTS = {"a device per group (torch's default)": False, "one device per world (raymp)": True}


def measure(opts) -> dict:
    runs: dict[str, list] = {name: [] for name in VARIANTS}
    for _ in range(opts.reps):
        for name, shared in VARIANTS.items():
            runs[name].append(_spawn(_rank_main, 2, (shared,)))
    base = runs["a device per group (torch's default)"]
    rows = []
    for name, rs in runs.items():
        idle = [100 * max(more[0] for more in r["more"]) for r in rs]
        rounds_ms = [median(r["step_times"]) * 1e3 for r in rs]
        polling = max(more[1] for r in rs for more in r["more"])
        same = all(r["losses"] == base[0]["losses"] for r in rs)
        rows.append([name, str(polling), f"{median(idle):.2f}", spread(idle), f"{median(rounds_ms):.1f}",
                     spread(rounds_ms), "yes" if same else "NO"])
    return {
        "title": "14. A rank's gloo groups: a device per group vs one per world",
        "setup": (f"2 spawned gloo processes (1 thread each), a world and {GROUPS} more groups over both ranks; "
                  f"{ROUNDS} rounds, each an all-reduce of {ELEMENTS * 4 // 1024} KiB fp32 on every group in turn, "
                  f"then {IDLE_S:.0f} s idle; {opts.reps} interleaved rounds. Idle CPU: the busier rank's own CPU "
                  "time over the idle wall time. Polling threads: `gloo_tcp_loop` threads in a rank."),
        "columns": ["groups formed with", "polling threads", "idle CPU (% of a core)", "per round",
                    "all-reduce round (ms, median)", "per round", "same sums"],
        "rows": rows,
        "raw": {name: [{"round_s": r["step_times"], "sums": r["losses"],
                        "idle_share": [more[0] for more in r["more"]]} for r in rs] for name, rs in runs.items()},
        "notes": [
            "Each gloo device has a thread that wakes every 10 ms to poll its sockets, idle or not; torch "
            "gives every group its own device, raymp's ranks give every group of a world the same one "
            "(docs/design.md). The groups keep their own connections and tags either way.",
        ],
    }
