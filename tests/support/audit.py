"""Counting what a process does to a data folder: ``os.stat`` calls and directory scans.

Used by the one-scan-per-node test and benchmark, in each rank's process."""

from __future__ import annotations

import os
import sys


def count_listing_calls(root: str) -> dict[str, int]:
    """From now on, count ``os.stat`` calls and ``os.scandir`` scans on paths under ``root``.

    Returns the live counts (``{"stat": n, "scandir": n}``). Scans are seen through Python's audit
    events; stats through a wrapper of ``os.stat`` (it raises no audit event)."""
    counts = {"stat": 0, "scandir": 0}

    def audit(event, args):
        if event == "os.scandir" and os.fsdecode(args[0] or ".").startswith(root):
            counts["scandir"] += 1

    sys.addaudithook(audit)
    real_stat = os.stat

    def stat(path, *a, **kw):
        if isinstance(path, (str, bytes, os.PathLike)) and os.fsdecode(path).startswith(root):
            counts["stat"] += 1
        return real_stat(path, *a, **kw)

    os.stat = stat
    return counts
