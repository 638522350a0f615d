"""Reading a store file: every field a reader relies on is checked before a view is handed out.

Opening is O(index + optional sections): header and directory CRCs, the file size, every section's
bounds (none overlaps another or the header), index and per-section CRCs, offsets, labels, sample
records (kind, components, orientation, size), string tables, and the type, shape, values and
companions of every optional section gpucache reads (``_sections``). Image data is mapped, never
read (``gpucache verify`` checks its CRCs and decodes every sample).

Each process checks a store once: a worker that attached to the very file its parent opened and
validated (same device, inode, size and header CRC, see ``_mapped``) parses it with
``trusted=True``, which keeps the O(1) checks (header, bounds, directory) and skips the O(N) ones.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path
from types import MappingProxyType
from typing import NoReturn, overload

import numpy as np
import numpy.typing as npt

from .._errors import CacheFormatError
from . import _sections
from ._checksum import crc32_of
from ._format import (
    CORE,
    CRC,
    ENTRY,
    HEAD_V2,
    HEADER_SIZE,
    KINDS,
    MAGIC,
    NAME,
    SAMPLE_DTYPE,
    VERSION,
    Kind,
    decode,
)
from ._mapped import Handle, open_path

_KINDS = np.array([int(k) for k in Kind], dtype=np.uint8)


class Parsed:
    """Read-only numpy views over a mapped, validated store file."""

    def __init__(self, handle: Handle, *, trusted: bool = False):
        self.handle, self.path, self.buf = handle, handle.path, handle.buf
        self._trusted = trusted
        self._name = handle.name
        buf, size = self.buf, len(self.buf)
        if size < HEADER_SIZE:
            self._fail(
                f"too small to be a gpucache store ({size} bytes; the header alone is "
                f"{HEADER_SIZE})"
            )
        head = bytes(buf[:HEADER_SIZE])
        if head[:8] != MAGIC:
            self._fail(
                f"not a gpucache store (magic {head[:8]!r}, expected {MAGIC!r})",
                "pass a file written by JpegCache.save() or `gpucache build`",
            )
        (self.version,) = struct.unpack_from("<I", head, 8)
        if self.version != VERSION:
            self._fail(
                f"format version {self.version} is not supported by this gpucache (it reads "
                f"version {VERSION}"
                + (
                    "; version 1 was a development format, never released"
                    if self.version == 1
                    else ""
                )
                + ")",
                "rebuild it with this version's `gpucache build`",
            )
        fields = HEAD_V2.unpack_from(head)
        (crc,) = CRC.unpack_from(head, HEAD_V2.size)
        if zlib.crc32(head[: HEAD_V2.size]) != crc:
            self._fail("header checksum mismatch (the header is corrupt)")
        _, _, hsize, n, n_classes, file_size = fields[:6]
        self.data_crc, index_crc = fields[20:22]
        if hsize != HEADER_SIZE:
            self._fail(f"header size {hsize} != {HEADER_SIZE}")
        if file_size != size:
            self._fail(
                f"truncated or extended: the header says {file_size} bytes, the file has {size}"
            )
        spans = dict(zip(CORE, zip(fields[6:20:2], fields[7:20:2])))
        directory = (fields[22], ENTRY.size * fields[23])
        self._check_bounds({**spans, "directory": directory}, size)
        expected = {"offsets": 8 * (n + 1), "labels": 8 * n, "samples": SAMPLE_DTYPE.itemsize * n}
        for name, length in expected.items():
            if spans[name][1] != length:
                self._fail(
                    f"section {name!r} has {spans[name][1]} bytes, {length} expected for "
                    f"{n} samples"
                )
        crc = 0
        for name in CORE[:-1]:
            start, length = spans[name]
            crc = crc if trusted else self._crc(start, length, crc)
        if not trusted and crc != index_crc:
            self._fail("index checksum mismatch (offsets, labels or names are corrupt)")
        start, length = directory
        if self._crc(start, length) != fields[24]:
            self._fail("section directory checksum mismatch (the directory is corrupt)")
        extra_spans = self._directory(start, fields[23])
        self._check_bounds(
            {**spans, "directory": directory, **{k: v[:2] for k, v in extra_spans.items()}},
            size,
        )
        self._views(spans, n, n_classes)
        self.extra = MappingProxyType({k: self._extra(k, *v) for k, v in extra_spans.items()})
        why = _sections.problem(self.extra, n, values=not trusted, samples=self.samples)
        if why is not None:
            self._fail(why)

    def _crc(self, start: int, length: int, crc: int = 0) -> int:
        with memoryview(self.buf) as mv:  # no copy of the bytes
            return crc32_of(mv[start : start + length], crc)

    def _fail(
        self, why: str, fix: str = "rebuild it with `gpucache build` or copy it again"
    ) -> NoReturn:
        raise CacheFormatError(f"{self._name}: {why}; {fix}.")

    def _check_bounds(self, spans: dict[str, tuple[int, int]], size: int) -> None:
        """Every section inside the file, after the header, and no two overlapping."""
        placed = []
        for name, (start, length) in spans.items():
            if start + length > size or (length and start < HEADER_SIZE):
                self._fail(
                    f"section {name!r} at [{start}, {start + length}) is out of bounds "
                    f"(the file has {size} bytes)"
                )
            if length:
                placed.append((start, start + length, name))
        placed.sort()
        for (_, end, a), (start, _, b) in zip(placed, placed[1:]):
            if start < end:
                self._fail(f"sections {a!r} and {b!r} overlap")

    def _directory(
        self, start: int, count: int
    ) -> dict[str, tuple[int, int, np.dtype, int, int, int]]:
        out: dict[str, tuple[int, int, np.dtype, int, int, int]] = {}
        for k in range(count):
            raw, dtype, off, length, rows, cols, crc, _ = ENTRY.unpack_from(
                self.buf, start + k * ENTRY.size
            )
            name = raw.rstrip(b"\0").decode("ascii", "replace")
            if not NAME.match(name) or name in out:
                self._fail(f"optional section #{k} has an invalid or repeated name {raw!r}")
            try:
                dt = np.dtype(dtype.rstrip(b"\0").decode("ascii"))
            except (TypeError, ValueError, UnicodeDecodeError):
                dt = None
            if dt is None or dt.kind not in KINDS or dt.byteorder == ">":
                self._fail(f"optional section {name!r} has an invalid element type {dtype!r}")
            if rows * max(cols, 1) * dt.itemsize != length:
                self._fail(
                    f"optional section {name!r} has {length} bytes, not {rows} x "
                    f"{max(cols, 1)} x {dt.itemsize}"
                )
            out[name] = (off, length, dt, rows, cols, crc)
        return out

    def _extra(
        self, name: str, start: int, length: int, dtype: np.dtype, rows: int, cols: int, crc: int
    ) -> np.ndarray:
        if not self._trusted and self._crc(start, length) != crc:
            self._fail(f"optional section {name!r} checksum mismatch (it is corrupt)")
        arr = np.frombuffer(self.buf, dtype=dtype, count=rows * max(cols, 1), offset=start)
        return arr.reshape(rows, cols) if cols else arr

    def _views(self, spans: dict[str, tuple[int, int]], n: int, n_classes: int) -> None:
        def view(name: str, dtype: npt.DTypeLike, count: int) -> np.ndarray:
            return np.frombuffer(self.buf, dtype=dtype, count=count, offset=spans[name][0])

        self.offsets = view("offsets", "<i8", n + 1)
        self.labels = view("labels", "<i8", n)
        self.samples = view("samples", SAMPLE_DTYPE, n)
        data_start, data_len = spans["data"]
        self.data = view("data", np.uint8, data_len)
        c_offsets, c_blob = self._strings("classes", spans["classes"], n_classes)
        self.classes = [
            decode(bytes(c_blob[c_offsets[i] : c_offsets[i + 1]])) for i in range(n_classes)
        ]
        self.paths = self._strings("paths", spans["paths"], n)
        self.metadata = self._strings("metadata", spans["metadata"], n, optional=True)
        if self._trusted:
            return
        if n and (
            self.offsets[0] != 0
            or np.any(np.diff(self.offsets) < 0)
            or self.offsets[-1] != data_len
        ):
            self._fail("sample offsets are not monotonic or point outside the data section")
        if n == 0 and data_len != 0:
            self._fail("data section is not empty but there are no samples")
        s = self.samples
        bad = (
            ~np.isin(s["kind"], _KINDS)
            | (s["height"] == 0)
            | (s["width"] == 0)
            | (s["components"] < 1)
            | (s["components"] > 4)
            | (s["orientation"] < 1)
            | (s["orientation"] > 8)
        )
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            self._fail(
                f"sample {i} has an invalid record (kind {s['kind'][i]}, "
                f"{s['components'][i]} components, orientation {s['orientation'][i]}, "
                f"{s['height'][i]}x{s['width'][i]}); {int(bad.sum())} records are invalid"
            )
        if n and (self.labels.min() < -1 or self.labels.max() >= n_classes):
            self._fail(f"labels out of range for {n_classes} classes")

    @overload
    def _strings(
        self, name: str, span: tuple[int, int], n: int
    ) -> tuple[np.ndarray, np.ndarray]: ...
    @overload
    def _strings(
        self, name: str, span: tuple[int, int], n: int, optional: bool
    ) -> tuple[np.ndarray, np.ndarray] | None: ...
    def _strings(
        self, name: str, span: tuple[int, int], n: int, optional: bool = False
    ) -> tuple[np.ndarray, np.ndarray] | None:
        start, length = span
        if length == 0 and optional:
            return None
        if length < 8:
            self._fail(f"string section {name!r} is too short")
        (count,) = struct.unpack_from("<Q", self.buf, start)
        if count != n:
            self._fail(f"section {name!r} has {count} strings, {n} expected")
        if 8 + 8 * (count + 1) > length:
            self._fail(f"section {name!r} is shorter than its {count} string offsets")
        offsets = np.frombuffer(self.buf, dtype="<u8", count=count + 1, offset=start + 8)
        blob_len = length - 8 - 8 * (count + 1)
        blob = np.frombuffer(
            self.buf, dtype=np.uint8, count=blob_len, offset=start + 8 + 8 * (count + 1)
        )
        # any bytes are a valid string (UTF-8 with surrogateescape): only the offsets are checked
        if not self._trusted and (
            offsets[0] != 0 or offsets[-1] != blob_len or np.any(offsets[1:] < offsets[:-1])
        ):
            self._fail(f"string offsets in section {name!r} are not monotonic or out of bounds")
        return offsets, blob


def open_mapped(path: Path) -> Parsed:
    """Map ``path`` read-only and validate it; O(index), data untouched."""
    return Parsed(open_path(path))
