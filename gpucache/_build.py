"""Build a store: size every input first, read each straight into its slot, sniff it.

An input is a path or a :class:`Source` (a name, a size known before reading, and ``readinto``).
No list of bytes and no concatenation: the buffer is allocated once at the summed size and each
input is read into its slice by a thread pool, so peak memory is the data size.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol, Union, runtime_checkable

import numpy as np
from ._progress import tqdm

from ._format import pack_strings
from ._limits import DEFAULT_MAX_PIXELS, over_budget
from ._readonly import writable_buffer
from ._sniff import SAMPLE_DTYPE, Kind, SniffError, sniff

log = logging.getLogger("gpucache")

#: The extensions torchvision's ImageFolder accepts (same filter, same order of classes/files).
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


@runtime_checkable
class Source(Protocol):
    """One encoded image that is not a file of its own (bytes, a file-like, a tar member...).

    ``name`` is what reports and ``cache.paths`` show; ``nbytes`` is its size, known before
    reading; ``readinto(slot)`` fills exactly ``len(slot) == nbytes`` bytes or raises ``OSError``
    (or :class:`SniffError`). It is called once, from a build thread."""

    name: str
    nbytes: int

    def readinto(self, slot: memoryview) -> None: ...


@dataclass(frozen=True)
class BytesSource:
    """Bytes in memory (bytes, bytearray, memoryview, uint8 array): copied once, into the slot."""

    name: str
    data: bytes | bytearray | memoryview | np.ndarray

    @property
    def nbytes(self) -> int:
        return memoryview(self.data).nbytes

    def readinto(self, slot: memoryview) -> None:
        slot[:] = memoryview(self.data).cast("B")


class FileObjSource:
    """A seekable binary file-like object, from its current position to its end (or ``nbytes``).

    Sources that share one file object must share one ``lock`` (reads seek, then read)."""

    def __init__(self, name: str, file: IO[bytes], *, nbytes: int | None = None,
                 lock: threading.Lock | None = None) -> None:
        self.name, self.file, self._lock = name, file, lock or threading.Lock()
        self._start = file.tell()
        if nbytes is None:
            nbytes = file.seek(0, os.SEEK_END) - self._start
            file.seek(self._start)
        self.nbytes = int(nbytes)

    def readinto(self, slot: memoryview) -> None:
        with self._lock:
            self.file.seek(self._start)
            _fill(self.file, slot)


@dataclass(frozen=True)
class FileRangeSource:
    """``nbytes`` bytes at ``offset`` of the file at ``path`` (a tar member, a packed shard...).

    Read with ``os.pread``, so many ranges of one file are read in parallel without a lock."""

    name: str
    path: str | os.PathLike
    offset: int
    nbytes: int

    def readinto(self, slot: memoryview) -> None:
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            done = 0
            while done < len(slot):
                got = os.preadv(fd, [slot[done:]], self.offset + done)
                if got == 0:
                    raise SniffError(f"file ends {len(slot) - done} bytes before the end of the "
                                     f"range [{self.offset}, {self.offset + len(slot)})")
                done += got
        finally:
            os.close(fd)


Input = Union[str, os.PathLike, Source]


def _fill(f, slot: memoryview) -> None:
    """Read exactly ``len(slot)`` bytes from ``f`` (short reads retried), then expect its end."""
    done = 0
    while done < len(slot):
        got = f.readinto(slot[done:])
        if not got:
            break
        done += got
    if done != len(slot) or f.read(1):
        raise SniffError("the input changed size while it was being read; rebuild the cache")


class _PathSource:
    """A path, sized by ``stat`` and refused unless a regular file (a FIFO would block the read)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.name = os.fspath(path)
        st = os.stat(self.name)
        if not stat.S_ISREG(st.st_mode):
            raise SniffError(f"not a regular file ({_file_type(st.st_mode)}), left unopened")
        self.nbytes = st.st_size

    def readinto(self, slot: memoryview) -> None:
        # O_NONBLOCK: if the path became a FIFO since stat, opening it still cannot block.
        fd = os.open(self.name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with open(fd, "rb", buffering=0) as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise SniffError(f"not a regular file ({_file_type(st.st_mode)})")
            _fill(f, slot)


def _file_type(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISDIR, "a folder")):
        if test(mode):
            return name
    return "not a plain file"


def _as_source(x: Input) -> Source:
    if isinstance(x, (str, os.PathLike)):
        return _PathSource(x)
    if isinstance(x, Source):
        return x
    raise TypeError(f"expected a path (str or os.PathLike) or a source with name, nbytes and "
                    f"readinto (e.g. gpucache._build.BytesSource), got {type(x).__name__}")


def _name(x) -> str:
    if isinstance(x, (str, os.PathLike)):
        return os.fspath(x)
    return str(getattr(x, "name", f"<{type(x).__name__}>"))


@dataclass(frozen=True)
class Skipped:
    index: int  # position in the input list
    path: str  # the path, or the source's name
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


def build(cls, inputs: Sequence[Input], labels: np.ndarray, classes: list[str],
          metadata: list[str] | None, *, on_error: str, num_threads: int | None,
          progress: bool, max_pixels: int | None = DEFAULT_MAX_PIXELS):
    """Pack ``inputs`` (paths or :class:`Source` objects) into ``cls(...)``.

    Every input is sniffed (headers only); one whose header claims more than ``max_pixels``
    pixels (None: no bound) is refused like a corrupt one: skipped with the reason, or a
    :class:`BuildError` under ``on_error="raise"``."""
    if on_error not in ("skip", "raise"):
        raise ValueError(f"on_error must be 'skip' or 'raise', got {on_error!r}.")
    if max_pixels is not None and max_pixels < 1:
        raise ValueError(f"max_pixels must be a positive number of pixels or None (no bound), "
                         f"got {max_pixels!r}.")
    n = len(inputs)
    names = [_name(x) for x in inputs]
    sources: list[Source | None] = [None] * n
    sizes = np.zeros(n, dtype=np.int64)
    errors: dict[int, str] = {}

    def size(i: int) -> None:
        try:
            src = _as_source(inputs[i])
            nbytes = int(src.nbytes)
        except SniffError as err:
            errors[i] = str(err)
            return
        except (OSError, ValueError) as err:  # ValueError: a path with a NUL byte
            errors[i] = f"cannot stat: {getattr(err, 'strerror', None) or err}"
            return
        if nbytes < 0:
            errors[i] = f"the source reports a negative size ({nbytes} bytes)"
            return
        sources[i], sizes[i] = src, nbytes

    threads = num_threads or min(16, 4 * (os.cpu_count() or 1))
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(size, range(n)))  # raises the TypeError of an input of the wrong type
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        data = writable_buffer(int(offsets[-1]))  # made read-only in place by the store: no 2x
        samples = np.zeros(n, dtype=SAMPLE_DTYPE)
        view = memoryview(data)

        def load(i: int) -> None:
            src = sources[i]
            if src is None:
                return
            slot = view[offsets[i]:offsets[i + 1]]
            try:
                src.readinto(slot)
                info = sniff(slot)
            except SniffError as err:
                errors[i] = str(err)
                return
            except OSError as err:
                errors[i] = f"cannot read: {err.strerror or err}"
                return
            why = over_budget(info.height, info.width, max_pixels)
            if why is not None:
                errors[i] = f"header claims {why}"
                return
            samples[i] = (info.kind, info.components, info.orientation, info.precision,
                          info.height, info.width)

        for _ in tqdm(pool.map(load, range(n)), total=n, desc="gpucache build", unit="file",
                      disable=not progress or None, leave=False):
            pass
    keep = np.ones(n, dtype=bool)
    keep[list(errors)] = False
    report = BuildReport(total=n, kept=int(keep.sum()),
                         counts=dict(Counter(Kind(k).name for k in samples["kind"][keep])),
                         skipped=[Skipped(i, names[i], errors[i]) for i in sorted(errors)])
    if errors and on_error == "raise":
        raise BuildError(report)
    if errors:  # compact in place: bad inputs' bytes are squeezed out, order kept
        dst = 0
        for i in np.flatnonzero(keep):
            a, b = offsets[i], offsets[i + 1]
            data[dst:dst + b - a] = data[a:b]
            dst += b - a
        view.release()
        if data.flags.owndata:
            data.resize(dst, refcheck=False)  # shrinks in place (no copy, no view of a larger array)
        else:  # a _readonly.writable_buffer: the store freezes this view of it in place
            data = data[:dst]
        log.warning("gpucache: skipped %d of %d files (see cache.report):\n%s", len(errors), n,
                    "\n".join(f"  #{s.index} {s.path}: {s.reason}" for s in report.skipped[:20]))
    kept_sizes = sizes[keep]
    offsets = np.zeros(len(kept_sizes) + 1, dtype=np.int64)
    np.cumsum(kept_sizes, out=offsets[1:])
    kept_names = [p for p, k in zip(names, keep) if k]
    meta = None if metadata is None else pack_strings([m for m, k in zip(metadata, keep) if k])
    return cls(data=data, offsets=offsets, labels=labels[keep].copy(), samples=samples[keep],
               classes=classes, paths=pack_strings(kept_names), metadata=meta, report=report)
