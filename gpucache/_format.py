"""The single-file store format (version 1). The README's "File format" section specifies it.

Layout: a 256-byte little-endian header, then seven sections, each starting on a 64-byte boundary
(the data section on a 4096-byte one): offsets, labels, samples, classes, paths, metadata, data.
Only the header and the index sections are read on open; data is mapped, never read, until used.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

import numpy as np

from ._mapped import CacheFormatError, Handle, open_path
from ._sniff import SAMPLE_DTYPE

MAGIC = b"GPUCACHE"
VERSION = 1
HEADER_SIZE = 256
SECTIONS = ("offsets", "labels", "samples", "classes", "paths", "metadata", "data")
# magic, version, header size, n_samples, n_classes, file size, 7 x (offset, length),
# data crc32, index crc32, header crc32
_HEADER = struct.Struct("<8sIIQQQ" + "QQ" * len(SECTIONS) + "II")
_HEADER_CRC = struct.Struct("<I")
_CRC_AT = _HEADER.size  # header crc32 covers bytes [0, _CRC_AT)


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def pack_strings(strings: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """UTF-8 blob + uint64 offsets (len+1): strings without one Python object per string kept."""
    encoded = [s.encode("utf-8") for s in strings]
    offsets = np.zeros(len(encoded) + 1, dtype="<u8")
    np.cumsum([len(e) for e in encoded], out=offsets[1:])
    return offsets, np.frombuffer(b"".join(encoded), dtype=np.uint8)


def _string_section(table: tuple[np.ndarray, np.ndarray] | None) -> list[memoryview]:
    if table is None:
        return []
    offsets, blob = table
    count = np.array([len(offsets) - 1], dtype="<u8")
    return [memoryview(count).cast("B"), memoryview(offsets.astype("<u8", copy=False)).cast("B"),
            memoryview(blob)]


def write(f: BinaryIO | None, *, data: np.ndarray, offsets: np.ndarray, labels: np.ndarray,
          samples: np.ndarray, classes: Sequence[str], paths: tuple[np.ndarray, np.ndarray],
          metadata: tuple[np.ndarray, np.ndarray] | None) -> int:
    """Write a complete store to the binary file ``f`` (positioned at 0); returns its size."""
    parts = {
        "offsets": [memoryview(offsets.astype("<i8", copy=False)).cast("B")],
        "labels": [memoryview(labels.astype("<i8", copy=False)).cast("B")],
        "samples": [memoryview(samples.astype(SAMPLE_DTYPE, copy=False)).cast("B")],
        "classes": _string_section(pack_strings(classes)),
        "paths": _string_section(paths),
        "metadata": _string_section(metadata),
        "data": [memoryview(data)],
    }
    table, pos = [], HEADER_SIZE
    for name in SECTIONS:
        start = _align(pos, 4096 if name == "data" else 64)
        pos = start + sum(chunk.nbytes for chunk in parts[name])
        table += [start, pos - start]
    if f is None:  # size only, used to check room before writing
        return pos
    index_crc = 0
    f.write(b"\0" * HEADER_SIZE)
    for k, name in enumerate(SECTIONS):
        f.seek(table[2 * k])
        for chunk in parts[name]:
            f.write(chunk)
            if name != "data":
                index_crc = zlib.crc32(chunk, index_crc)
    f.truncate(pos)
    header = _HEADER.pack(MAGIC, VERSION, HEADER_SIZE, len(labels), len(classes), pos, *table,
                          zlib.crc32(memoryview(data)), index_crc)
    f.seek(0)
    f.write(header + _HEADER_CRC.pack(zlib.crc32(header)))
    f.seek(pos)
    return pos


def save_atomic(path: Path, **arrays) -> None:
    """Write to a temporary name beside ``path``, fsync, rename, fsync the folder."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class Parsed:
    """Read-only numpy views over a mapped store file."""

    def __init__(self, handle: Handle):
        self.handle, self.path = handle, handle.path
        buf, path = handle.buf, handle.name
        self.buf = buf
        size = len(buf)

        def fail(why: str, fix: str = "rebuild it with `gpucache build` or copy it again") -> None:
            raise CacheFormatError(f"{path}: {why}; {fix}.")

        if size < HEADER_SIZE:
            fail(f"too small to be a gpucache store ({size} bytes; the header alone is "
                 f"{HEADER_SIZE})")
        head = bytes(buf[:HEADER_SIZE])
        if head[:8] != MAGIC:
            fail(f"not a gpucache store (magic {head[:8]!r}, expected {MAGIC!r})",
                 "pass a file written by JpegCache.save() or `gpucache build`")
        fields = _HEADER.unpack_from(head)
        version = fields[1]
        if version != VERSION:
            fail(f"format version {version} is not supported by this gpucache (reads "
                 f"version {VERSION})", "rebuild it with this version's `gpucache build`")
        (crc,) = _HEADER_CRC.unpack_from(head, _CRC_AT)
        if zlib.crc32(head[:_CRC_AT]) != crc:
            fail("header checksum mismatch (the header is corrupt)")
        _, _, hsize, n, n_classes, file_size = fields[:6]
        self.data_crc, index_crc = fields[-2:]
        if hsize != HEADER_SIZE:
            fail(f"header size {hsize} != {HEADER_SIZE}")
        if file_size != size:
            fail(f"truncated or extended: the header says {file_size} bytes, the file has {size}")
        spans = dict(zip(SECTIONS, zip(fields[6:-2:2], fields[7:-2:2])))
        end = HEADER_SIZE
        for name in SECTIONS:
            start, length = spans[name]
            if start < end or start + length > size:
                fail(f"section {name!r} at [{start}, {start + length}) is out of bounds or "
                     "overlaps the previous one")
            end = start + length
        expected = {"offsets": 8 * (n + 1), "labels": 8 * n, "samples": SAMPLE_DTYPE.itemsize * n}
        for name, length in expected.items():
            if spans[name][1] != length:
                fail(f"section {name!r} has {spans[name][1]} bytes, {length} expected for "
                     f"{n} samples")
        crc = 0
        for name in SECTIONS[:-1]:
            start, length = spans[name]
            crc = zlib.crc32(buf[start:start + length], crc)
        if crc != index_crc:
            fail("index checksum mismatch (offsets, labels or names are corrupt)")

        def view(name: str, dtype, count: int = -1) -> np.ndarray:
            return np.frombuffer(buf, dtype=dtype, count=count, offset=spans[name][0])

        self.offsets = view("offsets", "<i8", n + 1)
        self.labels = view("labels", "<i8", n)
        self.samples = view("samples", SAMPLE_DTYPE, n)
        data_start, data_len = spans["data"]
        self.data = np.frombuffer(buf, dtype=np.uint8, count=data_len, offset=data_start)
        if n and (self.offsets[0] != 0 or np.any(np.diff(self.offsets) < 0)
                  or self.offsets[-1] != data_len):
            fail("sample offsets are not monotonic or point outside the data section")
        if n == 0 and data_len != 0:
            fail("data section is not empty but there are no samples")
        c_offsets, c_blob = self._strings("classes", spans["classes"], fail, n_classes)
        self.classes = [bytes(c_blob[c_offsets[i]:c_offsets[i + 1]]).decode("utf-8")
                        for i in range(n_classes)]
        if n and (self.labels.min() < -1 or self.labels.max() >= n_classes):
            fail(f"labels out of range for {n_classes} classes")
        self.paths = self._strings("paths", spans["paths"], fail, n)
        self.metadata = self._strings("metadata", spans["metadata"], fail, n, optional=True)

    def _strings(self, name, span, fail, n: int | None = None, optional: bool = False):
        start, length = span
        if length == 0 and optional:
            return None
        if length < 8:
            fail(f"string section {name!r} is too short")
        (count,) = struct.unpack_from("<Q", self.buf, start)
        if n is not None and count != n:
            fail(f"section {name!r} has {count} strings for {n} samples")
        if 8 + 8 * (count + 1) > length:
            fail(f"section {name!r} is shorter than its {count} string offsets")
        offsets = np.frombuffer(self.buf, dtype="<u8", count=count + 1, offset=start + 8)
        blob_len = length - 8 - 8 * (count + 1)
        blob = np.frombuffer(self.buf, dtype=np.uint8, count=blob_len,
                             offset=start + 8 + 8 * (count + 1))
        if offsets[0] != 0 or np.any(np.diff(offsets.astype(np.int64)) < 0) or \
                offsets[-1] != blob_len:
            fail(f"string offsets in section {name!r} are not monotonic or out of bounds")
        return offsets, blob


def open_mapped(path: Path) -> Parsed:
    """Map ``path`` read-only and validate it; O(number of samples), data untouched."""
    return Parsed(open_path(path))
