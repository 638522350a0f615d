"""The decoded tier's file: every image of a store decoded once, resized, packed as uint8 pixels.

``docs/reference/format.md`` ("The decoded tier") specifies it. Version 1, little-endian:

- a 128-byte header (:data:`HEAD`, then the CRC-32 of those bytes);
- the index at byte 128: ``offsets`` int64 (N + 1, into the data section), ``heights`` and
  ``widths`` uint32 (N), ``status`` uint8 (N; 0: the pixels are here, 1: the sample is decoded
  from its store at batch time, as without the tier: it failed, or libjpeg warned, at build),
  each on a 64-byte boundary; its CRC-32 in the header;
- the data on a 4096-byte boundary: sample ``i``'s pixels at ``offsets[i]``, ``heights[i] x
  widths[i] x 3`` bytes, row-major RGB (HWC); its CRC-32 in the header.

Opening checks magic, version, sizes, the header and index checksums and every offset against
the data's bounds, so a bad or truncated file is a :class:`CacheFormatError`, never garbage. The
data's checksum is checked by :meth:`DecodedPixels.verify`, not at every open. No pickle: an
open tier pickles as its file's descriptor (``_mapped.Handle``), O(1) bytes, and another process
attaches to exactly that file.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .._errors import CacheFormatError
from . import _checksum, _readonly
from ._mapped import Handle, open_path

MAGIC = b"GPUCPIXL"
VERSION = 1
HEADER_SIZE = 128
#: magic, version, header size, samples, side, mode (0 short, 1 long), file size, index offset,
#: index length, data offset, data length, key (16 bytes), decoder (24 ASCII bytes, NUL
#: padded), index crc32, data crc32; then the crc32 of these bytes
HEAD = struct.Struct("<8sIIQIIQQQQQ16s24sII")
CRC = struct.Struct("<I")
MODES = ("short", "long")
#: status values: the pixels are in the tier; the sample is decoded from the store at batch time
IN_TIER, FROM_STORE = 0, 1


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class Layout:
    """Where everything of a tier of given sizes lies (known before a pixel is decoded)."""

    offsets: np.ndarray  # int64 (N + 1), into the data section
    spans: dict[str, tuple[int, int]]  # index arrays: name -> (file offset, bytes)
    index: tuple[int, int]  # (offset, length) of the whole index
    data: tuple[int, int]  # (offset, length) of the data section
    size: int  # the file's bytes


def layout(heights: np.ndarray, widths: np.ndarray) -> Layout:
    """The layout of a tier whose samples are ``heights`` x ``widths`` x 3 bytes."""
    n = len(heights)
    sizes = np.asarray(heights, np.int64) * np.asarray(widths, np.int64) * 3
    offsets = np.zeros(n + 1, dtype="<i8")
    np.cumsum(sizes, out=offsets[1:])
    spans, pos = {}, HEADER_SIZE
    for name, nbytes in (("offsets", 8 * (n + 1)), ("heights", 4 * n), ("widths", 4 * n)):
        start = _align(pos, 64)
        spans[name], pos = (start, nbytes), start + nbytes
    start = _align(pos, 64)
    spans["status"], pos = (start, n), start + n
    index = (HEADER_SIZE, pos - HEADER_SIZE)
    data = (_align(pos, 4096), int(offsets[-1]))
    return Layout(offsets, spans, index, data, data[0] + data[1])


def index_bytes(lay: Layout, heights: np.ndarray, widths: np.ndarray, status: np.ndarray) -> bytes:
    """The index section as stored (padding zeros included)."""
    out = bytearray(lay.index[1])
    arrays = {
        "offsets": lay.offsets.astype("<i8"),
        "heights": np.asarray(heights, "<u4"),
        "widths": np.asarray(widths, "<u4"),
        "status": np.asarray(status, "u1"),
    }
    for name, (start, nbytes) in lay.spans.items():
        at = start - HEADER_SIZE
        out[at : at + nbytes] = arrays[name].tobytes()
    return bytes(out)


@dataclass(frozen=True)
class Recipe:
    """How a tier's pixels were made, as its header records it: resized to ``side`` on its
    ``mode`` side (``MODES``), from the store whose key is ``key`` (16 bytes kept), by
    ``decoder`` (24 ASCII bytes kept)."""

    side: int
    mode: str
    key: bytes
    decoder: str


def header_bytes(lay: Layout, recipe: Recipe, *, n: int, index: bytes, data_crc: int) -> bytes:
    """The 128-byte header of a tier of ``n`` samples laid out as ``lay``, made as ``recipe``
    says, with this ``index`` section and data checksum."""
    head = HEAD.pack(
        MAGIC,
        VERSION,
        HEADER_SIZE,
        n,
        recipe.side,
        MODES.index(recipe.mode),
        lay.size,
        *lay.index,
        *lay.data,
        recipe.key[:16].ljust(16, b"\0"),
        recipe.decoder.encode("ascii", "replace")[:24].ljust(24, b"\0"),
        zlib.crc32(index),
        data_crc,
    )
    return (head + CRC.pack(zlib.crc32(head))).ljust(HEADER_SIZE, b"\0")


class DecodedPixels:
    """An open decoded tier: read-only views of its index and pixels (a mapped file, or
    anonymous memory made read-only after the build)."""

    def __init__(
        self,
        *,
        buf: np.ndarray,
        name: str,
        handle: Handle | None = None,
        trusted: bool = False,
    ) -> None:
        self.name, self.handle = name, handle
        self.path: Path | None = None if handle is None else handle.path
        size = len(buf)
        if size < HEADER_SIZE:
            self._fail(f"too small to be a decoded tier ({size} bytes)")
        head = bytes(buf[:HEADER_SIZE])
        if head[:8] != MAGIC:
            self._fail(f"not a decoded tier (magic {head[:8]!r}, expected {MAGIC!r})")
        (version,) = struct.unpack_from("<I", head, 8)
        if version != VERSION:
            self._fail(f"decoded-tier format version {version}; this gpucache reads {VERSION}")
        fields = HEAD.unpack_from(head)
        if zlib.crc32(head[: HEAD.size]) != CRC.unpack_from(head, HEAD.size)[0]:
            self._fail("header checksum mismatch (the header is corrupt)")
        _, _, hsize, n, side, mode, file_size, i_off, i_len, d_off, d_len = fields[:11]
        key, decoder, index_crc, self.data_crc = fields[11:]
        if hsize != HEADER_SIZE or mode >= len(MODES):
            self._fail(f"header size {hsize} or mode {mode} is not this format's")
        if file_size != size:
            self._fail(f"truncated or extended: the header says {file_size} bytes, it has {size}")
        if n > size:  # every sample takes at least its status byte
            self._fail(f"{n} samples cannot fit in {size} bytes")
        expected = layout(np.zeros(n, np.int64), np.zeros(n, np.int64))
        if (i_off, i_len) != expected.index or d_off < i_off + i_len or d_off + d_len != size:
            self._fail("the index or data section lies outside the file or overlaps")
        if not trusted and zlib.crc32(buf[i_off : i_off + i_len].tobytes()) != index_crc:
            self._fail("index checksum mismatch (offsets, sizes or status are corrupt)")

        def view(name: str, dtype: str, count: int) -> np.ndarray:
            start = expected.spans[name][0]
            return buf[start : start + np.dtype(dtype).itemsize * count].view(dtype)

        self.offsets, self.status = view("offsets", "<i8", n + 1), view("status", "u1", n)
        self.heights, self.widths = view("heights", "<u4", n), view("widths", "<u4", n)
        if not trusted:
            sizes = self.heights.astype(np.int64) * self.widths * 3
            if (
                self.offsets[0] != 0
                or self.offsets[-1] != d_len
                or np.any(np.diff(self.offsets) != sizes)
                or np.any(self.status > FROM_STORE)
            ):
                self._fail("offsets, sizes or status values do not agree with the data section")
        self.data = buf[d_off : d_off + d_len]
        self.side, self.mode = int(side), MODES[mode]
        self.key, self.decoder = bytes(key), decoder.rstrip(b"\0").decode("ascii", "replace")
        self._tensor: torch.Tensor | None = None

    def _fail(self, what: str) -> None:
        raise CacheFormatError(
            f"{self.name}: {what}; it is rebuilt from its store when a loader asks for it "
            "(remove the file to rebuild it now)."
        )

    # ------------------------------------------------------------------ access
    def __len__(self) -> int:
        return len(self.status)

    @property
    def nbytes(self) -> int:
        """Bytes of pixels held."""
        return int(self.data.nbytes)

    def image(self, i: int) -> torch.Tensor:
        """Sample ``i``'s pixels as a (3, H, W) uint8 tensor over the tier's read-only memory
        (HWC in memory, as libjpeg-turbo's decode leaves it); never handed to users."""
        if self._tensor is None:
            self._tensor = _readonly.tensor_over(self.data)
        if self.handle is not None and not self.handle.intact():
            raise CacheFormatError(
                f"{self.name}: the decoded tier's file was truncated while in use; never write "
                "into a tier file that loaders use (remove it and let the next run rebuild it)."
            )
        h, w = int(self.heights[i]), int(self.widths[i])
        at = int(self.offsets[i])
        return self._tensor[at : at + h * w * 3].view(h, w, 3).permute(2, 0, 1)

    def verify(self) -> bool:
        """True when the pixels' CRC-32 is the one the header records (reads every page)."""
        return bool(_checksum.crc32(self.data) == self.data_crc)

    def __repr__(self) -> str:
        where = f"file {self.path}" if self.path is not None else "memory"
        return (
            f"DecodedPixels({len(self)} images, {self.mode} side {self.side}, "
            f"{self.nbytes / 2**20:,.1f} MiB in {where})"
        )

    def __reduce__(self) -> tuple[Callable[..., DecodedPixels], tuple[Handle]]:
        if self.handle is None:
            raise TypeError(
                "a decoded tier held in memory cannot be pickled (that would copy every pixel "
                "into each process); it serves fork workers and num_workers=0 only. Give the "
                "loader a writable cache_dir= so the tier is a file every process maps."
            )
        return (_reattach, (self.handle,))


def open_tier(path: Path, fd: int | None = None) -> DecodedPixels:
    """Map a tier file read-only and check it (see the module's docstring); ``fd``: the file
    already opened (and checked as this user's own) by the caller, which it now owns."""
    handle = open_path(path) if fd is None else Handle(fd, str(path), path)
    buf = np.frombuffer(handle.buf, dtype=np.uint8)
    try:
        return DecodedPixels(buf=buf, name=str(path), handle=handle)
    except BaseException:
        handle.close()
        raise


def _reattach(handle: Handle) -> DecodedPixels:
    """In a worker: the very file the pickling process opened and checked."""
    buf = np.frombuffer(handle.buf, dtype=np.uint8)
    return DecodedPixels(buf=buf, name=handle.name, handle=handle, trusted=handle.trusted)


def in_memory(buf: np.ndarray) -> DecodedPixels:
    """A tier built into ``buf`` (:func:`gpucache.store._readonly.writable_buffer`), made
    read-only in place."""
    (frozen,) = _readonly.freeze([buf])
    return DecodedPixels(buf=frozen, name="decoded tier in memory")
