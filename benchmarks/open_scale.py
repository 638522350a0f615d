"""Open cost of a store at ImageNet scale: ``JpegCache.open`` in the parent, and the reopen a
spawn/forkserver worker does when it unpickles the store (``pickle.loads``), medians of runs.

The store is synthetic (tiny samples, ImageNet-style paths and 1,000 classes), so only the index
is large: what open reads. Run: ``python benchmarks/open_scale.py --n 1281167``; with
``--sections`` the store also holds every optional section gpucache checks at open (``rst``,
``resized`` + ``resized.args``, ``targets`` (N, 8), ``targets_ragged`` (2 rows of 5 a sample) +
its offsets), so their checks are part of what is timed.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks._record
from benchmarks._record import run_line  # noqa: E402


def make_store(path: Path, n: int, sections: bool = False) -> None:
    from gpucache import JpegCache
    from gpucache.ingest._sniff import SAMPLE_DTYPE, Kind
    from gpucache.store._format import Columns, pack_strings

    sample = bytes.fromhex("ffd8ffd9")  # 4 bytes: only the index matters here
    data = np.frombuffer(sample * n, dtype=np.uint8)
    offsets = np.arange(n + 1, dtype=np.int64) * len(sample)
    labels = np.arange(n, dtype=np.int64) % 1000
    samples = np.zeros(n, dtype=SAMPLE_DTYPE)
    samples["kind"], samples["components"], samples["precision"] = int(Kind.JPEG), 3, 8
    samples["orientation"] = 1
    samples["height"], samples["width"] = 375, 500
    classes = [f"n{1440764 + k:08d}" for k in range(1000)]
    paths = pack_strings(
        [f"/data/imagenet/train/{classes[i % 1000]}/{classes[i % 1000]}_{i}.JPEG" for i in range(n)]
    )
    extra = {}
    if sections:
        resized = np.zeros((n, 3), dtype="<u4")
        resized[::7] = (750, 1000, 150_000)
        extra = {
            "rst": np.where(np.arange(n) % 3 == 0, 4, 0).astype("<i4"),
            "resized": resized,
            "resized.args": np.array([500, 90], dtype="<i8"),
            "targets": np.zeros((n, 8), dtype="<f4"),
            "targets_ragged": np.zeros((2 * n, 5), dtype="<f4"),
            "targets_ragged.offsets": np.arange(n + 1, dtype="<i8") * 2,
        }
    JpegCache(
        Columns(
            data=data,
            offsets=offsets,
            labels=labels,
            samples=samples,
            classes=classes,
            paths=paths,
            extra=extra,
        )
    ).save(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=1_281_167)
    ap.add_argument("--store", type=Path, default=None, help="reuse or create this store file")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument(
        "--sections",
        action="store_true",
        help="add the optional sections that open checks (targets, resized, rst)",
    )
    args = ap.parse_args()
    print(run_line(), flush=True)
    import gpucache
    from gpucache import JpegCache

    store = args.store or Path(
        f"/tmp/gpucache-open-{args.n}{'-sections' if args.sections else ''}.gpucache"
    )
    if not store.exists():
        t0 = time.perf_counter()
        make_store(store, args.n, args.sections)
        print(
            f"made {store} ({store.stat().st_size / 2**20:.0f} MiB) in "
            f"{time.perf_counter() - t0:.1f} s"
        )
    opens, reopens = [], []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        cache = JpegCache.open(store)
        opens.append(time.perf_counter() - t0)
        blob = pickle.dumps(cache)
        t0 = time.perf_counter()
        again = pickle.loads(blob)  # a worker's reopen (through /proc/<pid>/fd on Linux)
        reopens.append(time.perf_counter() - t0)
        assert len(again) == len(cache) == args.n
        cache.close(), again.close()
    ms = lambda xs: f"{statistics.median(xs) * 1e3:.1f} ms (min {min(xs) * 1e3:.1f})"  # noqa: E731
    print(
        f"gpucache from {os.path.dirname(gpucache.__file__)}; N = {args.n:,}; "
        f"load {os.getloadavg()[0]:.1f}"
    )
    print(f"open (parent):          {ms(opens)}")
    print(f"reopen (worker unpickle): {ms(reopens)}")


if __name__ == "__main__":
    main()
