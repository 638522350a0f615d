"""A mask's PNG checked whole before libpng decodes it: chunks, CRCs and the image data's length.

torchvision's ``decode_png`` (the masks' fast decoder) crashes the process (SIGSEGV) on an error
libpng raises while it reads the image data: a chunk whose CRC does not match, a zlib stream that
is corrupt or ends early, a row with an unknown filter type (found by ``benchmarks/fuzz/run.py
--inputs``; errors in the header are raised as exceptions). So before a stored mask reaches it,
:func:`stream_problem` walks the PNG's chunks (each length within the file, each CRC-32 right,
IHDR first, a palette before the image data of a palette PNG, the image data in consecutive
chunks, an IEND) and inflates the image data once, stopping one byte past the size the header
implies: the stream must end there, with every row's filter type 0-4. A zlib bomb (more data than
the size) is refused at that byte, whatever it would inflate to. The same check refuses such a
mask at build, where PIL, which reads no CRC of the image data, would take it.

It costs one inflate of the mask and a CRC-32 of its bytes: 0.08-0.10 ms for a 375 x 500 mask
of class blocks or of a lesion, where ``decode_png`` takes 0.09-0.20 ms, and 0.74 ms for one of
noise (1.09), one thread, 2026-12-07 on the 2-core development machine. :func:`torchvision_reads` says where ``decode_png`` gives the
stored values: not for palette PNGs of 1, 2 or 4 bits, whose indices it does not unpack (it
returned other bytes than the indices); those are read by PIL. :func:`check_stored` is what the
loader's decode and ``gpucache verify`` run on a stored mask: its header against its record in
``masks.info`` (size, and a colour type and bit depth of the recorded kind), then that check.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

from ._masks import MaskKind

SIGNATURE = b"\x89PNG\r\n\x1a\n"
_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}
#: Adam7: (first row, first column, row step, column step) of each pass
_ADAM7: tuple[tuple[int, int, int, int], ...] = (
    (0, 0, 8, 8),
    (0, 4, 8, 8),
    (4, 0, 8, 4),
    (0, 2, 4, 4),
    (2, 0, 4, 2),
    (0, 1, 2, 2),
    (1, 0, 2, 1),
)


def _rows(height: int, width: int, bits: int, interlaced: bool) -> tuple[int, int]:
    """(rows, bytes of image data: each row's filter byte and its packed pixels)."""
    passes = _ADAM7 if interlaced else ((0, 0, 1, 1),)
    rows = total = 0
    for top, left, dy, dx in passes:
        h, w = -(-(height - top) // dy), -(-(width - left) // dx)
        if h <= 0 or w <= 0:
            continue
        rows += h
        total += h * (1 + -(-(w * bits) // 8))
    return rows, total


def stream_problem(data: bytes | memoryview | np.ndarray) -> str | None:
    """What is wrong with the PNG ``data`` in the eyes of libpng's image-data reader, or None."""
    b = bytes(memoryview(data))  # type: ignore[arg-type]
    if b[:8] != SIGNATURE:
        return "no PNG signature"
    at, idat, ended = 8, 0, False
    seen: list[bytes] = []
    parts: list[bytes] = []
    head: tuple[int, ...] | None = None
    while at + 8 <= len(b):
        n, kind = struct.unpack(">I4s", b[at : at + 8])
        if n > len(b) - at - 12:
            return f"chunk {kind.decode('latin-1')!r} claims {n:,} bytes, more than the file holds"
        body, crc = b[at + 8 : at + 8 + n], b[at + 8 + n : at + 12 + n]
        if zlib.crc32(kind + body) != int.from_bytes(crc, "big"):
            return f"chunk {kind.decode('latin-1')!r} fails its CRC-32 (a damaged file)"
        if not seen and kind != b"IHDR":
            return "the first chunk is not IHDR"
        if kind == b"IHDR":
            if seen or n != 13:
                return "a second or malformed IHDR chunk"
            head = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            if idat and seen[-1] != b"IDAT":
                return "image data in chunks that are not consecutive"
            if head is not None and head[3] == 3 and b"PLTE" not in seen:
                return "a palette PNG whose image data comes before its palette"
            idat += 1
            parts.append(body)
        elif kind == b"IEND":
            ended = True
            break
        seen.append(kind)
        at += 12 + n
    if head is None:
        return "no IHDR chunk"
    if not ended:
        return "no IEND chunk (a file cut short)"
    if not idat:
        return "no image data (IDAT)"
    width, height, depth, colour, _, _, interlace = head
    if colour not in _CHANNELS or interlace > 1 or not width or not height:
        return f"an IHDR libpng refuses (colour type {colour}, interlace {interlace})"
    rows, size = _rows(height, width, depth * _CHANNELS[colour], interlace == 1)
    inflate = zlib.decompressobj()
    try:
        raw = inflate.decompress(b"".join(parts), size + 1)
    except zlib.error as err:
        return f"its image data is not a zlib stream libpng can read ({err})"
    if len(raw) > size or inflate.unconsumed_tail:
        return f"its image data inflates past the {size:,} bytes its size needs (a zlib bomb)"
    if len(raw) < size or not inflate.eof:
        return f"its image data ends before the {size:,} bytes its size needs"
    filters = _filter_bytes(raw, height, width, depth * _CHANNELS[colour], interlace == 1)
    if len(filters) != rows or (filters > 4).any():
        return "a row of its image data has an unknown filter type"
    return None


def _filter_bytes(raw: bytes, height: int, width: int, bits: int, interlaced: bool) -> np.ndarray:
    """Each row's filter byte, in order."""
    a = np.frombuffer(raw, dtype=np.uint8)
    out, at = [], 0
    for top, left, dy, dx in _ADAM7 if interlaced else ((0, 0, 1, 1),):
        h, w = -(-(height - top) // dy), -(-(width - left) // dx)
        if h <= 0 or w <= 0:
            continue
        stride = 1 + -(-(w * bits) // 8)
        out.append(a[at : at + h * stride : stride])
        at += h * stride
    return np.concatenate(out) if out else a[:0]


def torchvision_reads(data: bytes | memoryview | np.ndarray) -> bool:
    """Whether torchvision's ``decode_png`` gives this PNG's stored values: every form but a
    palette of 1, 2 or 4 bits (read by PIL instead)."""
    head = bytes(memoryview(data)[24:26])  # type: ignore[arg-type]  # IHDR's depth, colour
    return len(head) == 2 and not (head[1] == 3 and head[0] < 8)


def check_stored(data: bytes | memoryview | np.ndarray, kind: int, height: int, width: int) -> None:
    """A stored mask checked before it is decoded (the loader's decode and ``gpucache verify``):
    its header against its record in ``masks.info`` (:func:`_check_header`), then the whole PNG
    as libpng will read it (:func:`stream_problem`). A ValueError says what is wrong."""
    _check_header(data, kind, height, width)
    why = stream_problem(data)  # libpng's errors in the image data crash decode_png
    if why is not None:
        raise ValueError(f"its stored mask's PNG is damaged ({why}): rebuild the store")


#: Per kind, the PNG colour type and the bit depths that decode to it (PIL reads 2- and 4-bit
#: greyscale as "L", 1- to 8-bit palette images as "P"; the build refuses 1-bit greyscale).
_PNG_FORMS = {
    MaskKind.L: (0, (2, 4, 8)),
    MaskKind.P: (3, (1, 2, 4, 8)),
    MaskKind.I16: (0, (16,)),
}
_COLOUR_TYPES = {0: "greyscale", 2: "RGB", 3: "palette", 4: "greyscale + alpha", 6: "RGBA"}


def _check_header(
    data: bytes | memoryview | np.ndarray, kind: int, height: int, width: int
) -> None:
    """Check a stored mask's PNG header (its IHDR: 33 bytes, nothing decoded) against its record
    in ``masks.info``: the size and a colour type and bit depth that decode to ``kind``. A
    ValueError says what differs: a store whose records lie (an altered file with valid
    checksums) is refused before a pixel is decoded, so a claimed 40000 x 40000 mask costs no
    memory and a 16-bit mask recorded as 8-bit is never cut to 8 bits."""
    head = bytes(memoryview(data)[:33])  # type: ignore[arg-type]
    if len(head) < 33 or head[:8] != SIGNATURE or head[12:16] != b"IHDR":
        raise ValueError("its stored mask is not a PNG (no PNG signature and IHDR header)")
    w, h = int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
    depth, colour = head[24], head[25]
    if (h, w) != (height, width):
        raise ValueError(
            f"its stored mask's PNG header says {h}x{w} (height x width), the store's record "
            f"{height}x{width}; the store was altered after its build: rebuild it"
        )
    want = MaskKind(kind) if kind in {int(k) for k in MaskKind} else None
    if want is None:
        raise ValueError(f"its mask record has kind {kind}, which no mask kind is")
    colour_type, depths = _PNG_FORMS[want]
    if colour != colour_type or depth not in depths:
        what = f"{depth}-bit {_COLOUR_TYPES.get(colour, f'colour type {colour}')}"
        raise ValueError(
            f"its stored mask's PNG is {what}, but the store records it as {want.name} "
            f"({want.dtype} values); the store was altered after its build: rebuild it"
        )
