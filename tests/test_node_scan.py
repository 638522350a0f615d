"""The ranks of a node scan and stat the listing once between them, not once each.

Three rank processes (LOCAL_RANK 0-2 of LOCAL_WORLD_SIZE=3, what torchrun sets) open an unchanged
store. Each counts what it did to the data folder: directory scans through Python's audit events
(``os.scandir``, which ``os.walk`` raises per folder) and ``os.stat`` calls on paths under it
(through a counting wrapper around the real call). benchmarks/node_scan.py measures the same
for 100,000 files under a real torchrun job with strace.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from gpucache import JpegCache
from gpucache.testing import make_jpeg_bytes

REPO = Path(__file__).resolve().parent.parent
RANKS, CLASSES, PER_CLASS = 3, 4, 30

RANK = """
import json, os, sys
root, cdir = sys.argv[1], sys.argv[2]
from tests.support.audit import count_listing_calls
counts = count_listing_calls(root)
from gpucache import JpegCache
cache = JpegCache.from_folder(root, cache_dir=cdir, progress=False)
print(json.dumps({**counts, "path": str(cache.path), "n": len(cache)}), flush=True)
"""


def _job(root: Path, cdir: Path, ranks: int = RANKS) -> list[dict]:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(root), str(cdir)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={
                **os.environ,
                "PYTHONPATH": str(REPO),
                "LOCAL_RANK": str(r),
                "LOCAL_WORLD_SIZE": str(RANKS),
            },
        )
        for r in range(ranks)
    ]
    outs = [p.communicate(timeout=400) for p in procs]  # torch import: slow on a loaded machine
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    return [json.loads(out.splitlines()[-1]) for out, _ in outs]


def test_ranks_scan_and_stat_an_unchanged_listing_once_per_node(tmp_path):
    root, cdir = tmp_path / "imgs", tmp_path / "c"
    jpeg = make_jpeg_bytes(16, 16, seed=1)
    for c in range(CLASSES):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(PER_CLASS):
            (root / f"c{c}" / f"{i:03d}.jpg").write_bytes(jpeg)
    n = CLASSES * PER_CLASS
    built = JpegCache.from_folder(root, cache_dir=cdir, progress=False)  # the store exists

    ranks = _job(root, cdir)
    assert {r["path"] for r in ranks} == {str(built.path)} and {r["n"] for r in ranks} == {n}
    stats, scans = (sum(r[k] for r in ranks) for k in ("stat", "scandir"))
    assert n <= stats < 2 * n, stats  # each file once on the node; before: 3 n, once per rank
    assert 1 + CLASSES <= scans < 2 * (1 + CLASSES), scans  # the root and each class folder

    # a later job after a change: scans again (never takes the earlier job's key) and rebuilds
    touched = root / "c0" / "000.jpg"
    os.utime(touched, ns=(time.time_ns(), time.time_ns() + 10**9))
    (later,) = _job(root, cdir, ranks=1)
    assert later["stat"] >= n and later["path"] != str(built.path) and later["n"] == n
