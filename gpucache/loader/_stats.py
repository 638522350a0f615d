"""Where the time goes: what every batch cost by stage, a one-word diagnosis and a short report.

Stages (the same names on every backend):

- ``wait``: the training loop waited inside ``next(loader)`` for the batch (everything below that
  runs in the loop's process is part of it); the first batch of a pass, which waits for the
  workers to start and the queue to fill, is counted apart (``first_wait``);
- ``step``: the loop's own time between two batches (the training step);
- ``plan``: drawing each sample's geometric plan (crop box, flip), in the loop's process;
- ``read``, ``decode``, ``resize``, ``collate``: in the producers (worker processes, or the GPU
  backends' threads), in parallel with the loop: touching the sample's bytes (a store read from
  disk shows here), decoding (split by route: ``region``, ``scaled``, ``full``, ``fallback``),
  running the plan (crop, resize, flip), assembling the batch (stack, copy for sending);
- ``steps``: the batch steps that act on each sample alone (ToDtype, Normalize, ColorJitter,
  PerSample), where the cpu backend runs them: in its workers, when the batch ends on the CPU;
- ``transform``: the batch steps (Normalize, ColorJitter, any callable), in the loop's process;
- ``transfer``: the copy to the device.

Timing costs a few clock reads per sample and per batch (``benchmarks/stats_overhead.py``
measures it); ``GPUCACHE_TIMINGS=0`` in the environment turns it off (counts stay on).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: per-batch record columns; ``images`` is the batch's size
COLUMNS = (
    "wait",
    "step",
    "plan",
    "read",
    "decode",
    "resize",
    "steps",
    "collate",
    "transform",
    "transfer",
)
PRODUCER = ("read", "decode", "resize", "steps", "collate")  # in workers or threads, in parallel
ROUTES = ("region", "scaled", "full", "fallback")
#: what ``LoaderStats.bottleneck`` can say
BOTTLENECKS = ("step", "decode", "transform", "read", "collate", "transfer")
#: data wait below this share of the loop's time: the loader keeps up, the step is the limit
STEP_BOUND = 0.10
KEEP = 100_000  # batches whose records are kept for percentiles (about 8 MB)


@dataclass
class LoaderStats:
    """Running counts and timings since the loader was made (or since :meth:`reset`).

    ``print(loader.stats)`` gives a short report whose first line names what holds training
    back (:attr:`bottleneck`) with the numbers and the lever; :meth:`as_dict` gives the same
    numbers flat, for any logger. ``epochs`` holds :meth:`as_dict` of each finished epoch."""

    batches: int = 0
    samples: int = 0
    skipped: int = 0  # samples that failed to decode and were left out
    cpu_decoded: int = 0  # samples decoded on the CPU (all of them for backend="cpu")
    skipped_samples: list[tuple[int, str]] = field(default_factory=list)
    warned: int = 0  # samples libjpeg warned about (corrupt data, decoded anyway), each once
    warned_samples: dict[int, str] = field(default_factory=dict)  # index -> the warning
    #: samples whose bytes do not match the restart interval the store records: decoded without
    #: it (same pixels, slower), warned about once each; index -> the warning
    mismatched_samples: dict[int, str] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COLUMNS, 0.0))
    route_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(ROUTES, 0.0))
    route_images: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ROUTES, 0))
    worker_busy: dict[int, float] = field(default_factory=dict)  # seconds, by worker id
    #: reads each worker's private dirty bytes (the backend's ``private_memory``), set by the
    #: loader; :attr:`worker_private` calls it
    probe: Callable[[], dict[int, int]] | None = field(default=None, repr=False)
    _private: dict[int, int] = field(default_factory=dict, repr=False)  # the last reading
    wall: float = 0.0  # seconds the loader has been iterated (its passes, end to end)
    first_wait: float = 0.0  # seconds waited for the first batch of each pass (not in "wait")
    passes: int = 0  # passes over an epoch finished
    ready_batches: int = 0  # summed over batches: decoded batches waiting when one was asked for
    starved: int = 0  # batches not decoded yet when the loop asked for them
    workers: int = 1  # producers working in parallel (worker processes; 1 for threads)
    backend: str = "cpu"
    #: where the batches come from: the loader's tier, described (docs/guides/decoded.md)
    tier: str = "raw"
    epochs: list[dict[str, Any]] = field(default_factory=list)
    _rows: deque[tuple[float, ...]] = field(default_factory=lambda: deque(maxlen=KEEP), repr=False)

    def reset(self) -> None:
        """Start every count and timing afresh (the per-epoch history too)."""
        fresh = LoaderStats(
            workers=self.workers, backend=self.backend, probe=self.probe, tier=self.tier
        )
        self.__dict__.update(fresh.__dict__)

    @property
    def worker_private(self) -> dict[int, int]:
        """Each worker's private dirty bytes, ``{worker id: bytes}``, read now while the
        workers run (the last reading once they are stopped; empty for in-process backends and
        off Linux): the pages it wrote that no other process shares (docs/guides/memory.md)."""
        now = self.probe() if self.probe is not None else {}
        if now:
            self._private = now
        return dict(self._private)

    # ------------------------------------------------------------------ recording
    def record(self, row: dict[str, float], images: int, producer: Any, ready: int) -> None:
        """One batch: the loop-side times in ``row``, the producer's from its ``Decoded``."""
        sec = self.seconds
        for name, value in row.items():
            sec[name] += value
        for name in PRODUCER:
            value = producer.times.get(name, 0.0)
            sec[name] += value
            row[name] = value
        for name in ROUTES:
            self.route_seconds[name] += producer.times.get(name, 0.0)
            self.route_images[name] += producer.routes.get(name, 0)
        self.worker_busy[producer.worker] = self.worker_busy.get(producer.worker, 0.0) + (
            producer.busy
        )
        self.ready_batches += ready
        self.starved += ready == 0
        self._rows.append(tuple(row.get(c, 0.0) for c in COLUMNS) + (images,))

    def record_step(self, seconds: float) -> None:
        """The loop's time between handing out a batch and asking for the next."""
        self.seconds["step"] += seconds
        if self._rows:
            last = self._rows[-1]
            self._rows[-1] = last[:1] + (last[1] + seconds,) + last[2:]

    def end_epoch(self, epoch: int) -> None:
        self.epochs.append({"epoch": epoch, **self.as_dict()})

    # ------------------------------------------------------------------ reading
    @property
    def data_wait_fraction(self) -> float:
        """The share of the loop's time spent waiting for batches (0 when nothing ran)."""
        wait, step = self.seconds["wait"], self.seconds["step"]
        return wait / (wait + step) if wait + step > 0 else 0.0

    def costs(self) -> dict[str, float]:
        """Seconds a batch of each bottleneck candidate but "step", on the path that limits the
        rate: producer stages divided among the producers that run them in parallel."""
        n, sec = max(1, self.batches), self.seconds
        par = max(1, self.workers)
        return {
            "decode": sec["decode"] / par / n,
            "transform": ((sec["resize"] + sec["steps"]) / par + sec["plan"] + sec["transform"])
            / n,
            "read": sec["read"] / par / n,
            "collate": sec["collate"] / par / n,
            "transfer": sec["transfer"] / n,
        }

    @property
    def bottleneck(self) -> str | None:
        """What holds training back, one of :data:`BOTTLENECKS` (None before the first batch):
        ``"step"`` when the loop waits for data less than a tenth of its time (the data is not
        the problem), else the stage that costs the most a batch on the limiting path."""
        if not self.batches:
            return None
        if self.data_wait_fraction < STEP_BOUND:
            return "step"
        costs = self.costs()
        return max(costs, key=costs.__getitem__)

    def busy_fraction(self) -> float:
        """Mean share of the wall time the producers were busy (workers or threads)."""
        if self.wall <= 0 or not self.worker_busy:
            return 0.0
        return min(1.0, sum(self.worker_busy.values()) / len(self.worker_busy) / self.wall)

    def percentiles(self, column: str, qs: tuple[int, ...] = (50, 90, 99)) -> dict[int, float]:
        """Percentiles of one column (``COLUMNS``) over the kept batches, in milliseconds."""
        if not self._rows:
            return dict.fromkeys(qs, 0.0)
        values = np.fromiter((r[COLUMNS.index(column)] for r in self._rows), dtype=np.float64)
        return {q: float(v) * 1e3 for q, v in zip(qs, np.percentile(values, qs))}

    def as_dict(self) -> dict[str, Any]:
        """The numbers flat (floats and ints; ``bottleneck`` a string), for any logger."""
        n = max(1, self.batches)
        out: dict[str, Any] = {
            "batches": self.batches,
            "samples": self.samples,
            "skipped": self.skipped,
            "first_batch_ms": self.first_wait / max(1, self.passes) * 1e3,
            "data_wait_fraction": self.data_wait_fraction,
            "bottleneck": self.bottleneck,
            "worker_busy_fraction": self.busy_fraction(),
            "queue_ready_mean": self.ready_batches / n,
            "starved_fraction": self.starved / n,
        }
        for c in COLUMNS:
            out[f"{c}_ms"] = self.seconds[c] / n * 1e3
        for c in ("wait", "step"):
            for q, v in self.percentiles(c).items():
                out[f"{c}_ms_p{q}"] = v
        images = sum(self.route_images.values())
        out["decode_ms_per_image"] = self.seconds["decode"] / max(1, images) * 1e3
        private = self.worker_private
        if private:
            out["worker_private_mib_max"] = max(private.values()) / 2**20
        return out

    def _more_workers(self) -> str:
        """The lever of more worker processes, while the CPU workers leave cores idle: this
        rank's share of the usable cores (``num_workers=None``'s default) is the most that
        help; past it they only take turns on the same cores."""
        from ..decode.cpu._procs import default_workers

        if self.backend != "cpu":
            return "add workers, "
        cores = default_workers()
        if self.workers < cores:
            return f"add workers (num_workers, up to {cores}: the cores this rank may use), "
        many = self.workers > 1
        return (
            f"the {self.workers} worker{'s' if many else ''} ha{'ve' if many else 's'} every "
            "usable core already: "
        )

    def headline(self) -> str:
        """The report's first line: the data wait, what bounds it, and the lever."""
        what = self.bottleneck
        if what is None:
            return "no batches yet"
        n = max(1, self.batches)
        head = f"data wait {self.data_wait_fraction:.0%} of the loop's time; {what}-bound: "
        sec, par = self.seconds, max(1, self.workers)
        producers = f"{par} worker{'s' if par > 1 else ''}" if self.backend == "cpu" else "threads"
        busy = f"{producers} {self.busy_fraction():.0%} busy"
        if what == "step":
            return head + (
                f"the step takes {sec['step'] / n * 1e3:.0f} ms a batch and the next batch is "
                f"ready in {sec['wait'] / n * 1e3:.1f} ms: the data is not what holds training "
                "back"
            )
        if what == "decode":
            images = max(1, sum(self.route_images.values()))
            routes = ", ".join(
                f"{k} {v / max(1, self.route_images[k]) * 1e3:.1f} ms x{self.route_images[k]}"
                for k, v in self.route_seconds.items()
                if self.route_images[k]
            )
            lever = (
                f"{self._more_workers()}build the store with restart_markers=True, "
                "or use backend='nvjpeg' on a GPU"
                if self.backend == "cpu"
                else "raise hw_decoder_load (DALI), or decode fewer pixels (max_side at build)"
            )
            return head + (
                f"{busy}, {sec['decode'] / images * 1e3:.2f} ms an image to decode "
                f"({routes}); {lever}"
            )
        if what == "transform":
            parts = {
                "resize": sec["resize"] / par,
                "steps": sec["steps"] / par,
                "plan": sec["plan"],
                "transform": sec["transform"],
            }
            worst = max(parts, key=parts.__getitem__)
            if worst == "transform":
                return head + (
                    f"the batch transforms take {sec['transform'] / n * 1e3:.0f} ms a batch in "
                    "the loop's process; make them cheaper, or run them on the GPU "
                    "(device='cuda')"
                )
            if worst == "steps":
                return head + (
                    f"{busy}, {sec['steps'] / max(1, self.samples) * 1e3:.2f} ms an image for "
                    f"the batch steps in the workers; {self._more_workers()}or make them cheaper"
                )
            if worst == "plan":
                return head + (
                    f"drawing the plans takes {sec['plan'] / n * 1e3:.1f} ms a batch in the "
                    "loop's process; use fewer, larger batches"
                )
            return head + (
                f"{busy}, {sec['resize'] / max(1, self.samples) * 1e3:.2f} ms an image to "
                f"crop and resize; {self._more_workers()}store smaller images (max_side at build)"
            )
        if what == "read":
            return head + (
                f"{busy}, {sec['read'] / n * 1e3:.1f} ms a batch reading the store's bytes; "
                "keep the store on a local disk with room in the page cache, or in memory "
                "(cache.share())"
            )
        if what == "collate":
            return head + (
                f"{busy}, {sec['collate'] / n * 1e3:.1f} ms a batch assembling it; use a "
                "transform that fixes the output size (one stacked tensor), or smaller batches"
            )
        return head + (
            f"{sec['transfer'] / n * 1e3:.1f} ms a batch copying to the device; "
            "pass pin_memory=True"
        )

    def __str__(self) -> str:
        n = max(1, self.batches)
        first = self.first_wait / max(1, self.passes) * 1e3
        lines = [
            self.headline(),
            f"{self.batches} batches, {self.samples} samples; the first batch of a pass took "
            f"{first:.0f} ms",
        ]
        if self.batches:
            lines.append("stage       ms/batch    p50     p90     p99")
            for c in COLUMNS:
                p = self.percentiles(c)
                lines.append(
                    f"{c:<10}{self.seconds[c] / n * 1e3:>9.2f}{p[50]:>8.2f}{p[90]:>8.2f}"
                    f"{p[99]:>8.2f}"
                )
            lines.append(
                f"producers: {max(1, self.workers)} ({self.backend}), "
                f"{self.busy_fraction():.0%} busy; a decoded batch was waiting "
                f"{1 - self.starved / n:.0%} of the time"
            )
        lines.append(f"tier: {self.tier}")
        private = self.worker_private
        if private:
            mib = ", ".join(f"{v / 2**20:.0f}" for _, v in sorted(private.items()))
            lines.append(f"worker private memory (MiB): {mib}")
        if self.skipped:
            lines.append(f"{self.skipped} samples skipped (see skipped_samples)")
        return "\n".join(lines)
