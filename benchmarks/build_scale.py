"""Build cost at scale: time, files/s and memory of ``JpegCache.from_folder`` on N small JPEGs.

Writes N real JPEGs (about 3 KB each, 80x60, a pool of 1,000 distinct encodes) into 1,000 class
folders once (``--root``, default ``$TMPDIR/gpucache-build-scale``), then builds each N in a fresh
process, ``--repeat`` times after one untimed warm-up build (warm page cache), and reports medians:

- build s and files/s of the whole ``from_folder`` call (scan, size, read, sniff, pack), and the
  CPU seconds it used (user + system, all threads: the figure to compare on a loaded machine);
- peak beyond the data: the build process's RSS high-water mark (``VmHWM``, reset through
  ``/proc/self/clear_refs`` just before the build) minus its RSS before the build minus the data
  bytes, per sample. RSS, not PSS: Linux keeps no PSS high-water mark; a single process's private
  and shared-anonymous pages count the same in both;
- left after: PSS of the process with the store alive minus PSS before, minus the data, per sample.

Every build is checked: N samples, the summed size of the files, sample bytes equal to their files.

    nice -n 10 python benchmarks/build_scale.py --sizes 10000,100000 --repeat 3
    nice -n 10 python benchmarks/build_scale.py --sizes 100000 --src /tmp/old-tree  # another tree
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # benchmarks._record
from benchmarks._record import run_info, run_line, write_json  # noqa: E402

CLASSES = 1000
POOL = 1000

CHILD = r"""
import ctypes, gc, json, os, sys, time
import numpy as np
from gpucache import JpegCache

def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))

def pss():
    with open("/proc/self/smaps_rollup") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("Pss:"))

root, n, threads, rst = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
kw = {"num_threads": int(threads)} if threads != "0" else {}
if rst:
    kw["restart_markers"] = True
gc.collect()
ctypes.CDLL(None).malloc_trim(0)  # the baseline without freed heap: what the build adds is counted
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM to the current RSS
rss0, pss0 = status("VmRSS"), pss()
t0, c0 = time.perf_counter(), time.process_time()
cache = JpegCache.from_folder(root, progress=False, **kw)
dt, cpu = time.perf_counter() - t0, time.process_time() - c0
hwm, pss1 = status("VmHWM"), pss()
assert len(cache) == n, (len(cache), n)
for i in (0, n // 2, n - 1):  # the stored bytes are the files' bytes
    with open(cache.paths[i], "rb") as f:
        assert rst or bytes(cache[i]) == f.read(), cache.paths[i]
print(json.dumps({"n": n, "s": dt, "cpu_s": cpu, "data": cache.nbytes, "peak_beyond": hwm - rss0 - cache.nbytes,
                  "left_beyond": pss1 - pss0 - cache.nbytes}))
"""


def make_tree(root: Path, n: int) -> Path:
    """``root/n<N>/c<k>/<i>.jpg`` for i < n, sample i in class i % 1000; made once, reused."""
    tree = root / f"n{n}"
    if (tree / ".complete").exists():
        return tree
    from gpucache.testing import make_jpeg_bytes

    pool = [make_jpeg_bytes(80, 60, seed=k, quality=85) for k in range(POOL)]
    for c in range(CLASSES):
        (tree / f"c{c:03d}").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (tree / f"c{i % CLASSES:03d}" / f"{i:07d}.jpg").write_bytes(pool[i % POOL])
    (tree / ".complete").write_text("")
    return tree


def build_once(tree: Path, n: int, src: Path, threads: int, rst: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=str(src))
    run = subprocess.run(
        [sys.executable, "-c", CHILD, str(tree), str(n), str(threads), "1" if rst else "0"],
        env=env,
        capture_output=True,
        text=True,
        cwd=tree,
    )  # not the repository: "" on sys.path must not shadow src
    if run.returncode:
        raise RuntimeError(f"build of {tree} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="10000,100000", help="comma list of N")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--root", type=Path, default=Path(tempfile.gettempdir()) / "gpucache-build-scale"
    )
    ap.add_argument("--src", type=Path, default=REPO, help="the gpucache tree to import")
    ap.add_argument("--threads", type=int, default=0, help="num_threads (0: the default)")
    ap.add_argument("--restart-markers", action="store_true")
    ap.add_argument("--json", type=Path, help="write the rows here too")
    args = ap.parse_args()
    run = run_info()
    print(run_line())
    rows = []
    print(f"load: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}; src {args.src}")
    print("| N | build s (files/s) | CPU s | peak beyond the data | left after |")
    print("|---|---|---|---|---|")
    for n in (int(x) for x in args.sizes.split(",")):
        tree = make_tree(args.root, n)
        build_once(tree, n, args.src, args.threads, args.restart_markers)  # warm-up
        runs = [
            build_once(tree, n, args.src, args.threads, args.restart_markers)
            for _ in range(args.repeat)
        ]
        s = statistics.median(r["s"] for r in runs)
        cpu = statistics.median(r["cpu_s"] for r in runs)
        peak = statistics.median(r["peak_beyond"] for r in runs)
        left = statistics.median(r["left_beyond"] for r in runs)
        row = {
            "n": n,
            "s": s,
            "cpu_s": cpu,
            "files_per_s": n / s,
            "peak_beyond_per_sample": peak / n,
            "left_beyond_per_sample": left / n,
            "data": runs[0]["data"],
            "runs": runs,
        }
        rows.append(row)
        print(
            f"| {n:,} | {s:.2f} ({n / s / 1000:.1f}k) | {cpu:.2f} | {peak / 2**20:,.1f} MiB "
            f"({peak / n:,.0f} B/sample) | {left / 2**20:,.1f} MiB ({left / n:,.0f} B/sample) |",
            flush=True,
        )
    print(f"load after: {os.getloadavg()[0]:.2f}")
    if args.json:
        write_json(args.json, rows, run=run)


if __name__ == "__main__":
    main()
