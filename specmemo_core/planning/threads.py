"""How many torch threads to run on a CPU: the cores this process may really use, minus the busy ones.

torch's default (one thread per physical core of the machine) ignores CPU affinity, the
container's CPU quota and other programs' load; on a 2-core machine under background load
the self-test ran 1.2 tokens/s with 2 threads and 9.8 with 1. ``choose_threads`` is a pure
function of ``CpuReadings``; ``read_cpu`` takes the readings from the running system.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class CpuReadings:
    allowed: int  # logical CPUs this process may run on (sched_getaffinity)
    machine: int  # logical CPUs of the machine (the load average is over all of them)
    physical: int  # physical cores of the machine (hyperthreads share a core's arithmetic units)
    quota: float | None  # the cgroup's CPU quota in cores; None: unlimited
    load: float  # runnable processes, 1-minute average, machine-wide (os.getloadavg()[0])


def choose_threads(cpu: CpuReadings) -> int:
    """Threads for torch: the usable cores (affinity, one per physical core, the quota) less
    the share of the machine's load that falls on them, rounded to the nearest; at least 1."""
    allowed = max(cpu.allowed, 1)
    machine = max(cpu.machine, allowed)
    usable = allowed * min(1.0, max(cpu.physical, 1) / machine)  # hyperthread pairs count once
    if cpu.quota is not None and cpu.quota > 0:
        usable = min(usable, cpu.quota)
    busy = max(cpu.load, 0.0) * allowed / machine  # others' load, spread evenly over the machine
    return max(1, min(math.floor(usable), math.floor(usable - busy + 0.5)))


def quota_from_cgroup_v2(cpu_max: str) -> float | None:
    """``cpu.max`` reads "max 100000" (no limit) or "200000 100000" (2 cores)."""
    parts = cpu_max.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    return _cores(parts[0], parts[1])


def quota_from_cgroup_v1(quota_us: str, period_us: str) -> float | None:
    """``cpu.cfs_quota_us`` is -1 without a limit."""
    return _cores(quota_us.strip(), period_us.strip())


def _cores(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii", errors="replace")
    except OSError:
        return None


def read_quota(root: Path = CGROUP_ROOT) -> float | None:
    """The CPU quota of this process's cgroup (v2, else v1), in cores; None when unlimited or unknown."""
    v2 = _read(root / "cpu.max")
    if v2 is not None:
        return quota_from_cgroup_v2(v2)
    for folder in (root / "cpu", root / "cpu,cpuacct"):
        quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
        if quota is not None and period is not None:
            return quota_from_cgroup_v1(quota, period)
    return None


def read_cpu() -> CpuReadings:
    """The readings of the running system (no waiting: the load is the kernel's running average)."""
    import psutil

    try:
        allowed = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS and Windows have no sched_getaffinity
        allowed = os.cpu_count() or 1
    machine = os.cpu_count() or allowed
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # Windows: psutil emulates it (zero for its first seconds)
        load = psutil.getloadavg()[0]
    return CpuReadings(allowed=allowed, machine=machine, physical=psutil.cpu_count(logical=False) or machine,
                       quota=read_quota(), load=load)


def apply_threads(requested: int = 0) -> int:
    """Set torch's thread count before a model loads: ``requested`` when above 0, else
    ``choose_threads(read_cpu())``. Returns the count set."""
    import torch

    count = requested if requested > 0 else choose_threads(read_cpu())
    torch.set_num_threads(count)
    return count
