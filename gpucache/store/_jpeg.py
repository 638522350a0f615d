"""Reading a JPEG's frame header and its scans' headers without decoding: the decode-time
re-check of a stored sample (``_limits.check_pixels``) and the build's sniffer
(``gpucache.ingest._sniff``) walk markers the same way, as libjpeg does, and weigh the scans by
the decoding work they cost (:func:`read_scans`, :data:`WORK_PER_PIXEL`).
"""

from __future__ import annotations

import re
import struct
from typing import Any, NamedTuple

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
_ARITHMETIC = (0xC9, 0xCA)  # SOF9 (sequential), SOF10 (progressive)
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


#: Most scans a JPEG may have. Encoders write 6 to 18 (libjpeg's progressive scripts: 10 for
#: colour, 6 for gray, 18 for CMYK); the count bounds the walk below, :data:`WORK_PER_PIXEL` the
#: decoding work.
MAX_SCANS = 100

#: The decoding work a JPEG may cost, per pixel of ``max_pixels``, in samples visited: libjpeg
#: decodes every scan over all the blocks of its components, at a floor per 8 x 8 block whatever
#: the scan holds (measured on the development machine, 2026-12-04, ``benchmarks/scan_limit.py``:
#: 12-21 ns a block for Huffman scans of 1-16 Mpx, 16-30 ns arithmetic-coded), so a 2.5 KB JPEG of
#: 9456 x 9456 with 98 empty scans decodes for 9 s. The heaviest script encoders write costs 48:
#: CMYK in 18 arithmetic-coded scans (24 samples visited a pixel, counted twice); 64 leaves a
#: third to spare (block padding, hand-made scripts) and bounds the scan passes of any JPEG to
#: about 2 s at the default 89.5 Mpx (libjpeg's colour script costs 8-14, Huffman-coded).
WORK_PER_PIXEL = 64
#: Arithmetic-coded scans count this many times their samples: 1.4-2.6x the Huffman floor measured.
ARITHMETIC_WEIGHT = 2

# A marker as libjpeg finds it in entropy-coded data: FF then neither a stuffed 00, nor fill, nor
# a restart marker (RSTn, part of the scan). One regex search skips a whole scan's data in C.
_MARKER = re.compile(rb"\xff[\x01-\xcf\xd8-\xfe]")


Comps = tuple[tuple[int, int, int], ...]  # (id, h, v) of each component of a frame


class Scans(NamedTuple):
    """What a JPEG's scans cost a decoder, read from their headers (the data is skipped)."""

    number: int  # scans libjpeg reads, counted up to MAX_SCANS + 1
    work: int  # samples the scans visit: 64 per block of each scan (ARITHMETIC_WEIGHT x 64)
    problem: str | None  # why the scans alone are refused (too many, a repeat), or None


def components(seg: memoryview | bytes) -> Comps:
    """``(id, h, v)`` sampling factors of each component of a frame header's body (after its
    length field), as far as the segment holds them."""
    nf = seg[5] if len(seg) > 5 else 0
    return tuple(
        (seg[6 + 3 * c], seg[7 + 3 * c] >> 4, seg[7 + 3 * c] & 15)
        for c in range(nf)
        if 8 + 3 * c <= len(seg)
    )


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _blocks(height: int, width: int, comps: Comps) -> tuple[dict[int, int], int, dict[int, int]]:
    """Blocks of each component (what a scan of it alone visits), MCUs, and blocks per MCU of
    each component (an interleaved scan visits the MCUs' blocks of its components), as libjpeg
    sizes them (jdinput.c); a sampling factor of 0, which libjpeg refuses, counts as 1."""
    hmax = max([h for _, h, _ in comps] + [1])
    vmax = max([v for _, _, v in comps] + [1])
    alone = {
        cid: _ceil(_ceil(width * max(h, 1), hmax), 8) * _ceil(_ceil(height * max(v, 1), vmax), 8)
        for cid, h, v in comps
    }
    per_mcu = {cid: max(h, 1) * max(v, 1) for cid, h, v in comps}
    return alone, _ceil(width, 8 * hmax) * _ceil(height, 8 * vmax), per_mcu


def _repeat(scan: int, cid: int, ss: int, se: int) -> str:
    return (
        f"JPEG whose scan {scan} codes again coefficients {ss}-{se} of component {cid}, which an "
        "earlier scan coded (a progression no encoder writes; libjpeg decodes each such scan as "
        "another pass over the whole image): refused as a denial of service; if it is genuine, "
        "rewrite it losslessly as one scan with 'jpegtran -copy all IN > OUT'"
    )


def read_scans(
    b: memoryview | bytes,
    pos: int,
    *,
    height: int,
    width: int,
    comps: Comps,
    progressive: bool,
    arithmetic: bool,
) -> Scans:
    """The scans libjpeg reads from the SOS marker at ``pos`` to the end of the image (EOI, a
    second SOI or the end of the data), of a frame of ``height`` x ``width`` and ``comps``
    (:func:`components`): their count (up to ``MAX_SCANS + 1``), the samples they visit, and the
    first scan that codes again a coefficient bit an earlier one coded (a progressive first scan
    of a coefficient already sent, a refinement of a bit not next in line; in a sequential JPEG,
    a component a second time). Segment bodies are skipped by their length, scan data by one
    C-level search per marker (~1.5 GB/s): tens of microseconds for a normal progressive JPEG."""
    weight = 64 * (ARITHMETIC_WEIGHT if arithmetic else 1)
    n = len(b)
    if not progressive and pos + 4 < n and b[pos + 4] >= len(comps):
        # a sequential JPEG whose first scan holds every component is decoded from that scan
        # alone (libjpeg fails at a second one): one pass over every block, no further walk
        hmax = max([h for _, h, _ in comps] + [1])
        vmax = max([v for _, _, v in comps] + [1])
        blocks = sum(max(h, 1) * max(v, 1) for _, h, v in comps)
        return Scans(1, _ceil(width, 8 * hmax) * _ceil(height, 8 * vmax) * blocks * weight, None)
    alone, mcus, per_mcu = _blocks(height, width, comps)
    coded = dict.fromkeys(alone, 0)  # per component: coefficients first sent (bit mask)
    levels = {cid: [0] * 16 for cid in alone}  # per component and Al: coefficients at that Al
    count = work = 0
    while count <= MAX_SCANS:
        hit = _MARKER.search(b, pos)
        if hit is None:
            break
        code, pos = b[hit.start() + 1], hit.end()
        if code == 0xD9 or code == 0xD8:  # EOI: the end; a second SOI: libjpeg stops there
            break
        if code == 0x01 or pos + 2 > n:  # TEM has no length
            continue
        length = (b[pos] << 8) | b[pos + 1]
        if code == 0xDA:
            count += 1
            ns = b[pos + 2] if pos + 2 < n else 0
            if pos + 6 + 2 * ns > n:
                break
            ids = b[pos + 3 : pos + 3 + 2 * ns : 2]
            ss, se, a = b[pos + 3 + 2 * ns], b[pos + 4 + 2 * ns], b[pos + 5 + 2 * ns]
            ah, al = a >> 4, a & 15
            known = [cid for cid in ids if cid in alone]
            if ns == 1:
                work += alone.get(ids[0], 0) * weight
            else:
                work += mcus * sum([per_mcu[cid] for cid in known]) * weight
            if not progressive:
                ss, se, ah, al = 0, 63, 0, 0
            mask = ((1 << (min(se, 63) + 1)) - 1) & ~((1 << ss) - 1)
            for cid in known:
                lv = levels[cid]
                if ah == 0:
                    if coded[cid] & mask:
                        return Scans(count, work, _repeat(count, cid, ss, se))
                    coded[cid] |= mask
                elif lv[ah] & mask != mask:
                    return Scans(count, work, _repeat(count, cid, ss, se))
                else:
                    lv[ah] &= ~mask
                lv[al] |= mask
        pos += length if length > 2 else 2
    return Scans(count, work, TOO_MANY_SCANS if count > MAX_SCANS else None)


TOO_MANY_SCANS = (
    f"JPEG with more than {MAX_SCANS} scans (libjpeg decodes each one over the "
    "whole image; encoders write 6-18): refused as a denial of service; if it is "
    "genuine, rewrite it losslessly as one scan with 'jpegtran -copy all IN > OUT'"
)


def jpeg_header(b: memoryview | bytes) -> tuple[int, int, Scans] | None:
    """``(height, width, scans)`` of JPEG bytes: the first frame header's (SOF) size as stored
    (before EXIF orientation) and :func:`read_scans` (nothing without a scan); None without a
    frame header. Microseconds (tens for a progressive JPEG): the decode-time re-check."""
    pos, n, frame = 2, len(b), None
    sof: dict[str, Any] = {}
    while pos < n:
        marker, pos = _next_marker(b, pos)
        if marker < 0 or marker == 0xD9 or pos + 2 > n:
            break
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:
            continue
        if marker == 0xDA:
            if frame is None:
                break
            h, w = frame
            return h, w, read_scans(b, pos - 2, height=h, width=w, **sof)
        if frame is None and (marker in _SOF_KINDS or marker in _SOF_UNSUPPORTED):
            if pos + 8 > n:
                return None
            frame = struct.unpack_from(">HH", b, pos + 3)
            seg = b[pos : pos + max((b[pos] << 8) | b[pos + 1], 2)]
            sof = frame_kind(marker, components(seg[2:]))
        pos += max((b[pos] << 8) | b[pos + 1], 2)
    return None if frame is None else (frame[0], frame[1], NO_SCANS)


NO_SCANS = Scans(0, 0, None)


def frame_kind(marker: int, comps: Comps) -> dict[str, Any]:
    """:func:`read_scans`' frame arguments for a frame header of ``marker`` (SOFn)."""
    return {
        "comps": comps,
        "progressive": marker in _PROGRESSIVE,
        "arithmetic": marker in _ARITHMETIC,
    }
