"""``gpucache verify`` wall time on one thread against every core, medians of alternating runs.

Checks that every run finds the same (zero) problems. Run:
``python benchmarks/verify_threads.py STORE [--runs 5]`` (e.g. a store of real photos from
``gpucache build``). Reports the machine load: on a busy machine the speed-up is capped by the
CPU time other processes leave.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks._record
from benchmarks._record import run_line  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("store")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="the many-thread side (all cores)")
    args = ap.parse_args()
    print(run_line(), flush=True)
    from gpucache import JpegCache
    from gpucache.cli._checks import check_checksums, check_decodes
    from gpucache.store._checksum import default_threads

    many = args.threads or default_threads()
    cache = JpegCache.open(args.store)
    times: dict[tuple[str, int], list[float]] = {}
    cpu: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.runs):
        for threads in (1, many):
            for name, check in (("checksums", check_checksums), ("decode", check_decodes)):
                r0 = resource.getrusage(resource.RUSAGE_SELF)
                t0 = time.perf_counter()
                assert check(cache, threads=threads, progress=False) == []
                wall = time.perf_counter() - t0
                r1 = resource.getrusage(resource.RUSAGE_SELF)
                times.setdefault((name, threads), []).append(wall)
                cpu.setdefault((name, threads), []).append(
                    (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / wall
                )
    print(
        f"{args.store}: {len(cache)} samples, {cache.nbytes / 2**20:.1f} MiB; "
        f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}"
    )
    for name in ("checksums", "decode"):
        one, all_ = (statistics.median(times[(name, t)]) for t in (1, many))
        busy = statistics.median(cpu[(name, many)])
        print(
            f"{name:9s}: 1 thread {one:.3f} s, {many} threads {all_:.3f} s "
            f"(x{one / all_:.2f}; CPU/wall with {many} threads {busy:.2f})"
        )


if __name__ == "__main__":
    main()
