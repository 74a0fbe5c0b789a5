"""How many CPU threads the engine computes with: torch's intra-op threads, which the C++ kernels'
pool uses too (kernels/native.py, `threads`), so one number sets both.

OpenMP's threads spin at every barrier of every op. When another thread needs one of their cores
(the server's event loop writing a stream, tokenizing a prompt, or another process), a step waits
for the thread that lost its core, many times per step: on the 2-core VM of benches/README.md
(section 'CPU threads') four streams ran 4-12x slower with 2 threads than with 1. So the default
leaves one usable core to the rest of the process: the usable cores minus one, at least 1.
`--cpu-threads N` sets the number, and so does an OMP_NUM_THREADS the user exported (the test
fixtures export 1).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "QUOTA PERIOD" or "max PERIOD"


@dataclass(frozen=True)
class ThreadChoice:
    threads: int | None  # None: leave torch's own choice (OMP_NUM_THREADS is set)
    reason: str


def cgroup_cpu_limit(path: Path = CGROUP_CPU_MAX) -> float | None:
    """The CPUs a cgroup v2 quota allows this process (a container's --cpus), or None."""
    try:
        quota, period = path.read_text().split()[:2]
        if quota == "max":
            return None
        return int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def usable_cores(cpu_limit: float | None = None) -> int:
    """The cores this process may run on: its CPU affinity (taskset, cpusets), within a CPU quota
    (`cpu_limit`, default the cgroup's); a fraction of a core counts as none, at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # (not on every platform)
        cores = os.cpu_count() or 1
    limit = cgroup_cpu_limit() if cpu_limit is None else cpu_limit
    if limit is not None:
        cores = min(cores, math.floor(limit))
    return max(1, cores)


def choose_cpu_threads(
    requested: int | None,
    *,
    environ: dict[str, str] | None = None,
    cores: int | None = None,
    ranks: int = 1,
) -> ThreadChoice:
    """The thread count of each of the engine's `ranks` processes (tensor parallelism runs one a
    rank, each with this many threads): `requested` (--cpu-threads) if given, torch's own choice
    if OMP_NUM_THREADS is set, else the usable cores minus one, shared among the ranks (at least
    1 each: ranks that together spin more threads than there are cores wait on each other at
    every barrier)."""
    env = os.environ if environ is None else environ
    if requested is not None:
        return ThreadChoice(int(requested), "--cpu-threads")
    if env.get("OMP_NUM_THREADS", "").strip():
        return ThreadChoice(None, f"OMP_NUM_THREADS={env['OMP_NUM_THREADS'].strip()}")
    n = usable_cores() if cores is None else cores
    reason = f"default: {n} usable core(s), one left to the rest of the process"
    if ranks > 1:
        reason += f", the rest shared by {ranks} tensor-parallel ranks"
    return ThreadChoice(max(1, (n - 1) // ranks), reason)
