"""Reading a JPEG's frame header and counting its scans without decoding: the decode-time
re-check of a stored sample (``_limits.check_pixels``) and the build's sniffer
(``gpucache.ingest._sniff``) walk markers the same way, as libjpeg does.
"""

from __future__ import annotations

import re
import struct

import numpy as np

from ._format import Kind

_SOF_KINDS = {
    0xC0: Kind.JPEG,
    0xC1: Kind.JPEG,
    0xC2: Kind.JPEG_PROGRESSIVE,
    0xC9: Kind.JPEG_ARITHMETIC,
    0xCA: Kind.JPEG_ARITHMETIC,
}
_PROGRESSIVE = (0xC2, 0xCA)  # SOF2 (Huffman), SOF10 (arithmetic)
_SOF_UNSUPPORTED = {
    0xC3: "lossless JPEG",
    0xC5: "hierarchical JPEG",
    0xC6: "hierarchical JPEG",
    0xC7: "hierarchical JPEG",
    0xCB: "lossless JPEG",
    0xCD: "hierarchical JPEG",
    0xCE: "hierarchical JPEG",
    0xCF: "hierarchical JPEG",
}


_FF = re.compile(rb"\xff")


def _skip_fill(b: memoryview | bytes, pos: int) -> int:
    """Position of the first byte at or after ``pos`` that is not FF fill (``len(b)`` if none)."""
    n = len(b)
    if pos >= n or b[pos] != 0xFF:
        return pos
    arr, step = np.frombuffer(b, dtype=np.uint8), 4096
    while pos < n:  # vectorised, in growing chunks: megabytes of fill cost milliseconds
        hit = np.flatnonzero(arr[pos : pos + step] != 0xFF)
        if hit.size:
            return pos + int(hit[0])
        pos, step = pos + step, min(step * 4, 1 << 22)
    return n


def _next_marker(b: memoryview | bytes, pos: int) -> tuple[int, int]:
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


TOO_MANY_SCANS = (
    f"JPEG with more than {MAX_SCANS} scans (libjpeg decodes each one over the "
    "whole image; encoders write 6-18): refused as a denial of service; if it is "
    "genuine, rewrite it losslessly as one scan with 'jpegtran -copy all IN > OUT'"
)


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
            return (
                h,
                w,
                scans_decoded(b, pos - 2, progressive=frame[0] in _PROGRESSIVE, comps=comps),
            )
        if frame is None and (marker in _SOF_KINDS or marker in _SOF_UNSUPPORTED):
            if pos + 8 > n:
                return None
            frame = (marker, *struct.unpack_from(">HHB", b, pos + 3))
        pos += max((b[pos] << 8) | b[pos + 1], 2)
    return None if frame is None else (frame[1], frame[2], 0)
