"""Proportional set size (PSS) of a process tree: how memory is measured in tests and benchmarks.

RSS counts a shared page in every process that maps it; PSS splits it among them, so the PSS summed
over a parent and its workers counts each page once. That is what "copies held" is built on.
"""

from __future__ import annotations

import os

import psutil


def pss(pid: int) -> int:
    """PSS of one process in bytes (``/proc/PID/smaps_rollup`` through psutil)."""
    return psutil.Process(pid).memory_full_info().pss


def tree_pss(pid: int | None = None) -> int:
    """Summed PSS of ``pid`` (default: this process) and all its descendants."""
    root = psutil.Process(pid or os.getpid())
    total = 0
    for p in [root, *root.children(recursive=True)]:
        try:
            total += p.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total
