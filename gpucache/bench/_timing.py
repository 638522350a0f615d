"""Timing: a warm-up epoch each (time to first batch), then interleaved measured epochs.

Every batch is checked (uint8 ``(n, 3, 224, 224)``, float32 with ``--normalize``, with ``n``
labels, on the contender's device)
and every epoch's label counts must equal the data set's, so what is timed is what it should be.
"""

from __future__ import annotations

import time
from collections.abc import Sized
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._errors import BenchError
from ._common import CROP, Config, Source, progress, say
from ._contenders import CONTENDERS, Runner


@dataclass
class Result:
    name: str
    what: str
    setup_s: float | None = None
    first_batch_s: float | None = None
    warmup_s: float | None = None
    epochs: list[dict[str, Any]] = field(default_factory=list)
    memory: dict[str, Any] | None = None
    error: str | None = None

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.epochs:
            rates = [e["img_s"] for e in self.epochs]
            lat = np.concatenate([e["batch_ms"] for e in self.epochs])
            out.update(
                img_s=float(np.median(rates)),
                img_s_min=min(rates),
                img_s_max=max(rates),
                p50_ms=float(np.percentile(lat, 50)),
                p99_ms=float(np.percentile(lat, 99)),
            )
        if self.memory:
            out.update(copies=self.memory.get("copies"), peak_rss_mb=self.memory.get("peak_rss_mb"))
        return out


def _error(err: Exception) -> str:
    return f"{type(err).__name__}: {err}".splitlines()[0][:200]


def check_batch(r: Runner, images: object, labels: Sized) -> int:
    """The batch's size; BenchError unless it is uint8 (float32 with ``--normalize``)
    (n, 3, 224, 224) on r's device."""
    import torch

    n = len(labels)
    dtype = torch.float32 if r.cfg.normalize else torch.uint8
    if (
        not isinstance(images, torch.Tensor)
        or images.dtype != dtype
        or tuple(images.shape) != (n, 3, CROP, CROP)
        or not 0 < n <= r.batch_size
        or images.device.type != r.device
    ):
        got = (
            f"{type(images).__name__} {getattr(images, 'dtype', '')} "
            f"{tuple(getattr(images, 'shape', ()))} on {getattr(images, 'device', '?')}"
        )
        raise BenchError(
            f"{r.c.name}: a batch of {n} labels came with images {got}; "
            f"expected {str(dtype).removeprefix('torch.')} ({n}, 3, {CROP}, {CROP}) on {r.device}"
        )
    return n


def epoch(r: Runner) -> dict[str, Any]:
    """One full pass; every batch checked, label counts compared with the data set's."""
    import torch

    sync = r.device == "cuda"
    assert r.expected is not None  # counted by setup()
    skipped0 = len(r.loader.stats.skipped_samples) if r.cache is not None else 0
    counts = np.zeros(len(r.expected), dtype=np.int64)
    lat, small = [], 0
    t0 = last = time.perf_counter()
    for images, labels in r.loader:
        if sync:
            torch.cuda.synchronize()
        now = time.perf_counter()
        lat.append(now - last)
        n = check_batch(r, images, labels)
        small += n < r.batch_size
        counts += np.bincount(labels.cpu().numpy(), minlength=len(counts))
        last = time.perf_counter()  # the checks are not the loader's time
        t0 += last - now
    seconds = last - t0
    expected = r.expected.copy()
    if r.cache is not None:  # samples that failed to decode were reported, not lost
        for index, _ in r.loader.stats.skipped_samples[skipped0:]:
            expected[r.cache.labels[index]] -= 1
    if not np.array_equal(counts, expected) or (small > 1 and r.cache is None):
        raise BenchError(
            f"{r.c.name}: an epoch gave label counts {counts.tolist()}, the "
            f"data set has {expected.tolist()} ({small} short batches)"
        )
    n = int(counts.sum())
    return {
        "seconds": seconds,
        "images": n,
        "img_s": n / seconds,
        "batch_ms": [round(x * 1e3, 3) for x in lat],
    }


def step(r: Runner) -> tuple[float, int]:
    """One batch (a new epoch when one ends): its wall time and size, checked."""
    import torch

    t0 = time.perf_counter()
    if r.it is None:
        r.it = iter(r.loader)
    try:
        images, labels = next(r.it)
    except StopIteration:
        r.it = iter(r.loader)
        images, labels = next(r.it)
    if r.device == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return dt, check_batch(r, images, labels)


def _warm_up(r: Runner, res: Result) -> None:
    """Set up, make the loader and run one epoch: time to first batch, worker start included."""
    res.setup_s = r.setup()
    t0 = time.perf_counter()
    r.make_loader()
    it = iter(r.loader)
    first = next(it)
    res.first_batch_s = time.perf_counter() - t0
    check_batch(r, *first)
    del first
    for _ in it:
        pass
    res.warmup_s = time.perf_counter() - t0


def run_interleaved(names: list[str], source: Source, cfg: Config) -> list[Result]:
    """Warm each contender up (first batch timed), then interleave its measured epochs."""
    results = {n: Result(n, CONTENDERS[n].what) for n in names}
    runners: dict[str, Runner] = {}
    bar = progress(len(names) * (cfg.epochs + 1), f"bench ({cfg.workers} workers)")
    try:
        for n in names:
            r, res = Runner(CONTENDERS[n], source, cfg), results[n]
            try:
                _warm_up(r, res)
                runners[n] = r
                msg = (
                    f"warm-up {n}: {res.warmup_s:.1f} s, first batch {res.first_batch_s:.2f} s"
                    f" (setup {res.setup_s:.1f} s)"
                )
            except Exception as err:  # noqa: BLE001 - one contender failing leaves the others
                res.error = _error(err)
                r.close()
                msg = f"{n}: failed: {res.error}"
            if bar is not None:
                bar.set_postfix_str(n)
                bar.update(1)
            else:
                say(msg)
        for e in range(cfg.epochs):
            order = list(runners)
            order = order[e % len(order) :] + order[: e % len(order)] if order else order
            line = []
            for n in order:
                try:
                    ep = epoch(runners[n])
                    results[n].epochs.append(ep)
                    line.append(f"{n} {ep['img_s']:.0f}")
                except Exception as err:  # noqa: BLE001
                    results[n].error = _error(err)
                    runners.pop(n).close()
                    line.append(f"{n} failed")
                if bar is not None:
                    bar.update(1)
            if bar is None:
                say(f"epoch {e + 1}/{cfg.epochs} img/s: " + ", ".join(line))
    finally:
        for r in runners.values():
            r.close()
        if bar is not None:
            bar.close()
    return [results[n] for n in names]
