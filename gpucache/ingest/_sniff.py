"""Sniff encoded images: format, dimensions and the JPEG features decoders care about.

Only headers are parsed, never pixels (a PNG's chunks are walked, its image data skipped; a
progressive JPEG's scan headers are read, its scan data skipped in C, and the decoding work they
cost is weighed: ``store._jpeg.read_scans``). The result decides whether a
sample is kept, which decoder may take it (GPU decoders want 8-bit Huffman JPEG with 1 or 3
components) and, from the stored height/width after EXIF orientation, lets the loader draw crop
boxes without decoding.
"""

from __future__ import annotations

import io
import struct
from typing import TYPE_CHECKING, NamedTuple

# the sample kinds live with the format; re-exported (``as``) for the build and the decoders
from ..store._format import JPEG_KINDS as JPEG_KINDS
from ..store._format import SAMPLE_DTYPE as SAMPLE_DTYPE
from ..store._format import Kind as Kind
from ..store._jpeg import (  # noqa: F401 - the marker walk is shared with the decode-time re-check
    _FF,
    _SOF_KINDS,
    _SOF_UNSUPPORTED,
    MAX_SCANS,
    NO_SCANS,
    TOO_MANY_SCANS,
    _next_marker,
    _skip_fill,
    components,
    frame_kind,
    jpeg_header,
    read_scans,
)
from ..store._oom import BUILD_FIX, raise_if_out_of_memory

if TYPE_CHECKING:
    from PIL import Image


class SniffError(ValueError):
    """The bytes are not an image the decoders can read; the message is the reason."""


class Info(NamedTuple):  # a tuple: made once per sample at build, so it is kept cheap
    kind: Kind
    height: int  # after EXIF orientation, i.e. as decoded
    width: int
    components: int = 3
    orientation: int = 1
    precision: int = 8
    scans: int = 0  # a JPEG's scans and their decoding work (``_jpeg.read_scans``), held to
    work: int = 0  # the budget by the build (``_limits.over_work``)


def _exif_orientation(seg: memoryview | bytes) -> int:
    """The orientation libjpeg-turbo's decoders (TorchCodec, torchvision) apply for this APP1.

    Their rule, followed to the byte so the stored size matches the decoded one: only the first
    APP1 segment counts (an XMP one first means no orientation); its first 6 bytes are skipped
    unchecked; "II" means little-endian, anything else big-endian; the tag's value is read as a
    16-bit SHORT whatever its type (a LONG 6 stored big-endian reads as 0); 1-8 or none."""
    d = bytes(seg[6:])
    if not d:
        return 1
    end = "<" if d[:2] == b"II" else ">"
    bad = 0xFFFF  # what the decoder's readers return past the end

    def u16(o: int) -> int:
        return struct.unpack_from(end + "H", d, o)[0] if o + 1 < len(d) else bad

    def u32(o: int) -> int:
        return struct.unpack_from(end + "I", d, o)[0] if o + 3 < len(d) else bad

    if u16(2) != 0x2A:
        return 1
    off = u32(4)
    count, off = u16(off), (off + 2) & 0xFFFFFFFF
    for _ in range(count):
        tag = u16(off)
        if tag == bad:
            break
        if tag == 0x0112:
            value = u16(off + 8)
            return value if 1 <= value <= 8 else 1
        off = (off + 12) & 0xFFFFFFFF
    return 1


_COPY_BELOW = 1 << 20
_NOT_MARKER = (0x00, 0xFF)  # FF 00 is a stuffed byte, FF FF fill: left to _next_marker
_NO_LENGTH = frozenset([0x01, *range(0xD0, 0xDA)])  # TEM, RSTn, SOI, EOI: no length follows
_READ = frozenset([0xDA, 0xE1, *_SOF_KINDS, *_SOF_UNSUPPORTED])  # the segments looked into


def _frame(seg: memoryview | bytes, marker: int) -> tuple[Kind, int, int, int]:
    if marker in _SOF_UNSUPPORTED:
        raise SniffError(
            f"{_SOF_UNSUPPORTED[marker]} (SOF{marker - 0xC0}) is not supported by "
            "the decoders; re-encode it as baseline or progressive JPEG"
        )
    if len(seg) < 6:
        raise SniffError("truncated or corrupt JPEG header: frame header (SOF) too short")
    precision, h, w, comps = struct.unpack(">BHHB", seg[:6])
    if precision != 8:
        raise SniffError(
            f"{precision}-bit JPEG is not supported by the 8-bit decoders; "
            "re-encode it as 8-bit JPEG"
        )
    if h == 0 or w == 0:
        raise SniffError(f"JPEG header gives an empty image ({w}x{h})")
    if comps not in (1, 3, 4):
        raise SniffError(f"JPEG with {comps} components is not supported (1, 3 or 4)")
    return _SOF_KINDS[marker], h, w, comps


def _sniff_jpeg(b: memoryview | bytes) -> Info:
    n = len(b)
    # Trailing zero padding after EOI is common and harmless; a missing EOI means the scan is cut.
    if b[n - 2 :] != b"\xff\xd9" and not bytes(b[max(0, n - 1024) :]).rstrip(b"\x00").endswith(
        b"\xff\xd9"
    ):
        raise SniffError("truncated JPEG: no end-of-image marker (FFD9) at the end of the file")
    if n <= _COPY_BELOW:  # indexing bytes is several times faster than indexing a memoryview
        b = bytes(b)
    pos, orientation, app1, frame, sof, sos = 2, 1, False, None, {}, -1
    while True:  # the markers libjpeg reads before the first scan (SOS)
        if pos + 1 < n and b[pos] == 0xFF and b[pos + 1] not in _NOT_MARKER:  # the usual case
            marker, pos = b[pos + 1], pos + 2
        else:
            marker, pos = _next_marker(b, pos)
            if marker < 0:
                break
        if marker in _NO_LENGTH:
            if marker == 0xD9:
                break
            if marker == 0xD8:
                raise SniffError("corrupt JPEG header: a second start-of-image marker (FFD8)")
            continue
        if pos + 2 > n:
            break
        length = (b[pos] << 8) | b[pos + 1]
        if length < 2 or pos + length > n:
            raise SniffError(
                f"truncated or corrupt JPEG header: marker FF{marker:02X} at byte "
                f"{pos - 2} has length {length}, {n - pos} bytes remain"
            )
        if marker in _READ:
            if marker == 0xDA:
                sos = pos - 2
                break
            if marker == 0xE1:
                if not app1:  # only the first APP1 counts for the decoders
                    app1, orientation = True, _exif_orientation(b[pos + 2 : pos + length])
            else:
                if frame is not None:
                    raise SniffError("corrupt JPEG header: two frame headers (SOF)")
                seg = b[pos + 2 : pos + length]
                frame, sof = _frame(seg, marker), frame_kind(marker, components(seg))
        pos += length
    if frame is None:
        raise SniffError("truncated or corrupt JPEG header: no frame header (SOF) found")
    kind, h, w, comps = frame  # a missing scan is left to the decoder (a decode-time failure)
    scans = NO_SCANS
    if sos >= 0:
        scans = read_scans(b, sos, height=h, width=w, **sof)
        if scans.problem is not None:
            raise SniffError(scans.problem)
    if orientation >= 5:
        h, w = w, h
    return Info(kind, h, w, comps, orientation, 8, scans.number, scans.work)


def _png_exif_chunks(b: memoryview, im: Image.Image, fp: io.BytesIO) -> None:
    """Add to ``im.info`` what PIL reads from the chunks after the image data when it decodes
    (eXIf, text, XMP), by walking the chunk list and skipping IDAT: no pixel is decoded."""
    from PIL import PngImagePlugin

    stream, pos, n, after_idat = PngImagePlugin.PngStream(fp), 8, len(b), False
    while pos + 8 <= n:
        length, cid = struct.unpack_from(">I4s", b, pos)
        # a PNG opens as PIL's PngImageFile, which has is_animated (its stubs: not on Image)
        animated = cid == b"fcTL" and after_idat and im.is_animated  # type: ignore[attr-defined]
        if cid == b"IEND" or animated:
            break
        if cid in (b"IDAT", b"fdAT"):
            after_idat = True
        elif after_idat:
            fp.seek(pos + 8)
            try:
                stream.call(cid, pos + 8, length)
            except UnicodeDecodeError:
                break
            except (EOFError, AttributeError):  # chunks PIL skips
                pass
        pos += 12 + length
    im.info.update(stream.im_info)


def _sniff_pil(b: memoryview, kind: Kind) -> Info:
    from PIL import Image

    fp = io.BytesIO(b)
    try:
        # Image.open reads headers only; the size is known without decoding a pixel.
        with Image.open(fp) as im:
            w, h = im.size
            bands = len(im.getbands())
            if kind == Kind.PNG:  # PIL's PNG getexif() decodes the image: walk chunks instead
                _png_exif_chunks(b, im, fp)
            orientation = Image.Image.getexif(im).get(0x0112, 1)
    except Image.DecompressionBombError as err:
        raise SniffError(f"header claims more pixels than PIL decodes: {err}") from err
    except Exception as err:  # PIL raises many types for bad files
        # the machine's problem, not a bad sample
        raise_if_out_of_memory(err, f"reading a {kind.name} header", fix=BUILD_FIX)
        raise SniffError(f"unreadable {kind.name} image: {err}") from err
    orientation = orientation if orientation in range(1, 9) else 1
    if orientation >= 5:
        h, w = w, h
    return Info(kind, h, w, min(bands, 4), orientation)


_PIL_MAGIC = (b"BM", b"II*\x00", b"MM\x00*", b"P5", b"P6", b"P2", b"P3")


def check_signature(head: bytes, nbytes: int) -> Kind:
    """The format the first bytes of an ``nbytes``-byte input announce (``Kind.JPEG`` for any
    JPEG); raises :class:`SniffError` for bytes no decoder reads. Lets a build refuse a
    non-image (a sparse file of zeros, a text file) after reading 64 bytes of it."""
    if nbytes == 0:
        raise SniffError("empty file")
    if head.startswith(b"\xff\xd8\xff"):
        return Kind.JPEG
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return Kind.PNG
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return Kind.GIF
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return Kind.WEBP
    if head.startswith(_PIL_MAGIC):
        return Kind.OTHER
    if head.startswith(b"\xff\xd8"):
        raise SniffError("truncated or corrupt JPEG: start-of-image marker without a header")
    raise SniffError(
        "not an image: unknown format (no JPEG, PNG, GIF, WebP, BMP, TIFF or PNM signature)"
    )


def sniff(b: memoryview) -> Info:
    """Classify encoded bytes; raises :class:`SniffError` with the reason when unusable."""
    kind = check_signature(bytes(b[:16]), len(b))
    return _sniff_jpeg(b) if kind == Kind.JPEG else _sniff_pil(b, kind)
