"""What the per-stage timings cost: loader epochs with GPUCACHE_TIMINGS on and off, side by side.

    PYTHONPATH=. python benchmarks/stats_overhead.py [SRC] [--rounds 7] [--epochs 3]
        [--workers 0,2] [--batch 64] [--json out.json]

SRC is an ImageFolder tree (default: ../shared/data/hymenoptera when present, else 400 generated
photos). The store is built once and saved; every run is a fresh process that opens it, makes a
GpuCachedLoader (cpu backend, RandomResizedCrop 224 + flip), runs one warm-up epoch and
``--epochs`` measured ones, and prints images/s. Runs with timings on and off alternate (the
order flips every round), so a noisy machine's drift hits both alike; the ratio is the median of
the rounds' on/off ratios. ``num_workers=0`` decodes in the loop's process, so every clock read
of the timings is on the measured path there.

Beside the end-to-end ratio, which a 2-core machine's noise blurs by a few percent, the timing
code itself is timed in-process: the clock reads and page touch a sample costs, and
``LoaderStats.record`` a batch, against the measured time a batch takes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks._record import run_info, run_line, write_json  # noqa: E402

RUN = """
import sys, time
from gpucache import GpuCachedLoader, JpegCache
from gpucache import transforms as T
cache = JpegCache.open(sys.argv[1])
workers, batch, epochs = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
train = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip()])
with GpuCachedLoader(cache, batch_size=batch, num_workers=workers, device="cpu",
                     transform=train, seed=0) as loader:
    for _ in loader:
        pass
    t0, n = time.perf_counter(), 0
    for _ in range(epochs):
        for x, _ in loader:
            n += len(x)
    print(n / (time.perf_counter() - t0))
"""


def run(store: str, workers: int, batch: int, epochs: int, timed: bool) -> float:
    env = dict(os.environ, GPUCACHE_TIMINGS="1" if timed else "0", PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", RUN, store, str(workers), str(batch), str(epochs)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout.split()[-1])


def code_cost(store: str, batch: int) -> dict:
    """Microseconds the timing code costs a sample and a batch, measured in this process."""
    import numpy as np

    from gpucache import JpegCache
    from gpucache.decode._outcome import Decoded
    from gpucache.decode._timing import touch_pages
    from gpucache.loader._stats import LoaderStats

    cache = JpegCache.open(store)
    data, offsets = cache._data, cache._offsets
    clock = time.perf_counter
    n = len(cache)
    t0 = clock()
    reps = 20
    for _ in range(reps):
        for i in range(n):  # what decode_batch adds a sample: 4 clock reads, one page touch
            a = clock()
            touch_pages(data[offsets[i] : offsets[i + 1]])
            b = clock()
            c = clock()
            d = clock()
            _ = (b - a, d - c)
    per_sample = (clock() - t0) / (reps * n) * 1e6
    stats = LoaderStats()
    out = Decoded(
        [],
        np.zeros(0, dtype=np.int64),
        times=dict.fromkeys(("read", "decode", "resize", "collate", "region"), 0.001),
        routes={"region": batch},
        busy=0.004,
    )
    t0 = clock()
    k = 20000
    for _ in range(k):  # what the loader adds a batch: its clock reads and the record
        for _ in range(8):
            clock()
        stats.record(
            {"plan": 0.001, "transform": 0.0, "transfer": 0.0, "wait": 0.01}, batch, out, 1
        )
        stats.record_step(0.01)
    per_batch = (clock() - t0) / k * 1e6
    return {"us_a_sample": per_sample, "us_a_batch": per_batch}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("src", nargs="?", default=None)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--workers", default="0,2")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    run = run_info()
    print(run_line(), flush=True)
    from gpucache import JpegCache
    from gpucache.testing import cached_jpeg_folder

    shared = ROOT.parent / "shared" / "data" / "hymenoptera"
    src = a.src or (str(shared) if shared.is_dir() else str(cached_jpeg_folder(400)))
    tmp = tempfile.mkdtemp()
    store = os.path.join(tmp, "bench.gpucache")
    JpegCache.from_folder(src, progress=False).save(store)
    result: dict = {
        "src": src,
        "samples": len(JpegCache.open(store)),
        "batch": a.batch,
        "epochs": a.epochs,
        "rounds": a.rounds,
        "configs": {},
    }
    for workers in [int(w) for w in a.workers.split(",")]:
        on, off, ratios = [], [], []
        for r in range(a.rounds):
            order = (True, False) if r % 2 == 0 else (False, True)
            got = {t: run(store, workers, a.batch, a.epochs, t) for t in order}
            on.append(got[True])
            off.append(got[False])
            ratios.append(got[True] / got[False])
            print(
                f"workers={workers} round {r}: on {got[True]:.1f} img/s, off {got[False]:.1f} "
                f"img/s, ratio {ratios[-1]:.4f}",
                flush=True,
            )
        result["configs"][f"workers={workers}"] = {
            "on_img_s": on,
            "off_img_s": off,
            "median_on": statistics.median(on),
            "median_off": statistics.median(off),
            "median_ratio": statistics.median(ratios),
        }
    cost = code_cost(store, a.batch)
    # against the fastest configuration's batch: the cost's largest share
    fastest = max(c["median_off"] for c in result["configs"].values())
    per_batch_s = a.batch / fastest
    cost["fraction_of_a_batch"] = (cost["us_a_sample"] * a.batch + cost["us_a_batch"]) / (
        per_batch_s * 1e6
    )
    result["timing_code"] = cost
    print(json.dumps(result, indent=1))
    if a.json:
        write_json(a.json, result, run=run)


if __name__ == "__main__":
    main()
