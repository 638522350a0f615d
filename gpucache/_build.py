"""Build a store: size every file from stat(), read each straight into its slot, sniff it.

No list of bytes and no concatenation: the buffer is allocated once at the summed size and each
file is ``readinto`` its slice by a thread pool, so peak memory is the data size.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from ._format import pack_strings
from ._sniff import SAMPLE_DTYPE, Kind, SniffError, sniff

log = logging.getLogger("gpucache")

#: The extensions torchvision's ImageFolder accepts (same filter, same order of classes/files).
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


@dataclass(frozen=True)
class Skipped:
    index: int  # position in the input list of files
    path: str
    reason: str


@dataclass
class BuildReport:
    """What a build kept and left out. ``total == kept + len(skipped)`` always."""

    total: int = 0
    kept: int = 0
    counts: dict[str, int] = field(default_factory=dict)  # kept samples by kind
    skipped: list[Skipped] = field(default_factory=list)

    def __str__(self) -> str:
        kinds = ", ".join(f"{k}: {v}" for k, v in sorted(self.counts.items()))
        lines = [f"{self.total} files: {self.kept} kept ({kinds}), {len(self.skipped)} skipped"]
        lines += [f"  skipped #{s.index} {s.path}: {s.reason}" for s in self.skipped]
        return "\n".join(lines)


class BuildError(ValueError):
    """Raised by ``on_error="raise"``; ``.report`` lists every bad file with its reason."""

    def __init__(self, report: BuildReport):
        self.report = report
        super().__init__(f"{len(report.skipped)} of {report.total} files cannot be used "
                         f"(pass on_error='skip' to leave them out):\n{report}")


def scan_folder(root: Path) -> tuple[list[str], np.ndarray, list[str]]:
    """Files, labels and class names exactly as ``torchvision.datasets.ImageFolder`` finds them."""
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a folder; from_folder expects root/<class>/<img>")
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    if not classes:
        raise FileNotFoundError(f"no class folders in {root}; from_folder expects the ImageFolder "
                                "layout root/<class>/<image>")
    paths, labels = [], []
    for label, name in enumerate(classes):
        for folder, _, files in sorted(os.walk(root / name, followlinks=True)):
            for f in sorted(files):
                if f.lower().endswith(IMG_EXTENSIONS):
                    paths.append(os.path.join(folder, f))
                    labels.append(label)
    return paths, np.asarray(labels, dtype=np.int64), classes


def check_labels(n: int, labels, classes) -> tuple[np.ndarray, list[str]]:
    if labels is None:
        return np.full(n, -1, dtype=np.int64), list(classes or [])
    arr = np.asarray(labels)
    if arr.shape != (n,) or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"labels must be {n} integers, one per path; got shape {arr.shape} of "
                         f"{arr.dtype}.")
    arr = arr.astype(np.int64)
    top = int(arr.max(initial=-1))
    names = list(classes) if classes is not None else [str(c) for c in range(top + 1)]
    if arr.min(initial=0) < -1 or top >= len(names):
        raise ValueError(f"labels must lie in [-1, {len(names)}) for {len(names)} classes; "
                         f"got [{arr.min()}, {top}]. Pass classes= naming every label.")
    return arr, names


def _read(path: str, slot: memoryview) -> None:
    with open(path, "rb", buffering=0) as f:
        got = f.readinto(slot)
        if got != len(slot) or f.read(1):
            raise SniffError("file changed size while it was being read; rebuild the cache")


def build(cls, paths: Sequence[str], labels: np.ndarray, classes: list[str],
          metadata: list[str] | None, *, on_error: str, num_threads: int | None,
          progress: bool):
    if on_error not in ("skip", "raise"):
        raise ValueError(f"on_error must be 'skip' or 'raise', got {on_error!r}.")
    n = len(paths)
    sizes = np.zeros(n, dtype=np.int64)
    errors: dict[int, str] = {}
    for i, p in enumerate(paths):
        try:
            sizes[i] = os.stat(p).st_size
        except OSError as err:
            errors[i] = f"cannot stat: {err.strerror}"
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    data = np.empty(int(offsets[-1]), dtype=np.uint8)
    samples = np.zeros(n, dtype=SAMPLE_DTYPE)
    view = memoryview(data)

    def load(i: int) -> None:
        if i in errors:
            return
        slot = view[offsets[i]:offsets[i + 1]]
        try:
            _read(paths[i], slot)
            info = sniff(slot)
        except SniffError as err:
            errors[i] = str(err)
            return
        except OSError as err:
            errors[i] = f"cannot read: {err.strerror or err}"
            return
        samples[i] = (info.kind, info.components, info.orientation, info.precision,
                      info.height, info.width)

    threads = num_threads or min(16, 4 * (os.cpu_count() or 1))
    with ThreadPoolExecutor(threads) as pool:
        for _ in tqdm(pool.map(load, range(n)), total=n, desc="gpucache build", unit="file",
                      disable=not progress or None, leave=False):
            pass
    keep = np.ones(n, dtype=bool)
    keep[list(errors)] = False
    report = BuildReport(total=n, kept=int(keep.sum()),
                         counts=dict(Counter(Kind(k).name for k in samples["kind"][keep])),
                         skipped=[Skipped(i, paths[i], errors[i]) for i in sorted(errors)])
    if errors and on_error == "raise":
        raise BuildError(report)
    if errors:  # compact in place: bad files' bytes are squeezed out, order kept
        dst = 0
        for i in np.flatnonzero(keep):
            a, b = offsets[i], offsets[i + 1]
            data[dst:dst + b - a] = data[a:b]
            dst += b - a
        data = data[:dst]
        log.warning("gpucache: skipped %d of %d files (see cache.report):\n%s", len(errors), n,
                    "\n".join(f"  #{s.index} {s.path}: {s.reason}" for s in report.skipped[:20]))
    kept_sizes = sizes[keep]
    offsets = np.zeros(len(kept_sizes) + 1, dtype=np.int64)
    np.cumsum(kept_sizes, out=offsets[1:])
    kept_paths = [p for p, k in zip(paths, keep) if k]
    meta = None if metadata is None else pack_strings([m for m, k in zip(metadata, keep) if k])
    return cls(data=data, offsets=offsets, labels=labels[keep].copy(), samples=samples[keep],
               classes=classes, paths=pack_strings(kept_paths), metadata=meta, report=report)
