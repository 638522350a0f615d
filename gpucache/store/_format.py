"""Writing the single-file store format (version 2).
``docs/reference/format.md`` specifies it; ``_parse`` reads and validates it; ``_save`` saves a file.

Layout: a 256-byte little-endian header; six index sections (offsets, labels, samples, classes,
paths, metadata) on 64-byte boundaries; the section directory (one 80-byte entry per named optional
section) and those sections, each on a 64-byte boundary; the data section on a 4096-byte boundary.
Named optional sections let features add per-store arrays (per-sample flags, targets) without a
new layout: a reader checks every section's bounds and CRC and ignores names it does not use.
gpucache itself writes ``sample.crc32`` (one CRC-32 per sample, for ``gpucache verify``) and the
``report.*`` sections (the build report); names under ``sample.`` and ``report.`` are reserved.

Strings (class names, paths, metadata, report text) are stored as UTF-8 with ``surrogateescape``:
a file name that is not UTF-8 keeps its exact bytes and reads back as the same ``str``.
"""

from __future__ import annotations

import re
import struct
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import BinaryIO

import numpy as np
import numpy.typing as npt

from . import _checksum

__all__ = [
    "Columns",
    "Kind",
    "JPEG_KINDS",
    "SAMPLE_DTYPE",
    "write",
    "pack_strings",
    "check_extra",
]


class Kind(IntEnum):
    """What a stored sample is. Stored as one byte per sample in the file format."""

    JPEG = 1  # baseline / extended sequential Huffman JPEG
    JPEG_PROGRESSIVE = 2
    JPEG_ARITHMETIC = 3  # arithmetic-coded JPEG (libjpeg-turbo decodes it; nvJPEG does not)
    PNG = 4
    GIF = 5
    WEBP = 6
    OTHER = 7  # another format PIL reads (BMP, TIFF, PPM/PGM)


JPEG_KINDS = (Kind.JPEG, Kind.JPEG_PROGRESSIVE, Kind.JPEG_ARITHMETIC)

#: Per-sample record, little-endian, 12 bytes. Also the on-disk layout of the "samples" section.
SAMPLE_DTYPE = np.dtype(
    [
        ("kind", "u1"),
        ("components", "u1"),
        ("orientation", "u1"),
        ("precision", "u1"),
        ("height", "<u4"),
        ("width", "<u4"),
    ]
)


MAGIC = b"GPUCACHE"
VERSION = 2
HEADER_SIZE = 256
CORE = ("offsets", "labels", "samples", "classes", "paths", "metadata", "data")
# magic, version, header size, n_samples, n_classes, file size, 7 x (offset, length),
# data crc32, index crc32, directory offset, directory entries, directory crc32; then the header
# crc32
HEAD_V2 = struct.Struct("<8sIIQQQ" + "QQ" * len(CORE) + "II" + "QQI")
CRC = struct.Struct("<I")
# a directory entry: name, numpy dtype string, offset, length, rows, cols (0: 1-D), crc32, zero
ENTRY = struct.Struct("<32s8sQQQQII")
NAME = re.compile(r"[a-z][a-z0-9_.]{0,31}\Z")
KINDS = "biuf"  # bool, signed, unsigned, float: no objects, no pointers
RESERVED = ("sample.", "report.")  # sections gpucache writes itself
SAMPLE_CRC = "sample.crc32"


def _raw(a: np.ndarray) -> memoryview:
    """A contiguous array's bytes, as the unsigned bytes a file write or a CRC takes."""
    # numpy's stubs give ndarray the buffer protocol only from Python 3.12 on (numpy#26783)
    return memoryview(a).cast("B")  # type: ignore[arg-type]


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def encode(s: str) -> bytes:
    """A string's stored bytes: UTF-8, with the undecodable bytes of an OS name restored."""
    try:
        return s.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError as err:
        raise ValueError(
            f"{s!r} cannot be stored: it holds a lone surrogate "
            f"({s[err.start]!r}) that is neither text nor a byte of an OS file name; "
            "fix the string (paths from os.listdir/os.fsdecode are always fine)."
        ) from err


def decode(b: bytes) -> str:
    """The ``str`` a stored string was made from (the inverse of :func:`encode`)."""
    return b.decode("utf-8", "surrogateescape")


def pack_strings(strings: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """String blob + uint64 offsets (len+1): strings without one Python object per string kept."""
    encoded = [encode(s) for s in strings]
    offsets = np.zeros(len(encoded) + 1, dtype="<u8")
    np.cumsum([len(e) for e in encoded], out=offsets[1:])
    return offsets, np.frombuffer(b"".join(encoded), dtype=np.uint8)


def _string_section(table: tuple[np.ndarray, np.ndarray] | None) -> list[memoryview]:
    if table is None:
        return []
    offsets, blob = table
    count = np.array([len(offsets) - 1], dtype="<u8")
    return [
        _raw(count),
        _raw(offsets.astype("<u8", copy=False)),
        _raw(np.ascontiguousarray(blob)),
    ]


def check_extra(name: str, array: npt.ArrayLike, *, reserved_ok: bool = False) -> np.ndarray:
    """An optional section as it will be stored: a 1-D or 2-D little-endian numeric array."""
    if not isinstance(name, str) or not NAME.match(name):
        raise ValueError(
            f"section name {name!r} is not allowed: use 1-32 characters of a-z, 0-9, "
            "'_' and '.', starting with a letter (e.g. 'rst', 'targets')."
        )
    if not reserved_ok and name.startswith(RESERVED):
        raise ValueError(
            f"section name {name!r} is reserved: gpucache writes the 'sample.' and "
            "'report.' sections itself; choose another name."
        )
    arr = np.asarray(array)
    if arr.dtype.kind not in KINDS or arr.ndim not in (1, 2):
        raise ValueError(
            f"section {name!r}: a 1-D or 2-D array of bool, integers or floats is "
            f"stored, got {arr.ndim}-D {arr.dtype}; split ragged data into values "
            "and offsets sections."
        )
    return np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))


def _plan(
    parts: dict[str, list[memoryview]], extra: dict[str, np.ndarray]
) -> tuple[dict[str, tuple[int, int]], tuple[int, int], dict[str, tuple[int, int]], int]:
    """Offsets of every section: {name: (start, length)} for the core, the directory, extras."""
    spans, pos = {}, HEADER_SIZE
    for name in CORE[:-1]:
        start = _align(pos, 64)
        pos = start + sum(c.nbytes for c in parts[name])
        spans[name] = (start, pos - start)
    directory = (_align(pos, 64), ENTRY.size * len(extra))
    pos = directory[0] + directory[1]
    extra_spans = {}
    for name, arr in extra.items():
        start = _align(pos, 64)
        pos = start + arr.nbytes
        extra_spans[name] = (start, arr.nbytes)
    start = _align(pos, 4096)
    spans["data"] = (start, sum(c.nbytes for c in parts["data"]))
    return spans, directory, extra_spans, start + spans["data"][1]


@dataclass(frozen=True)
class Columns:
    """A store's arrays, what a ``Store`` holds and a file holds: ``data`` (every sample's bytes,
    uint8), ``offsets`` (N + 1), ``labels`` (N), ``samples`` (N records, ``SAMPLE_DTYPE``),
    ``classes``, ``paths`` and ``metadata`` (string tables: offsets and bytes, ``pack_strings``;
    metadata None without any), and ``extra``, the named optional sections ({name: 1-D or 2-D
    numeric array}), in their order."""

    data: np.ndarray
    offsets: np.ndarray
    labels: np.ndarray
    samples: np.ndarray
    classes: Sequence[str]
    paths: tuple[np.ndarray, np.ndarray]
    metadata: tuple[np.ndarray, np.ndarray] | None = None
    extra: Mapping[str, np.ndarray] = field(default_factory=dict)

    def with_sections(self, sections: Mapping[str, np.ndarray]) -> Columns:
        """These columns with the optional ``sections`` added (or put in place of those of the
        same names)."""
        return replace(self, extra={**self.extra, **sections})


def write(
    f: BinaryIO | None, columns: Columns, *, checksums: bool = False, threads: int | None = None
) -> int:
    """Write a complete store of ``columns`` to the binary file ``f`` (positioned at 0); returns
    its size (``f`` None: the size alone, to check room before writing).

    ``checksums``: add the ``sample.crc32`` section (one CRC-32 per sample, on every core)."""
    data, offsets, labels = columns.data, columns.offsets, columns.labels
    extra = {
        k: check_extra(k, v, reserved_ok=True) for k, v in columns.extra.items() if k != SAMPLE_CRC
    }
    if checksums:
        crcs = (
            np.zeros(len(labels), "<u4")
            if f is None
            else _checksum.sample_crcs(data, offsets, threads=threads)
        )
        extra[SAMPLE_CRC] = crcs
    parts = {
        "offsets": [_raw(offsets.astype("<i8", copy=False))],
        "labels": [_raw(labels.astype("<i8", copy=False))],
        "samples": [_raw(columns.samples.astype(SAMPLE_DTYPE, copy=False))],
        "classes": _string_section(pack_strings(columns.classes)),
        "paths": _string_section(columns.paths),
        "metadata": _string_section(columns.metadata),
        "data": [_raw(np.ascontiguousarray(data))],
    }
    spans, directory, extra_spans, size = _plan(parts, extra)
    if f is None:  # size only, used to check room before writing
        return size
    index_crc = 0
    f.write(b"\0" * HEADER_SIZE)
    for name in CORE[:-1]:
        f.seek(spans[name][0])
        for chunk in parts[name]:
            f.write(chunk)
            index_crc = zlib.crc32(chunk, index_crc)
    entries = b""
    for name, arr in extra.items():
        start, length = extra_spans[name]
        rows, cols = (arr.shape[0], 0) if arr.ndim == 1 else arr.shape
        entries += ENTRY.pack(
            name.encode(),
            arr.dtype.str.encode(),
            start,
            length,
            rows,
            cols,
            zlib.crc32(_raw(arr)),
            0,
        )
        f.seek(start)
        f.write(_raw(arr))
    f.seek(directory[0])
    f.write(entries)
    f.seek(spans["data"][0])
    f.write(parts["data"][0])
    f.truncate(size)
    table = [x for name in CORE for x in spans[name]]
    header = HEAD_V2.pack(
        MAGIC,
        VERSION,
        HEADER_SIZE,
        len(labels),
        len(columns.classes),
        size,
        *table,
        _checksum.crc32(parts["data"][0], threads=threads),
        index_crc,
        directory[0],
        len(extra),
        zlib.crc32(entries),
    )
    f.seek(0)
    f.write(header + CRC.pack(zlib.crc32(header)))
    f.seek(size)
    return size
