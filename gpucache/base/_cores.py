"""How many cores this process may use: the one count every default of gpucache starts from.

``usable_cores()`` is the process's CPU affinity (``os.sched_getaffinity``: what ``taskset``,
Slurm's binding or a container's cpuset allow; ``os.cpu_count()`` where there is none: macOS,
Windows), capped by the cgroup's CPU quota when one is set (``docker run --cpus=2``, a Kubernetes
CPU limit: cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``; a fractional
quota counts as the next whole core), at least 1. Reading the quota costs a few small file reads;
anything unreadable or unlimited is no cap.

A leaf: it imports nothing of gpucache's.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

__all__ = ["affinity", "cpu_quota", "usable_cores"]

_CGROUP = Path("/sys/fs/cgroup")
_PROC_CGROUP = Path("/proc/self/cgroup")


def affinity() -> int:
    """Cores the scheduler lets this process run on (``os.cpu_count()`` without affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _cores_of(quota: str | None, period: str | None) -> float | None:
    """``quota / period`` in cores, or None for no limit (``max``, ``-1``) or unreadable."""
    try:
        q, p = int(quota or ""), int(period or "")
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _own_cgroups() -> dict[str, str]:
    """The process's cgroup path by controller (``""`` for cgroup v2's unified one)."""
    out: dict[str, str] = {}
    for line in (_read(_PROC_CGROUP) or "").splitlines():
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        for c in controllers.split(",") if controllers else [""]:
            out[c] = path
    return out


def _dirs(mount: Path, path: str) -> list[Path]:
    """``mount/path`` and each folder above it up to ``mount`` (a limit anywhere above applies;
    in a container the process's path may not exist under its own mount, whose root is its
    cgroup)."""
    here = mount / path.lstrip("/")
    return [here, *(p for p in here.parents if p.is_relative_to(mount))]


def cpu_quota() -> float | None:
    """The tightest CPU quota on this process's cgroups, in cores, or None when unlimited."""
    own = _own_cgroups()
    limits = []
    if "" in own and (_CGROUP / "cgroup.controllers").exists():  # cgroup v2
        for d in _dirs(_CGROUP, own[""]):
            quota, _, period = (_read(d / "cpu.max") or "").partition(" ")
            limits.append(_cores_of(quota, period))
    if "cpu" in own:  # cgroup v1: mounted as cpu, or together with cpuacct
        for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
            if (_CGROUP / name).is_dir():
                for d in _dirs(_CGROUP / name, own["cpu"]):
                    us = _read(d / "cpu.cfs_quota_us")
                    limits.append(_cores_of(us, _read(d / "cpu.cfs_period_us")))
                break
    found = [x for x in limits if x is not None]
    return min(found) if found else None


def usable_cores() -> int:
    """Cores this process may use: its affinity, capped by the cgroup CPU quota (rounded up)."""
    cores, quota = affinity(), cpu_quota()
    return max(1, min(cores, math.ceil(quota))) if quota is not None else cores
