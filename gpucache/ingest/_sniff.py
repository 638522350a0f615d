"""Sniff encoded images: format, dimensions and the JPEG features decoders care about.

Only headers are parsed, never pixels (a PNG's chunks are walked, its image data skipped; a
progressive JPEG's scans are counted, its scan data skipped in C). The result decides whether a
sample is kept, which decoder may take it (GPU decoders want 8-bit Huffman JPEG with 1 or 3
components) and, from the stored height/width after EXIF orientation, lets the loader draw crop
boxes without decoding.
"""

from __future__ import annotations

import io
import re
import struct
from enum import IntEnum
from typing import NamedTuple

import numpy as np

from ..store._oom import BUILD_FIX, raise_if_out_of_memory


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


class Info(NamedTuple):  # a tuple: made once per sample at build, so it is kept cheap
    kind: Kind
    height: int  # after EXIF orientation, i.e. as decoded
    width: int
    components: int = 3
    orientation: int = 1
    precision: int = 8


_SOF_KINDS = {0xC0: Kind.JPEG, 0xC1: Kind.JPEG, 0xC2: Kind.JPEG_PROGRESSIVE,
              0xC9: Kind.JPEG_ARITHMETIC, 0xCA: Kind.JPEG_ARITHMETIC}
_PROGRESSIVE = (0xC2, 0xCA)  # SOF2 (Huffman), SOF10 (arithmetic)
_SOF_UNSUPPORTED = {0xC3: "lossless JPEG", 0xC5: "hierarchical JPEG", 0xC6: "hierarchical JPEG",
                    0xC7: "hierarchical JPEG", 0xCB: "lossless JPEG", 0xCD: "hierarchical JPEG",
                    0xCE: "hierarchical JPEG", 0xCF: "hierarchical JPEG"}


def _exif_orientation(seg: memoryview) -> int:
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


_FF = re.compile(rb"\xff")


def _skip_fill(b: memoryview, pos: int) -> int:
    """Position of the first byte at or after ``pos`` that is not FF fill (``len(b)`` if none)."""
    n = len(b)
    if pos >= n or b[pos] != 0xFF:
        return pos
    arr, step = np.frombuffer(b, dtype=np.uint8), 4096
    while pos < n:  # vectorised, in growing chunks: megabytes of fill cost milliseconds
        hit = np.flatnonzero(arr[pos:pos + step] != 0xFF)
        if hit.size:
            return pos + int(hit[0])
        pos, step = pos + step, min(step * 4, 1 << 22)
    return n


def _next_marker(b: memoryview, pos: int) -> tuple[int, int]:
    """``(marker, position after it)`` of the next marker at or after ``pos``, as libjpeg finds it.

    Like libjpeg's ``next_marker``: bytes before an FF are skipped (it warns "extraneous bytes"
    and decodes), any run of FF fill is skipped, FF 00 is not a marker. Linear time, in C-level
    scans. ``(-1, len(b))`` when the data ends first."""
    n = len(b)
    while pos < n:
        if b[pos] != 0xFF:
            ff = _FF.search(b, pos)
            if ff is None:
                break
            pos = ff.start()
        pos = _skip_fill(b, pos + 1)
        if pos >= n:
            break
        code, pos = b[pos], pos + 1
        if code != 0x00:
            return code, pos
    return -1, n


_COPY_BELOW = 1 << 20
_NOT_MARKER = (0x00, 0xFF)  # FF 00 is a stuffed byte, FF FF fill: left to _next_marker
_NO_LENGTH = frozenset([0x01, *range(0xD0, 0xDA)])  # TEM, RSTn, SOI, EOI: no length follows
_READ = frozenset([0xDA, 0xE1, *_SOF_KINDS, *_SOF_UNSUPPORTED])  # the segments looked into


def _frame(seg: memoryview, marker: int) -> tuple[Kind, int, int, int]:
    if marker in _SOF_UNSUPPORTED:
        raise SniffError(f"{_SOF_UNSUPPORTED[marker]} (SOF{marker - 0xC0}) is not supported by "
                         "the decoders; re-encode it as baseline or progressive JPEG")
    if len(seg) < 6:
        raise SniffError("truncated or corrupt JPEG header: frame header (SOF) too short")
    precision, h, w, comps = struct.unpack(">BHHB", seg[:6])
    if precision != 8:
        raise SniffError(f"{precision}-bit JPEG is not supported by the 8-bit decoders; "
                         "re-encode it as 8-bit JPEG")
    if h == 0 or w == 0:
        raise SniffError(f"JPEG header gives an empty image ({w}x{h})")
    if comps not in (1, 3, 4):
        raise SniffError(f"JPEG with {comps} components is not supported (1, 3 or 4)")
    return _SOF_KINDS[marker], h, w, comps


#: Most scans a JPEG may have. libjpeg decodes every scan of a progressive JPEG over the whole
#: image (1.4-1.9 ms a scan at 4000 x 4000), and nothing else bounds their number: 20,000 scans of
#: an end-of-band run each add under 1 MB to such a JPEG and 25 s to its decode. Encoders write 6
#: to 18 (libjpeg's progressive scripts: 10 for colour, 6 for gray, 18 for CMYK).
MAX_SCANS = 100

# A marker as libjpeg finds it in entropy-coded data: FF then neither a stuffed 00, nor fill, nor
# a restart marker (RSTn, part of the scan). One regex search skips a whole scan's data in C.
_MARKER = re.compile(rb"\xff[\x01-\xcf\xd8-\xfe]")


def count_scans(b: memoryview | bytes, pos: int, *, limit: int = MAX_SCANS) -> int:
    """Scans (SOS markers) libjpeg reads from the marker at ``pos`` to the end of the image (EOI
    or the end of the data), counted up to ``limit + 1``: segment bodies are skipped by their
    length, scan data by one C-level search per marker (~1.5 GB/s), so a normal progressive JPEG
    costs tens of microseconds and a hostile one at most ``limit + 1`` scans' worth."""
    count, n = 0, len(b)
    while count <= limit:
        hit = _MARKER.search(b, pos)
        if hit is None:
            break
        code, pos = b[hit.start() + 1], hit.end()
        if code == 0xD9 or code == 0xD8:  # EOI: the end; a second SOI: libjpeg stops there
            break
        count += code == 0xDA
        if code != 0x01 and pos + 2 <= n:  # every marker but TEM has a length
            pos += max((b[pos] << 8) | b[pos + 1], 2)
    return count


def scans_decoded(b: memoryview | bytes, pos: int, *, progressive: bool, comps: int) -> int:
    """The scans libjpeg decodes (up to ``MAX_SCANS + 1``); ``pos``: the first SOS marker. A
    sequential JPEG whose first scan holds every component is decoded from that scan alone (libjpeg
    fails at a second one): 1 without counting, so only progressive and multi-scan sequential
    JPEGs pay for the count."""
    if not progressive and pos + 4 < len(b) and b[pos + 4] >= comps:
        return 1
    return count_scans(b, pos)


TOO_MANY_SCANS = (f"JPEG with more than {MAX_SCANS} scans (libjpeg decodes each one over the "
                  "whole image; encoders write 6-18): refused as a denial of service; if it is "
                  "genuine, rewrite it losslessly as one scan with 'jpegtran -copy all IN > OUT'")


def jpeg_header(b: memoryview | bytes) -> tuple[int, int, int] | None:
    """``(height, width, scans)`` of JPEG bytes: the first frame header's (SOF) size as stored
    (before EXIF orientation) and :func:`scans_decoded` (0 without a scan); None without a frame
    header. Microseconds (tens for a progressive JPEG): the decode-time re-check."""
    pos, n, frame = 2, len(b), None
    while pos < n:
        marker, pos = _next_marker(b, pos)
        if marker < 0 or marker == 0xD9 or pos + 2 > n:
            break
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:
            continue
        if marker == 0xDA:
            if frame is None:
                break
            h, w, comps = frame[1:]
            return h, w, scans_decoded(b, pos - 2, progressive=frame[0] in _PROGRESSIVE,
                                       comps=comps)
        if frame is None and (marker in _SOF_KINDS or marker in _SOF_UNSUPPORTED):
            if pos + 8 > n:
                return None
            frame = (marker, *struct.unpack_from(">HHB", b, pos + 3))
        pos += max((b[pos] << 8) | b[pos + 1], 2)
    return None if frame is None else (frame[1], frame[2], 0)


def _sniff_jpeg(b: memoryview) -> Info:
    n = len(b)
    # Trailing zero padding after EOI is common and harmless; a missing EOI means the scan is cut.
    if b[n - 2:] != b"\xff\xd9" and not bytes(b[max(0, n - 1024):]).rstrip(b"\x00").endswith(
            b"\xff\xd9"):
        raise SniffError("truncated JPEG: no end-of-image marker (FFD9) at the end of the file")
    if n <= _COPY_BELOW:  # indexing bytes is several times faster than indexing a memoryview
        b = bytes(b)
    pos, orientation, app1, frame, sof, sos = 2, 1, False, None, 0, -1
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
            raise SniffError(f"truncated or corrupt JPEG header: marker FF{marker:02X} at byte "
                             f"{pos - 2} has length {length}, {n - pos} bytes remain")
        if marker in _READ:
            if marker == 0xDA:
                sos = pos - 2
                break
            if marker == 0xE1:
                if not app1:  # only the first APP1 counts for the decoders
                    app1, orientation = True, _exif_orientation(b[pos + 2:pos + length])
            else:
                if frame is not None:
                    raise SniffError("corrupt JPEG header: two frame headers (SOF)")
                frame, sof = _frame(b[pos + 2:pos + length], marker), marker
        pos += length
    if frame is None:
        raise SniffError("truncated or corrupt JPEG header: no frame header (SOF) found")
    kind, h, w, comps = frame  # a missing scan is left to the decoder (a decode-time failure)
    if sos >= 0 and scans_decoded(b, sos, progressive=sof in _PROGRESSIVE,
                                  comps=comps) > MAX_SCANS:
        raise SniffError(TOO_MANY_SCANS)
    if orientation >= 5:
        h, w = w, h
    return Info(kind, h, w, comps, orientation, 8)


def _png_exif_chunks(b: memoryview, im, fp: io.BytesIO) -> None:
    """Add to ``im.info`` what PIL reads from the chunks after the image data when it decodes
    (eXIf, text, XMP), by walking the chunk list and skipping IDAT: no pixel is decoded."""
    from PIL import PngImagePlugin

    stream, pos, n, after_idat = PngImagePlugin.PngStream(fp), 8, len(b), False
    while pos + 8 <= n:
        length, cid = struct.unpack_from(">I4s", b, pos)
        if cid == b"IEND" or (cid == b"fcTL" and after_idat and im.is_animated):
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
    raise SniffError("not an image: unknown format (no JPEG, PNG, GIF, WebP, BMP, TIFF or PNM "
                     "signature)")


def sniff(b: memoryview) -> Info:
    """Classify encoded bytes; raises :class:`SniffError` with the reason when unusable."""
    kind = check_signature(bytes(b[:16]), len(b))
    return _sniff_jpeg(b) if kind == Kind.JPEG else _sniff_pil(b, kind)
