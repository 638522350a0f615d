"""Hostile and odd image files, generated (never downloaded), with the outcome gpucache promises.

Used (``hostile_image_bytes``, ``make_hostile_folder``) by the
bad-input, sniffing and fuzz tests. Outcomes: ``"kept"`` (kept at build and decodes to the stored
size), ``"skip"`` (left out at build with a reason), ``"decode-fails"`` (kept, reported at decode).
"""

from __future__ import annotations

import io
import os
import pathlib
import struct
import zlib

from PIL import Image

SOF0 = b"\xff\xc0"


def _jpeg(width: int, height: int, seed: int, **kw) -> bytes:
    from gpucache.testing import make_jpeg_bytes

    return make_jpeg_bytes(width, height, seed=seed, **kw)


def patch_sof(jpeg: bytes, *, height: int, width: int) -> bytes:
    """``jpeg`` with the frame header (SOF0) claiming ``height`` x ``width``: a decompression bomb
    when large (a few KB of file, gigabytes once decoded)."""
    p = jpeg.index(SOF0) + 5  # FFC0, length (2), precision (1)
    return jpeg[:p] + struct.pack(">HH", height, width) + jpeg[p + 4 :]


def exif_app1(orientation: int, *, order: bytes = b"II", long: bool = False) -> bytes:
    """An APP1 Exif segment whose IFD0 holds only Orientation, as SHORT (or LONG if ``long``)."""
    e = "<" if order == b"II" else ">"
    value = struct.pack(e + "I", orientation) if long else struct.pack(e + "HH", orientation, 0)
    entry = struct.pack(e + "HHI", 0x0112, 4 if long else 3, 1) + value
    tiff = order + struct.pack(e + "HI", 42, 8) + struct.pack(e + "H", 1) + entry + b"\0" * 4
    payload = b"Exif\0\0" + tiff
    return b"\xff\xe1" + struct.pack(">H", len(payload) + 2) + payload


def xmp_app1(orientation: int) -> bytes:
    """An APP1 XMP segment that also states an orientation (which libjpeg's decoders ignore)."""
    payload = (
        b"http://ns.adobe.com/xap/1.0/\0<x:xmpmeta xmlns:x='adobe:ns:meta/'><rdf:RDF "
        b"xmlns:rdf='http://www.w3.org/1999/02/22-rdf-syntax-ns#'><rdf:Description "
        b"xmlns:tiff='http://ns.adobe.com/tiff/1.0/' tiff:Orientation='%d'/></rdf:RDF>"
        b"</x:xmpmeta>" % orientation
    )
    return b"\xff\xe1" + struct.pack(">H", len(payload) + 2) + payload


def after_soi(jpeg: bytes, *segments: bytes) -> bytes:
    return jpeg[:2] + b"".join(segments) + jpeg[2:]


def before_marker(jpeg: bytes, marker: bytes, junk: bytes) -> bytes:
    """``junk`` inserted right before the first ``marker`` (two bytes, e.g. FFDB)."""
    p = jpeg.index(marker, 2)
    return jpeg[:p] + junk + jpeg[p:]


def extra_scans(jpeg: bytes, count: int) -> bytes:
    """Progressive ``jpeg`` with ``count`` more scans before its end: each an AC scan of the first
    component that is one end-of-band run over all its blocks. Valid (libjpeg decodes it to the
    same pixels, without a warning), a few bytes a scan, and each scan costs the decoder a pass
    over every block: 20,000 of them add under 1 MB to a 4000 x 4000 JPEG."""
    pos = 2
    while jpeg[pos + 1] != 0xC2:  # the progressive frame header (SOF2)
        pos += 2 + struct.unpack_from(">H", jpeg, pos + 2)[0]
    height, width, ncomp = struct.unpack_from(">HHB", jpeg, pos + 5)
    cid, hv = jpeg[pos + 10], jpeg[pos + 11]
    factors = jpeg[pos + 11 : pos + 11 + 3 * ncomp : 3]
    hmax, vmax = max(f >> 4 for f in factors), max(f & 15 for f in factors)
    cols, rows = -(-width * (hv >> 4) // hmax), -(-height * (hv & 15) // vmax)  # its samples
    blocks = -(-cols // 8) * -(-rows // 8)
    data = _eob_runs(blocks)
    table = b"\x10" + bytes([0, 0, 0, 15] + [0] * 12) + bytes(range(0, 0xF0, 0x10))  # AC table 0
    dht = b"\xff\xc4" + struct.pack(">H", 2 + len(table)) + table
    scan = b"\xff\xda\x00\x08\x01" + bytes([cid]) + b"\x00\x01\x3f\x00" + data
    end = jpeg.rindex(b"\xff\xd9")
    return jpeg[:end] + dht + scan * count + jpeg[end:]


def _segment(marker: int, body: bytes) -> bytes:
    return bytes((0xFF, marker)) + struct.pack(">H", len(body) + 2) + body


def _eob_runs(blocks: int) -> bytes:
    """Huffman scan data (AC table 0 of :func:`flat_progressive`) that is end-of-band runs over
    ``blocks`` blocks: EOBRUN codes, symbol r<<4 (4-bit code r) then r bits of run - 2**r."""
    bits, nbits = 0, 0
    while blocks:
        run = min(blocks, 32767)
        r = run.bit_length() - 1
        bits, nbits = (bits << (4 + r)) | (r << r) | (run - (1 << r)), nbits + 4 + r
        blocks -= run
    pad = -nbits % 8
    data = ((bits << pad) | ((1 << pad) - 1)).to_bytes((nbits + pad) // 8, "big")
    return data.replace(b"\xff", b"\xff\x00")


#: libjpeg's progressive scripts (jcparam.c, jpeg_simple_progression), as (components, Ss, Se,
#: Ah, Al): 10 scans for YCbCr, 18 for 4 components (CMYK).
COLOUR_SCRIPT = (
    ((0, 1, 2), 0, 0, 0, 1),
    ((0,), 1, 5, 0, 2),
    ((2,), 1, 63, 0, 1),
    ((1,), 1, 63, 0, 1),
    ((0,), 6, 63, 0, 2),
    ((0,), 1, 63, 2, 1),
    ((0, 1, 2), 0, 0, 1, 0),
    ((2,), 1, 63, 1, 0),
    ((1,), 1, 63, 1, 0),
    ((0,), 1, 63, 1, 0),
)
CMYK_SCRIPT = (
    ((0, 1, 2, 3), 0, 0, 0, 1),
    *(((c,), 1, 5, 0, 2) for c in range(4)),
    *(((c,), 6, 63, 0, 2) for c in range(4)),
    *(((c,), 1, 63, 2, 1) for c in range(4)),
    ((0, 1, 2, 3), 0, 0, 1, 0),
    *(((c,), 1, 63, 1, 0) for c in range(4)),
)


def one_coefficient_script(scans: int, comps: int = 3) -> tuple:
    """A valid script of ``scans`` distinct scans (at most 1 + 63 x ``comps``): the DC of every
    component, then AC scans of one coefficient each, component by component."""
    ac = [((c,), k, k, 0, 0) for c in range(comps) for k in range(1, 64)]
    return (((*range(comps),), 0, 0, 0, 0), *ac[: scans - 1])


def flat_progressive(
    height: int,
    width: int,
    script,
    *,
    comps: int = 3,
    sampling: int = 0x11,
    arithmetic: bool = False,
    eob_runs: bool = True,
) -> bytes:
    """A valid progressive JPEG of a flat gray image (every coefficient 0) written with the scan
    ``script`` ((components, Ss, Se, Ah, Al) per scan; components index the frame's), a few bytes
    a scan at any size: a DC scan codes each block's zero difference, an AC scan is end-of-band
    runs (``eob_runs=False``: an end-of-band code in each block, which costs the decoder a
    Huffman decode a block); ``sampling`` is the first component's factors (0x22: 4:2:0). Arithmetic coding
    (SOF10) takes DC scans only, each with no data at all: libjpeg's arithmetic decoder reads
    zeros at a marker (the standard's convention, without a warning), which decode to small
    differences (a gentle gradient, not flat), so each scan is a pass over every block for 14
    bytes. libjpeg decodes any such script, a scan repeated too, without a warning."""
    hs = [sampling >> 4 if c == 0 else 1 for c in range(comps)]
    vs = [sampling & 15 if c == 0 else 1 for c in range(comps)]
    hmax, vmax = max(hs), max(vs)
    mcus = -(-width // (8 * hmax)) * -(-height // (8 * vmax))
    out = [b"\xff\xd8", _segment(0xDB, b"\x00" + bytes([1] * 64))]
    frame = struct.pack(">BHHB", 8, height, width, comps)
    frame += b"".join(bytes((c + 1, hs[c] << 4 | vs[c], 0)) for c in range(comps))
    out.append(_segment(0xCA if arithmetic else 0xC2, frame))
    if not arithmetic:  # DC table 0: one symbol (0: no difference), code 0; AC table 0: EOBRUNs
        dc = b"\x00" + bytes([1] + [0] * 15) + b"\x00"
        ac = b"\x10" + bytes([0, 0, 0, 15] + [0] * 12) + bytes(range(0, 0xF0, 0x10))
        out.append(_segment(0xC4, dc + ac))
    for members, ss, se, ah, al in script:
        header = bytes([len(members)]) + b"".join(bytes((c + 1, 0)) for c in members)
        out.append(_segment(0xDA, header + bytes((ss, se, ah << 4 | al))))
        if arithmetic:
            if ss != 0:
                raise ValueError("flat_progressive writes arithmetic-coded DC scans only")
            continue
        if len(members) > 1:  # interleaved (DC only): the blocks of every MCU
            blocks = mcus * sum(hs[c] * vs[c] for c in members)
        else:  # one component: its own blocks
            c = members[0]
            cols, rows = -(-width * hs[c] // hmax), -(-height * vs[c] // vmax)
            blocks = -(-cols // 8) * -(-rows // 8)
        if ss == 0:  # DC: a 0 bit a block (the symbol of a first scan, the refinement bit)
            out.append(b"\x00" * -(-blocks // 8))
        elif eob_runs:  # AC: end-of-band runs over the component's blocks
            out.append(_eob_runs(blocks))
        else:  # AC: an end-of-band code (symbol 0, code 0000) in each block
            out.append(b"\x00" * -(-blocks // 2))
    out.append(b"\xff\xd9")
    return b"".join(out)


def arithmetic_dc_repeats(height: int = 9456, width: int = 9456, repeats: int = 97) -> bytes:
    """The decode-cost attack on a scan count: a 9456 x 9456 arithmetic-coded progressive JPEG
    (within the default ``max_pixels``) whose first DC scan comes ``repeats`` + 1 times, 98
    scans: 1.5 KB, and 5-10 s of libjpeg decode (every scan is a pass over all 4.2 M blocks)."""
    dc = ((0, 1, 2), 0, 0, 0, 0)
    return flat_progressive(height, width, (dc,) * (repeats + 1), arithmetic=True)


def png_bytes(
    width: int, height: int, *, idat: bytes | None = None, chunks_after: bytes = b""
) -> bytes:
    """A grayscale PNG of zeros written row by row (a 12000 x 12000 one is about 140 KB and never
    held decoded); ``idat`` replaces the image data (e.g. garbage); ``chunks_after`` go after it."""

    def chunk(cid: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + cid + data + struct.pack(">I", zlib.crc32(cid + data))

    if idat is None:
        z, row, parts = zlib.compressobj(9), b"\0" * (width + 1), []
        parts += [z.compress(row) for _ in range(height)]
        idat = b"".join(parts) + z.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", idat)
        + chunks_after
        + chunk(b"IEND", b"")
    )


def png_exif_chunk(orientation: int) -> bytes:
    data = exif_app1(orientation)[10:]  # the TIFF structure, without "Exif\0\0"
    return (
        struct.pack(">I", len(data))
        + b"eXIf"
        + data
        + struct.pack(">I", zlib.crc32(b"eXIf" + data))
    )


def hostile_image_bytes(*, fill_bytes: int = 1 << 20) -> dict[str, tuple[bytes, str]]:
    """``{name: (bytes, outcome)}`` for the hostile and odd inputs gpucache handles on purpose.

    Bombs claim far more pixels than the default ``max_pixels`` (skipped at build); the JPEG
    oddities libjpeg-turbo accepts (junk or ``fill_bytes`` of FF fill between markers, a short
    APP14, EXIF layouts) are kept and decode to the stored size; the usual odd-but-valid photos
    (CMYK, grayscale, progressive, EXIF-rotated, a PNG named .jpg) are kept."""
    good = _jpeg(48, 32, 1)
    small = _jpeg(16, 16, 2, quality=50)
    png = io.BytesIO()
    Image.new("RGB", (30, 20), (200, 10, 10)).save(png, "PNG")
    short_app14 = b"\xff\xee\x00\x08Adobe\x00" + b"\x64\x00\x00\x00\x00\x01"  # 6 bytes spill out
    return {
        "good.jpg": (good, "kept"),
        "cmyk.jpg": (_jpeg(40, 30, 3, mode="CMYK"), "kept"),
        "gray.jpg": (_jpeg(40, 30, 4, mode="L"), "kept"),
        "progressive.jpg": (_jpeg(40, 30, 5, progressive=True), "kept"),
        "exif6.jpg": (_jpeg(40, 30, 6, exif_orientation=6), "kept"),
        "png_named.jpg": (png.getvalue(), "kept"),
        # decompression bombs: a few KB each
        "bomb_65500.jpg": (patch_sof(small, height=65500, width=65500), "skip"),
        "bomb_30000.jpg": (patch_sof(small, height=30000, width=30000), "skip"),
        "bomb_65500.png": (
            png_bytes(1, 1)[:16] + _ihdr_claiming(65500, 65500) + png_bytes(1, 1)[33:],
            "skip",
        ),
        "bomb_12000.png": (png_bytes(12000, 12000), "skip"),  # real: 144 Mpx, ~140 KB
        # what libjpeg-turbo decodes (with a warning at most)
        "junk_between_markers.jpg": (before_marker(good, b"\xff\xdb", b"\x00junk\x12"), "kept"),
        "short_app14.jpg": (after_soi(good, short_app14), "kept"),
        "ff_fill.jpg": (before_marker(good, b"\xff\xdb", b"\xff" * fill_bytes), "kept"),
        # EXIF layouts: the stored orientation must be the one the decoder applies
        "exif_long_ii.jpg": (after_soi(_jpeg(40, 30, 7), exif_app1(6, long=True)), "kept"),
        "exif_long_mm.jpg": (
            after_soi(_jpeg(40, 30, 8), exif_app1(6, order=b"MM", long=True)),
            "kept",
        ),
        "exif_two_segments.jpg": (after_soi(_jpeg(40, 30, 9), exif_app1(1), exif_app1(6)), "kept"),
        "xmp_before_exif.jpg": (after_soi(_jpeg(40, 30, 10), xmp_app1(6), exif_app1(6)), "kept"),
        "exif_after_sof.jpg": (before_marker(_jpeg(40, 30, 11), b"\xff\xc4", exif_app1(6)), "kept"),
        # PNG: PIL reads an eXIf chunk after the image data when decoding; sniffing must see it
        # without decoding (so a PNG whose image data is garbage is kept, and fails at decode)
        "png_exif_after_idat.png": (png_bytes(40, 30, chunks_after=png_exif_chunk(6)), "kept"),
        "png_bad_idat.png": (png_bytes(40, 30, idat=b"not zlib data"), "decode-fails"),
    }


def _ihdr_claiming(width: int, height: int) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))


def make_hostile_folder(
    root: str | os.PathLike, *, fifo: bool = True, fill_bytes: int = 1 << 20
) -> dict[str, str]:
    """Write :func:`hostile_image_bytes` as ``root/x/<name>`` (plus a FIFO named ``fifo.jpg``,
    skipped at build without being opened) and return ``{path: outcome}``."""
    folder = pathlib.Path(root) / "x"
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, (data, outcome) in hostile_image_bytes(fill_bytes=fill_bytes).items():
        (folder / name).write_bytes(data)
        out[str(folder / name)] = outcome
    if fifo and hasattr(os, "mkfifo"):
        os.mkfifo(folder / "fifo.jpg")
        out[str(folder / "fifo.jpg")] = "skip"
    return out
