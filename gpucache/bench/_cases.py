"""The cases: ``main`` (the table), ``batch100``, ``scaling-workers`` and ``scaling-size``."""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from .._errors import BenchError
from ._common import Config, Source, say
from ._contenders import CONTENDERS, Runner
from ._memory import measure_memory
from ._report import copies_cell, fmt
from ._timing import Result, run_interleaved, step


def case_main(
    names: list[str], source: Source, cfg: Config, args: argparse.Namespace, tmp: Path
) -> tuple[dict[str, Any], list[Result]]:
    results = run_interleaved(names, source, cfg)
    if not args.no_memory:
        measure_memory(names, source, cfg, args.probe_mb, tmp, results)
    return {
        "config": asdict(cfg),
        "contenders": [
            {**asdict(r), "summary": r.summary(), **asdict(CONTENDERS[r.name])} for r in results
        ],
    }, results


def _sizes(epoch: dict[str, Any], bs: int) -> list[int]:
    n, k = epoch["images"], len(epoch["batch_ms"])
    return [bs] * (k - 1) + [n - bs * (k - 1)]


def _line(name: str, ms: list[float], base: float | None, first: str) -> tuple[float, float, str]:
    med, p99 = float(np.median(ms)), float(np.percentile(ms, 99))
    base = base or med
    return (
        med,
        p99,
        (
            f"  {name:<15} median {med:7.0f} ms  p99 {p99:7.0f} ms  ({base / med:.2f}x "
            f"as fast as {first})"
        ),
    )


def case_batch100(
    names: list[str], source: Source, cfg: Config, args: argparse.Namespace
) -> dict[str, Any]:
    """A batch of 100: steady stream with workers, and in-process (no workers) latency."""
    cfg100 = Config(**{**asdict(cfg), "batch_size": 100})
    streamed = run_interleaved(names, source, cfg100)
    out: dict[str, dict[str, Any]] = {"streamed": {}, "in_process": {}}
    print(f"\nbatch of 100, {cfg.workers} workers (interval between batches, full batches only):")
    base = None
    for r in streamed:
        full = [ms for e in r.epochs for ms, k in zip(e["batch_ms"], _sizes(e, 100)) if k == 100]
        if not full:
            print(f"  {r.name:<15} failed: {r.error}")
            continue
        med, p99, text = _line(r.name, full, base, streamed[0].name)
        base = base or med
        out["streamed"][r.name] = {
            "median_ms": med,
            "p99_ms": p99,
            "batches": len(full),
            "first_batch_s": r.first_batch_s,
            "raw_ms": full,
        }
        print(text)
    runners: dict[str, Runner] = {}
    times: dict[str, list[float]] = {}
    try:
        for n in names:
            runner = Runner(CONTENDERS[n], source, cfg100)
            try:
                runner.setup()
                runner.make_loader(workers=0)
                step(runner)  # warm-up
                runners[n], times[n] = runner, []
            except Exception as err:  # noqa: BLE001
                runner.close()
                out["in_process"][n] = {"error": f"{type(err).__name__}: {err}"[:300]}
        for _ in range(args.batches):  # one batch of each in turn: nothing runs in background
            for n, runner in runners.items():
                dt, k = step(runner)
                if k == 100:
                    times[n].append(dt * 1e3)
    finally:
        for runner in runners.values():
            runner.close()
    print("batch of 100 in the calling process (num_workers=0), wall time per batch:")
    base = None
    for n, t in times.items():
        med, p99, text = _line(n, t, base, names[0])
        base = base or med
        out["in_process"][n] = {"median_ms": med, "p99_ms": p99, "batches": len(t), "raw_ms": t}
        print(text)
    return out


def worker_counts(cores: int) -> list[int]:
    counts, w = [], 1
    while w < cores:
        counts.append(w)
        w *= 2
    return counts + [cores]


def case_scaling_workers(
    names: list[str], source: Source, cfg: Config, args: argparse.Namespace, tmp: Path
) -> dict[str, Any]:
    table: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    ws = worker_counts(cfg.workers)
    for w in ws:
        cw = Config(**{**asdict(cfg), "workers": w})
        say(f"scaling: {w} workers")
        results = run_interleaved(names, source, cw)
        if not args.no_memory:
            measure_memory(names, source, cw, args.probe_mb, tmp, results)
        for r in results:
            table[r.name].append(
                {"workers": w, **r.summary(), "error": r.error, "first_batch_s": r.first_batch_s}
            )
    print("\nimages/s (copies held) against workers:")
    print(f"{'contender':<15}" + "".join(f"{f'{w} workers':>20}" for w in ws))
    notes = []
    for n, rows in table.items():
        cells = []
        for row in rows:
            copies, note = copies_cell(n, row.get("copies"), short=True)
            cells.append(f"{fmt(row.get('img_s'), '.0f')} ({copies})")
            notes += [f"  {row['workers']} workers: {note}"] if note else []
        print(f"{n:<15}" + "".join(f"{c:>20}" for c in cells))
    if notes:
        print("\n".join(notes))
    return {"table": table}


def _write_copies(source: Source, folder: Path, target: int) -> list[Path]:
    """About ``target`` bytes of the source files under new names, class folders kept."""
    files, total, k, written = source.samples, 0, 0, []
    while total < target:
        p, y = files[k % len(files)]
        dst = folder / source.classes[y] / f"{k:07d}{Path(p).suffix.lower()}"
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(p, dst)
        total += dst.stat().st_size
        written.append(dst)
        k += 1
    return written


def _evict(files: list[Path]) -> bool:
    """Drop the files from the page cache, so the build reads the disk; False where it cannot."""
    os.sync()
    if not hasattr(os, "posix_fadvise"):
        return False
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def case_scaling_size(source: Source, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Store build, save and open time for data sets of about each size, on disk."""
    from ..node._jpegcache import JpegCache

    rows = []
    for mb in args.sizes_mb:
        target = int(mb * 2**20)
        room = shutil.disk_usage(tmp).free
        if room < 2.2 * target:
            raise BenchError(
                f"scaling-size needs about {2.2 * target / 2**30:.1f} GiB free in "
                f"{tmp} for {mb:g} MB of images plus the store; it has "
                f"{room / 2**30:.1f} GiB. Use smaller --sizes-mb or set TMPDIR."
            )
        folder = tmp / f"size-{mb:g}"
        evicted = _evict(_write_copies(source, folder, target))
        t0 = time.perf_counter()
        cache = JpegCache.from_folder(folder, progress=False)
        build = time.perf_counter() - t0
        t0 = time.perf_counter()
        path = cache.save(tmp / f"size-{mb:g}.gpucache")
        save = time.perf_counter() - t0
        nbytes, n = cache.nbytes, len(cache)
        del cache
        gc.collect()
        t0 = time.perf_counter()
        cache = JpegCache.open(path)
        opened = time.perf_counter() - t0
        if len(cache) != n or cache.nbytes != nbytes:
            raise BenchError(f"reopened store differs: {len(cache)} vs {n} samples")
        rows.append(
            {
                "target_mb": mb,
                "images": n,
                "bytes": nbytes,
                "file_bytes": path.stat().st_size,
                "build_s": build,
                "save_s": save,
                "open_s": opened,
                "build_mb_s": nbytes / 2**20 / build,
                "page_cache_evicted": evicted,
            }
        )
        del cache
        shutil.rmtree(folder)
        path.unlink()
        say(
            f"size {mb:g} MB: {n} images, build {build:.2f} s, save {save:.2f} s, "
            f"open {opened * 1e3:.1f} ms"
        )
    print(
        "\nstore build / save / open against data size (files written to disk, page cache "
        "evicted before the build):"
    )
    print(f"{'size MB':>8} {'images':>7} {'build s':>8} {'MB/s':>7} {'save s':>7} {'open ms':>8}")
    for r in rows:
        print(
            f"{r['bytes'] / 2**20:>8.0f} {r['images']:>7} {r['build_s']:>8.2f} "
            f"{r['build_mb_s']:>7.0f} {r['save_s']:>7.2f} {r['open_s'] * 1e3:>8.1f}"
        )
    return {"rows": rows}
