"""How often the ranks of one node stat the listing when they open an unchanged store.

Makes N tiny real JPEGs in 1,000 class folders, builds their store once (one process, cache_dir),
then runs a real `torchrun --standalone --nproc_per_node=3` job (gloo process group) in which
every rank calls `JpegCache.from_folder(root, cache_dir=...)`, and counts, for each rank:

- the stat system calls on files under the data root, from `strace -f` of the whole job
  (stat, lstat, newfstatat, statx): what the kernel was asked, whoever asked;
- Python's own view: `os.stat` calls on those paths (a counting wrapper) and `os.scandir`
  audit events (one per folder listed);
- the wall time of `from_folder` in each rank.

    python benchmarks/node_scan.py --files 100000 [--no-strace] [--workdir /tmp/x]

Correctness: every rank must open the same store file, holding N samples.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks._record import run_line  # noqa: E402

RANK = """
import json, os, sys, time
import torch.distributed as dist
root, cdir, out = sys.argv[1], sys.argv[2], sys.argv[3]
from tests.support.audit import count_listing_calls
counts = count_listing_calls(root)
dist.init_process_group("gloo")
from gpucache import JpegCache
t0 = time.perf_counter()
cache = JpegCache.from_folder(root, cache_dir=cdir, progress=False)
dt = time.perf_counter() - t0
rank = dist.get_rank()
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({**counts, "pid": os.getpid(), "seconds": dt, "path": str(cache.path),
               "n": len(cache)}, f)
dist.barrier()
dist.destroy_process_group()
"""


def make_listing(root: Path, files: int, classes: int = 1000) -> None:
    from gpucache.testing import make_jpeg_bytes

    jpeg = make_jpeg_bytes(16, 16, seed=1)
    for i in range(files):
        folder = root / f"c{i % classes:04d}"
        if i < classes:
            folder.mkdir(parents=True)
        (folder / f"{i:07d}.jpg").write_bytes(jpeg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=100_000)
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--no-strace", action="store_true")
    args = ap.parse_args()
    print(run_line(), flush=True)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="gpucache-node-scan-"))
    root, cdir, out = work / "data", work / "cache", work / "out"
    try:
        if not root.exists():
            t0 = time.perf_counter()
            make_listing(root, args.files)
            print(f"made {args.files:,} files in {time.perf_counter() - t0:.1f} s")
        from gpucache import JpegCache

        t0 = time.perf_counter()
        built = JpegCache.from_folder(root, cache_dir=cdir, progress=False)
        print(
            f"store {built.path.name}: {len(built):,} samples "
            f"({time.perf_counter() - t0:.1f} s to build or open)"
        )
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        script = work / "rank.py"
        script.write_text(RANK)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={args.ranks}",
            str(script),
            str(root),
            str(cdir),
            str(out),
        ]
        trace = work / "strace.txt"
        if not args.no_strace:
            cmd = [
                "strace",
                "-f",
                "-qq",
                "-o",
                str(trace),
                "-e",
                "trace=stat,lstat,newfstatat,statx",
                *cmd,
            ]
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, env=env, timeout=3600)
        print(
            f"torchrun job: {time.perf_counter() - t0:.1f} s wall (with strace: "
            f"{not args.no_strace})"
        )
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(args.ranks)]
        assert {r["path"] for r in ranks} == {str(built.path)}, ranks
        assert {r["n"] for r in ranks} == {len(built)}, ranks
        sys_stats = Counter()
        if not args.no_strace:
            pattern = re.compile(rf'^(\d+)\s+\w*stat\w*\((?:AT_FDCWD, )?"{re.escape(str(root))}/')
            for line in trace.read_text(errors="replace").splitlines():
                m = pattern.match(line)
                if m:
                    sys_stats[int(m[1])] += 1
        print(f"{'rank':>4} {'stat syscalls':>14} {'os.stat':>9} {'os.scandir':>11} {'s':>7}")
        for r, rec in enumerate(ranks):
            print(
                f"{r:>4} {sys_stats.get(rec['pid'], 0) if sys_stats else '-':>14} "
                f"{rec['stat']:>9,} {rec['scandir']:>11,} {rec['seconds']:>7.2f}"
            )
        total = sum(r["stat"] for r in ranks)
        print(
            f"node: {sum(sys_stats.values()) if sys_stats else '-'} stat syscalls under the "
            f"root from any process, {total:,} os.stat calls for {args.files:,} files "
            f"({total / args.files:.2f} per file)"
        )
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
