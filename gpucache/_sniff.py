"""Sniff encoded images: format, dimensions and the JPEG features decoders care about.

Only headers are parsed (no pixel decoding for JPEG); the result decides whether a sample is kept,
which decoder may take it (GPU decoders want 8-bit Huffman JPEG with 1 or 3 components) and, from
the stored height/width after EXIF orientation, lets the loader draw crop boxes without decoding.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass
from enum import IntEnum

import numpy as np


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
    [("kind", "u1"), ("components", "u1"), ("orientation", "u1"), ("precision", "u1"),
     ("height", "<u4"), ("width", "<u4")]
)


class SniffError(ValueError):
    """The bytes are not an image the decoders can read; the message is the reason."""


@dataclass(frozen=True)
class Info:
    kind: Kind
    height: int  # after EXIF orientation, i.e. as decoded
    width: int
    components: int = 3
    orientation: int = 1
    precision: int = 8


_SOF_KINDS = {0xC0: Kind.JPEG, 0xC1: Kind.JPEG, 0xC2: Kind.JPEG_PROGRESSIVE,
              0xC9: Kind.JPEG_ARITHMETIC, 0xCA: Kind.JPEG_ARITHMETIC}
_SOF_UNSUPPORTED = {0xC3: "lossless JPEG", 0xC5: "hierarchical JPEG", 0xC6: "hierarchical JPEG",
                    0xC7: "hierarchical JPEG", 0xCB: "lossless JPEG", 0xCD: "hierarchical JPEG",
                    0xCE: "hierarchical JPEG", 0xCF: "hierarchical JPEG"}


def _exif_orientation(seg: memoryview) -> int:
    """Orientation tag (0x0112) from an APP1 Exif payload, 1 when absent or unreadable."""
    if bytes(seg[:6]) != b"Exif\x00\x00" or len(seg) < 14:
        return 1
    tiff = seg[6:]
    order = bytes(tiff[:2])
    if order not in (b"II", b"MM"):
        return 1
    e = "<" if order == b"II" else ">"
    (ifd,) = struct.unpack(e + "I", tiff[4:8])
    if ifd + 2 > len(tiff):
        return 1
    (count,) = struct.unpack(e + "H", tiff[ifd:ifd + 2])
    for k in range(count):
        p = ifd + 2 + 12 * k
        if p + 12 > len(tiff):
            break
        tag, typ = struct.unpack(e + "HH", tiff[p:p + 4])
        if tag == 0x0112 and typ == 3:
            (value,) = struct.unpack(e + "H", tiff[p + 8:p + 10])
            return value if 1 <= value <= 8 else 1
    return 1


def _sniff_jpeg(b: memoryview) -> Info:
    n = len(b)
    # Trailing zero padding after EOI is common and harmless; a missing EOI means the scan is cut.
    tail = bytes(b[max(0, n - 1024):]).rstrip(b"\x00")
    if not tail.endswith(b"\xff\xd9"):
        raise SniffError("truncated JPEG: no end-of-image marker (FFD9) at the end of the file")
    pos, orientation = 2, 1
    while pos + 4 <= n:
        if b[pos] != 0xFF:
            raise SniffError(f"corrupt JPEG header: expected a marker at byte {pos}")
        marker = b[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in (0x01,) or 0xD0 <= marker <= 0xD7:  # markers without a length
            pos += 2
            continue
        (length,) = struct.unpack(">H", b[pos + 2:pos + 4])
        seg = b[pos + 4:pos + 2 + length]
        if length < 2 or pos + 2 + length > n:
            break
        if marker == 0xE1:
            orientation = _exif_orientation(seg) if orientation == 1 else orientation
        elif marker in _SOF_UNSUPPORTED:
            raise SniffError(f"{_SOF_UNSUPPORTED[marker]} (SOF{marker - 0xC0}) is not supported "
                             "by the decoders; re-encode it as baseline or progressive JPEG")
        elif marker in _SOF_KINDS:
            if len(seg) < 6:
                break
            precision, h, w, comps = struct.unpack(">BHHB", seg[:6])
            if precision != 8:
                raise SniffError(f"{precision}-bit JPEG is not supported by the 8-bit decoders; "
                                 "re-encode it as 8-bit JPEG")
            if h == 0 or w == 0:
                raise SniffError(f"JPEG header gives an empty image ({w}x{h})")
            if comps not in (1, 3, 4):
                raise SniffError(f"JPEG with {comps} components is not supported (1, 3 or 4)")
            if orientation >= 5:
                h, w = w, h
            return Info(_SOF_KINDS[marker], h, w, comps, orientation, precision)
        elif marker == 0xDA:
            break
        pos += 2 + length
    raise SniffError("truncated or corrupt JPEG header: no frame header (SOF) found")


def _sniff_pil(b: memoryview, kind: Kind) -> Info:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(b)) as im:
            w, h = im.size
            orientation = im.getexif().get(0x0112, 1) if kind != Kind.GIF else 1
            bands = len(im.getbands())
    except Exception as err:  # PIL raises many types for bad files
        raise SniffError(f"unreadable {kind.name} image: {err}") from err
    orientation = orientation if orientation in range(1, 9) else 1
    if orientation >= 5:
        h, w = w, h
    return Info(kind, h, w, min(bands, 4), orientation)


_PIL_MAGIC = (b"BM", b"II*\x00", b"MM\x00*", b"P5", b"P6", b"P2", b"P3")


def sniff(b: memoryview) -> Info:
    """Classify encoded bytes; raises :class:`SniffError` with the reason when unusable."""
    head = bytes(b[:16])
    if len(b) == 0:
        raise SniffError("empty file")
    if head.startswith(b"\xff\xd8\xff"):
        return _sniff_jpeg(b)
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return _sniff_pil(b, Kind.PNG)
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return _sniff_pil(b, Kind.GIF)
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return _sniff_pil(b, Kind.WEBP)
    if head.startswith(_PIL_MAGIC):
        return _sniff_pil(b, Kind.OTHER)
    if head.startswith(b"\xff\xd8"):
        raise SniffError("truncated or corrupt JPEG: start-of-image marker without a header")
    raise SniffError("not an image: unknown format (no JPEG, PNG, GIF, WebP, BMP, TIFF or PNM "
                     "signature)")
