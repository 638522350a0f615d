"""Build a store: size every input, then read and sniff them in chunks into one buffer.

An input is a path or a :class:`Source` (a name, a size known before reading, and ``readinto``).
No list of bytes and no object per input: the buffer is reserved once at the summed size and the
kept bytes are appended to it chunk by chunk (``_pipeline``), so the build peaks at the data plus
the store's index arrays plus the chunks in flight (O(threads x chunk)). Optional rewriters
re-encode images (over a size cap, ``max_side``; at a quality, ``jpeg_quality``) or transcode
JPEGs with restart markers on the way, each sample once, into the same buffer; the re-encodes'
decoded pixels, across all threads, stay within one budget (``_resize.MEMORY_BUDGET``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np
import numpy.typing as npt

from .._errors import BuildError
from ..base._progress import tqdm
from ..base._threads import ordered_map
from ..shares import _select
from ..shares._select import Taken
from ..store._format import MAGIC, Columns
from ..store._limits import pixel_budget
from ..store._report import BuildReport, Skipped
from ..store._store import S, Store
from . import _pipeline
from ._inputs import BytesSource, FileObjSource, FileRangeSource, Input, Samples, Source, name_of
from ._lazy import OnAccess
from ._options import BuildOptions
from ._restart import rewriters
from ._sniff import Kind

__all__ = [
    "BytesSource",
    "FileObjSource",
    "FileRangeSource",
    "Input",
    "Source",
    "Skipped",
    "BuildReport",
    "scan_folder",
    "check_labels",
    "build",
]

log = logging.getLogger(__name__)

#: The extensions torchvision's ImageFolder accepts (same filter, same order of classes/files).
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


class PathList(OnAccess[str]):
    """File paths, packed: per path a folder index and its name's bytes (about 25 bytes a path,
    not the 100 of a ``str`` object; 1.4 GB less at 14M files). Each item is made on access and
    is the very ``str`` ``os.walk`` gave (non-UTF-8 bytes kept by ``surrogateescape``)."""

    def __init__(
        self, prefixes: list[str], folder_of: array[int], ends: array[int], blob: bytes
    ) -> None:
        self._prefixes, self._folder_of, self._ends, self._blob = prefixes, folder_of, ends, blob

    def __len__(self) -> int:
        return len(self._folder_of)

    def item(self, i: int) -> str:
        start = self._ends[i - 1] if i > 0 else 0
        return self._prefixes[self._folder_of[i]] + os.fsdecode(self._blob[start : self._ends[i]])

    def __iter__(self) -> Iterator[str]:
        return (self[i] for i in range(len(self)))

    def take(self, keep: np.ndarray) -> PathList:
        """The paths at ``keep``, packed the same way."""
        folder_of, ends, blob = array("I"), array("Q"), bytearray()
        for i in keep.tolist():  # the names' bytes appended: no object kept per path
            blob += self._blob[self._ends[i - 1] if i > 0 else 0 : self._ends[i]]
            folder_of.append(self._folder_of[i])
            ends.append(len(blob))
        return PathList(self._prefixes, folder_of, ends, bytes(blob))

    def __repr__(self) -> str:
        return f"<{len(self)} paths>"


def scan_folder(root: Path) -> tuple[PathList, np.ndarray, list[str]]:
    """Files, labels and class names exactly as ``torchvision.datasets.ImageFolder`` finds them.

    Raises ``FileNotFoundError`` when there is no image at all (as torchvision's "Found no valid
    file"); class folders without an image keep their label and are named in a warning."""
    if root.is_file():
        raise NotADirectoryError(_not_a_folder(root))
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a folder; from_folder expects root/<class>/<img>")
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    if not classes:
        raise FileNotFoundError(
            f"no class folders in {root}; from_folder expects the ImageFolder "
            f"layout root/<class>/<image>{_flat_hint(root)}"
        )
    prefixes: list[str] = []
    folder_of, ends, blobs, end = array("I"), array("Q"), [], 0
    counts = np.zeros(len(classes), dtype=np.int64)
    for label, name in enumerate(classes):
        before = len(ends)
        for folder, _, files in sorted(os.walk(root / name, followlinks=True)):
            names = [os.fsencode(f) for f in sorted(files) if f.lower().endswith(IMG_EXTENSIONS)]
            if not names:
                continue
            folder_of.extend([len(prefixes)] * len(names))
            prefixes.append(os.path.join(folder, ""))
            for b in names:
                end += len(b)
                ends.append(end)
            blobs.append(b"".join(names))
        counts[label] = len(ends) - before
    empty = [c for c, k in zip(classes, counts) if k == 0]
    if len(empty) == len(classes):
        raise FileNotFoundError(
            f"found no image in {root}: none of its {len(classes)} class folders ("
            f"{', '.join(classes[:5])}{', ...' if len(classes) > 5 else ''}) holds a file ending "
            f"in {', '.join(IMG_EXTENSIONS)}; from_folder expects root/<class>/<image> (put the "
            f"images one level down, in a folder per class){_flat_hint(root)}"
        )
    if empty:
        log.warning(
            "gpucache: %d class folders of %s hold no image and keep their label with no "
            "sample: %s",
            len(empty),
            root,
            ", ".join(empty[:10]),
        )
    paths = PathList(prefixes, folder_of, ends, b"".join(blobs))
    return paths, np.repeat(np.arange(len(classes), dtype=np.int64), counts), classes


def _not_a_folder(root: Path) -> str:
    """Why a file is no ImageFolder root, and what opens it when it is a store."""
    try:
        with open(root, "rb") as f:
            store = f.read(len(MAGIC)) == MAGIC
    except OSError:  # unreadable: said as a file all the same
        store = False
    if not store:
        return f"{root} is a file, not a folder; from_folder expects root/<class>/<img>"
    return (
        f"{root} is a gpucache store file, not a folder of images: open it with "
        f"JpegCache.open({os.fspath(root)!r}) (on the command line: gpucache info {root})"
    )


def _flat_hint(root: Path) -> str:
    """For images directly in ``root`` (no class folders): how to build from them."""
    flat = sum(
        1 for e in os.scandir(root) if e.is_file() and e.name.lower().endswith(IMG_EXTENSIONS)
    )
    if not flat:
        return ""
    return (
        f". It holds {flat:,} images directly: to pack them unlabeled, pass their paths to "
        "JpegCache.from_files (e.g. sorted(glob.glob(...))), or list them one per row in a CSV "
        "(path[,label]) for JpegCache.from_csv / gpucache build --csv"
    )


def check_labels(
    n: int, labels: npt.ArrayLike | None, classes: Sequence[str] | None
) -> tuple[np.ndarray, list[str]]:
    if labels is None:
        return np.full(n, -1, dtype=np.int64), list(classes or [])
    arr = np.asarray(labels)
    if arr.shape != (n,) or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(
            f"labels must be {n} integers, one per path; got shape {arr.shape} of {arr.dtype}."
        )
    arr = arr.astype(np.int64)
    top = int(arr.max(initial=-1))
    names = list(classes) if classes is not None else [str(c) for c in range(top + 1)]
    if arr.min(initial=0) < -1 or top >= len(names):
        raise ValueError(
            f"labels must lie in [-1, {len(names)}) for {len(names)} classes; "
            f"got [{arr.min()}, {top}]. Pass classes= naming every label."
        )
    return arr, names


def build(
    cls: type[S],
    inputs: Sequence[Input],
    samples: Samples,
    options: BuildOptions,
    *,
    on_progress: Callable[[int, int, int], None] | None = None,
    extra: Mapping[str, np.ndarray] | None = None,
    taken: Taken | None = None,
) -> S:
    """Pack ``inputs`` (paths or :class:`Source` objects), with their labels, metadata and masks
    (``samples``), into ``cls(...)``, as ``options`` say.

    Every input is sized (capped under ``max_pixels``, see ``_limits.too_big``) and sniffed
    (headers only); one whose header claims more than ``max_pixels`` pixels (None: no bound) is
    refused like a corrupt one: skipped with the reason, or a :class:`BuildError` under
    ``on_error="raise"``. A build that keeps no sample raises :class:`BuildError` either way.
    ``max_side``: images whose long side is larger are re-encoded once, to that long side;
    ``jpeg_quality``: the quality of those re-encodes, and every other image re-encoded at it
    where that saves bytes (``_resize``); ``restart_markers``: JPEGs are transcoded with restart
    markers (``_restart``). ``on_progress(done, total, bytes_read)`` is called after each chunk.
    ``extra``: optional sections to store as they are (one row per input if per-sample).
    ``samples.masks``: one mask input (path or :class:`Source`) per input, read and checked with
    its image (``_masks.check_mask``); an image whose mask is missing or unusable is a bad input,
    its reason naming the mask.
    ``options.share`` (``shard="node"``): ``inputs`` are the whole listing, of which this node's
    share is built (``_select.pick``), unless ``taken`` says they are that share already (taken
    before a fetch); its size is checked against memory, the node cache and ``cache_max_bytes``
    before a byte is read, and the store records it. Samples that stores of earlier layouts on
    this node hold are taken from them (``_select.reuse``; ``taken.reused`` marks those a caller
    took before a fetch), unless the build re-encodes."""
    max_pixels = options.max_pixels
    n = len(inputs)
    masks = samples.masks
    if masks is not None and len(masks) != n:
        raise ValueError(f"masks has {len(masks)} entries for {n} images; give one mask per image.")
    steps = rewriters(
        restart_markers=options.restart_markers,
        max_side=options.max_side,
        jpeg_quality=options.jpeg_quality,
    )
    share = options.share
    selected, reused = (None, None) if taken is None else taken
    if share is not None and selected is None:
        inputs, samples, selected = _select.pick(share, inputs, samples)
        n = len(inputs)
        if not steps:  # stored bytes are the source's: an earlier share's are as good
            inputs, masks, reused = _select.reuse(selected, inputs, samples.masks)
            samples = dataclasses.replace(samples, masks=masks)
    labels, metadata, masks = samples.labels, samples.metadata, samples.masks
    threads = options.num_threads or _pipeline.default_threads()
    window = 2 * threads
    bar = tqdm(
        total=n,
        desc="gpucache build",
        unit="file",
        disable=not options.progress or None,
        leave=False,
    )
    done = [0, 0]

    def tick(files: int, nbytes: int) -> None:
        done[0] += files
        done[1] += nbytes
        bar.update(files)
        if on_progress is not None:
            on_progress(done[0], n, done[1])

    with bar, ThreadPoolExecutor(threads, thread_name_prefix="gpucache-build") as pool:
        sized = _pipeline.size_all(pool, inputs, max_pixels, window, tick)
        cum, refused = sized
        total = int(cum[-1])
        if share is not None:
            _select.check_budget(total, share, options, memory=_memory())
        if total > _memory() > 0:
            raise MemoryError(
                f"the {n - len(refused):,} inputs add up to {total / 2**30:,.1f} GiB, more than "
                f"this machine's {_memory() / 2**30:,.1f} GiB of memory; a store is built in "
                "memory: build it from a part of the inputs per store, or on a larger machine"
            )
        reserve = total if not steps else min(2 * total + 4096 * n, max(total, _memory()))
        columns = {k: dt for rw in steps for k, dt in rw.columns.items()}
        out = _pipeline.Assembler(n, reserve, columns, labels, metadata, masks is not None)
        chunk_bytes = max(_pipeline.MIN_CHUNK_BYTES, _pipeline.in_flight(total) // window)
        scratch = _pipeline.Scratch(chunk_bytes)
        read = partial(
            _pipeline.read_chunk,
            inputs=inputs,
            samples=samples,
            sized=sized,
            max_pixels=max_pixels,
            rewriters=steps,
            scratch=scratch,
        )
        errors = dict(refused)
        tick(len(refused), 0)
        for chunk in ordered_map(read, _pipeline.chunks(cum, chunk_bytes), pool, window=window):
            out.add(chunk)
            scratch.put(chunk.raw)
            errors.update(chunk.errors)
            skipped = sum(1 for i in range(chunk.a, chunk.b) if i in refused) if refused else 0
            tick(chunk.b - chunk.a - skipped, chunk.nbytes)
    k = out.count
    kinds = np.bincount(out.samples["kind"][:k], minlength=max(Kind) + 1)
    report = BuildReport(
        total=n,
        kept=k,
        counts={Kind(v).name: int(c) for v, c in enumerate(kinds) if c},
        skipped=[Skipped(i, name_of(inputs[i]), errors[i]) for i in sorted(errors)],
    )
    if errors and options.on_error == "raise" or k == 0:
        raise BuildError(report)
    if errors:
        log.warning(
            "gpucache: skipped %d of %d files (all of them in the build report: "
            "cache.report in Python, gpucache info --skipped STORE for a saved store)"
            ":\n%s",
            len(errors),
            n,
            "\n".join(f"  #{s.index} {s.path}: {s.reason}" for s in report.skipped[:20]),
        )
    paths = out.strings(out.name_ends, lambda i: name_of(inputs[i]))
    meta = None
    if metadata is not None:
        assert out.meta_ends is not None  # made for the metadata
        meta = out.strings(out.meta_ends, lambda i: str(metadata[i]))
    sections = {**(extra or {}), **{name: col[:k] for name, col in out.columns.items()}}
    sections.update(out.mask_sections())
    if share is not None and selected is not None:
        kept = np.setdiff1d(np.arange(n), np.fromiter(errors, np.int64, len(errors)))
        took = np.zeros(n, dtype=bool) if reused is None else reused
        sizes = np.diff(cum)
        fetched = (
            int((~took).sum()),
            int(sizes[~took].sum()),
            int(took.sum()),
            int(sizes[took].sum()),
        )
        sections.update(_select.record(selected, share, kept, fetched))
        if took.any():
            log.warning(
                "gpucache: node %d of %d read %d samples (%.1f MB) from the source and took %d "
                "(%.1f MB) from its stores of an earlier node layout",
                share.node,
                share.nodes,
                fetched[0],
                fetched[1] / 1e6,
                fetched[2],
                fetched[3] / 1e6,
            )
    for rw in steps:
        sections.update(rw.sections(out.columns, k))
    return cls(
        Columns(
            data=out.data[: out.cursor],
            offsets=out.offsets[: k + 1],
            labels=out.labels[:k],
            samples=out.samples[:k],
            classes=samples.classes,
            paths=paths,
            metadata=meta,
            extra=sections,
        ),
        report=report,
    )


def _memory() -> int:
    """Physical memory in bytes (0 if unknown)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


class _Samples(OnAccess[BytesSource]):
    """A store's samples as build inputs (views of its buffer, made on demand: O(1) memory)."""

    def __init__(self, cache: Store) -> None:
        self._cache, self._paths = cache, cache.paths

    def __len__(self) -> int:
        return len(self._cache)

    def item(self, i: int) -> BytesSource:
        return BytesSource(self._paths[i], self._cache[i])


def restart_store(cache: S, *, num_threads: int | None = None, progress: bool = False) -> S:
    """A new in-memory store of ``cache``'s samples, transcoded with restart markers (same pixels).

    Labels, paths, metadata, the build report and other sections are kept; transcoded samples
    become baseline (``Kind.JPEG``) and their interval goes to the ``rst`` section. Peaks at
    ``cache`` plus its transcoded copy; to build from files at about one copy, pass
    ``restart_markers=True`` to the builder instead. Samples are held to ``cache``'s pixel
    budget as at any build (the transcoder allocates the whole image's coefficients): one over it
    raises ``BuildError``."""
    out = build(
        type(cache),
        _Samples(cache),
        Samples(np.asarray(cache.labels), cache.classes, cache.metadata),
        BuildOptions(
            on_error="raise",
            num_threads=num_threads,
            progress=progress,
            max_pixels=pixel_budget(cache),
            restart_markers=True,
        ),
        extra=dict(cache.extra),
    )
    out.report, out.max_pixels = cache.report, cache.max_pixels
    return out
