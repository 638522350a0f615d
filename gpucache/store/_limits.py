"""The pixel budget: a per-sample bound on decoded pixels, checked before anything is decoded.

A few-KB JPEG can claim 65500 x 65500 pixels in its header (a decompression bomb: 12 GiB of RGB).
The bound is checked from the header when a store is built and again, from the stored record,
before every decode on every backend and every CPU fallback, so no decoder ever allocates for it.
The same re-check refuses a JPEG whose scans would cost a decoder more than the sniffer allows
(each scan is a pass over the whole image): more than ``_jpeg.MAX_SCANS``, a scan that codes
again what an earlier one coded, or more work than :func:`work_budget` (``_jpeg.WORK_PER_PIXEL``
samples visited per pixel of ``max_pixels``).
"""

from __future__ import annotations

import struct
from typing import Protocol

import numpy as np

from .._errors import CacheFormatError
from ._jpeg import ARITHMETIC_WEIGHT, NO_SCANS, WORK_PER_PIXEL, Scans, jpeg_header


class Sampled(Protocol):
    """What the checks read of a store (``_store.Store`` is one): its records and a sample's
    bytes; its ``max_pixels`` and ``path`` where it has them."""

    @property
    def samples(self) -> np.ndarray: ...

    def __getitem__(self, i: int) -> np.ndarray: ...


#: PIL's ``Image.MAX_IMAGE_PIXELS`` (about 89.5 Mpx, 268 MB as RGB): the bound people already know.
DEFAULT_MAX_PIXELS = 89_478_485


#: An encoded image takes at most this many bytes per pixel (16-bit RGBA stored raw, as in an
#: uncompressed PNG or TIFF) plus :data:`METADATA_BYTES` of headers, EXIF, ICC and thumbnails.
BYTES_PER_PIXEL = 8
METADATA_BYTES = 16 << 20


def max_input_bytes(max_pixels: int | None) -> int | None:
    """The size cap on one build input under ``max_pixels`` (None: no cap). An input larger than
    any image within the pixel budget can be (a sparse file, a tar header or ``stat`` that lies)
    is refused before room is reserved for it."""
    return None if max_pixels is None else METADATA_BYTES + BYTES_PER_PIXEL * int(max_pixels)


def too_big(nbytes: int, max_pixels: int | None) -> str | None:
    """The reason an ``nbytes`` input is refused under ``max_pixels``, or None if it may be read."""
    cap = max_input_bytes(max_pixels)
    if cap is None or nbytes <= cap:
        return None
    return (
        f"{nbytes:,} bytes, more than the {cap:,} any image within max_pixels="
        f"{max_pixels:,} can take ({BYTES_PER_PIXEL} bytes per pixel + 16 MiB): a sparse or "
        "mislabelled file, or a size that lies; if it is a genuine image, raise max_pixels= "
        "(or pass None)"
    )


def pixel_budget(cache: Sampled) -> int | None:
    """The store's bound on decoded pixels per sample (None = unbounded)."""
    return getattr(cache, "max_pixels", DEFAULT_MAX_PIXELS)


def over_budget(height: int, width: int, limit: int | None) -> str | None:
    """The reason a ``height`` x ``width`` image is refused under ``limit``, or None if it fits."""
    if limit is None or int(height) * int(width) <= limit:
        return None
    return (
        f"{int(width)}x{int(height)} = {int(height) * int(width):,} pixels exceeds "
        f"max_pixels={limit:,} (a decompression bomb, or a very large image); raise "
        "max_pixels= when building or opening the store if it is genuine"
    )


def work_budget(limit: int | None) -> int | None:
    """The most decoding work (samples visited, ``_jpeg.read_scans``) a JPEG may cost under a
    pixel budget of ``limit`` (None: unbounded)."""
    return None if limit is None else WORK_PER_PIXEL * int(limit)


def over_work(scans: int, work: int, limit: int | None) -> str | None:
    """The reason a JPEG whose ``scans`` cost ``work`` (``_jpeg.read_scans``) is refused under
    ``limit``, or None if it may be decoded."""
    budget = work_budget(limit)
    if budget is None or work <= budget:
        return None
    return (
        f"JPEG whose {scans} scans cost {work:,} samples of decoding work (every "
        f"scan is a pass over the blocks of its components; arithmetic-coded ones count "
        f"{ARITHMETIC_WEIGHT}x), more than the {budget:,} allowed under max_pixels={limit:,} "
        f"({WORK_PER_PIXEL} a pixel; the heaviest script encoders write costs 48): refused as "
        "a denial of service; if it is genuine, rewrite it losslessly as one scan with "
        "'jpegtran -copy all IN > OUT', or raise max_pixels="
    )


def check_pixels(cache: Sampled, i: int) -> None:
    """Raise ``ValueError`` if sample ``i`` would cost a decoder more than the store allows: more
    pixels than its budget, or a JPEG whose scans cost more (``_jpeg.read_scans``: too many, a
    repeat, or over :func:`work_budget`);
    :class:`CacheFormatError` if its record's size is not the size its bytes state.

    Checks the stored record and the sample's own bytes (JPEG and PNG: a few microseconds, tens
    for a progressive JPEG), so a record that disagrees with its bytes, or a store built without
    the scan limit, cannot let a bomb through, nor have a crop decoder (which trusts the record)
    hand out a part of the image as if it were all of it."""
    limit = pixel_budget(cache)
    s = cache.samples
    why = over_budget(s["height"][i], s["width"][i], limit)
    stated = None
    if why is None:
        # numpy's stubs give ndarray the buffer protocol only from Python 3.12 on (numpy#26783)
        stated = stated_size(memoryview(cache[i]))  # type: ignore[arg-type]
        why = _refused(stated, limit)
    if why is not None:
        raise ValueError(why)
    if stated is not None:
        _check_record(cache, i, stated[0], stated[1])


def _check_record(cache: Sampled, i: int, height: int, width: int) -> None:
    """Sample ``i``'s record against the size its bytes state (as stored: EXIF turns it)."""
    rec = cache.samples[i]
    if int(rec["orientation"]) >= 5:
        height, width = width, height
    if (height, width) != (int(rec["height"]), int(rec["width"])):
        path = getattr(cache, "path", None)
        where = f"{path}: " if path else ""
        raise CacheFormatError(
            f"{where}the store's record of sample {i} says {rec['width']}x{rec['height']} but "
            f"its image header says {width}x{height} (as decoded): the store is corrupt or was "
            "altered after it was built; run `gpucache verify` on it and rebuild it "
            "(`gpucache build`)"
        )


def stated_size(b: memoryview | bytes) -> tuple[int, int, Scans] | None:
    """``(height, width, scans)`` the encoded bytes state (size before EXIF orientation; no scans
    for a PNG), or None where that is not cheap to read (other formats, a PNG whose first chunk
    is not its header)."""
    if b[:2] == b"\xff\xd8":
        return jpeg_header(b)
    if b[:8] == b"\x89PNG\r\n\x1a\n" and len(b) >= 24 and b[12:16] == b"IHDR":
        width, height = struct.unpack_from(">II", b, 16)
        return height, width, NO_SCANS
    return None


def _refused(stated: tuple[int, int, Scans] | None, limit: int | None) -> str | None:
    if stated is None:
        return None
    height, width, scans = stated
    return (
        scans.problem
        or over_budget(height, width, limit)
        or over_work(scans.number, scans.work, limit)
    )


def bytes_refused(b: memoryview, limit: int | None) -> str | None:
    """Why the encoded bytes are refused (size as they state it, before EXIF orientation; a JPEG's
    scans and their work), whatever the record says they are; None if they may be decoded."""
    return _refused(stated_size(b), limit)
