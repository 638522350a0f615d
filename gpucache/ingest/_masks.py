"""Masks at build: each one read, decoded once to check it, and kept encoded.

A mask is accepted when PIL reads all of it (a truncated or corrupt file is refused), it is 2-D
with one of the modes :class:`~gpucache.store._masks.MaskKind` names (``L``: 8-bit values, ``P``:
palette indices, kept as indices, ``I;16``: 16-bit values) and its width and height are its
image's after EXIF orientation (masks are in the displayed orientation; a mask's own EXIF
orientation, if any, is not applied). Colour masks (``RGB``, ``RGBA``, ``LA``), bilevel
(``1``), 32-bit and float masks are refused with the reason: their pixels are not class ids, and
a conversion would have to guess a colour-to-id table. JPEG masks are refused too: a lossy
encoding changes the values along every class boundary.

A PNG is kept byte for byte, as on disk. Re-encoding it losslessly at zlib level 9 saved 11-30 %
of the mask bytes of generated ISIC-like, VOC-like and 16-bit masks saved the usual way (PIL's
default level): 0.2-1.2 KiB a mask, under 1 % of a store whose images weigh 100 KiB or more each,
for 2-5 ms more build time a mask (``benchmarks/mask_png_size.py``, 2026-12-06, 2 cores,
``benchmarks/results/mask-png-size.txt``); not worth it, and the bytes stay those of the file.
A mask in another lossless format PIL reads (BMP, TIFF, GIF, PPM/PGM) is re-encoded once as PNG
with the same values, so the decoders only ever meet PNG. The mask of an image that ``max_side``
re-encodes smaller is resized with it, by nearest neighbour (values kept), and stored as PNG.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from ..store._masks import MaskKind
from ..store._oom import BUILD_FIX, raise_if_out_of_memory
from ..store._png import stream_problem
from ._sniff import SniffError

#: The PIL modes a mask may have, and what each is stored as.
MODES = {"L": MaskKind.L, "P": MaskKind.P, "I;16": MaskKind.I16, "I;16L": MaskKind.I16}
_BIG_ENDIAN_16 = ("I;16B",)


def check_mask(data: bytes | memoryview, height: int, width: int) -> tuple[bytes, MaskKind]:
    """The bytes to store for a mask and its kind, or a :class:`SniffError` saying why it cannot
    be the mask of an image of ``height`` x ``width`` (after EXIF orientation)."""
    if len(data) == 0:
        raise SniffError("the mask is empty (0 bytes)")
    try:
        im = Image.open(io.BytesIO(data))
        fmt, mode, size = im.format, im.mode, im.size
        if fmt == "JPEG" or fmt == "MPO":
            raise SniffError(
                "the mask is a JPEG, whose lossy coding changes the values along every class "
                "boundary; save masks as PNG"
            )
        if size != (width, height):
            raise SniffError(
                f"the mask is {size[1]}x{size[0]} (height x width), its image {height}x{width} "
                "after EXIF orientation; a mask must have its image's displayed size"
            )
        kind = MODES.get(mode) or (MaskKind.I16 if mode in _BIG_ENDIAN_16 else None)
        if kind is None:
            raise SniffError(
                f"the mask's mode is {mode!r}; a mask holds class ids in one channel: 8-bit "
                "'L', palette 'P' (the index is the id) or 16-bit 'I;16'. Convert a colour mask "
                "to ids first (e.g. a colour -> id lookup saved as 'L' or 'P')"
            )
        im.load()  # every pixel decoded: a truncated or corrupt mask is refused here
    except SniffError:
        raise
    except Exception as err:  # PIL raises many types for bad bytes; each is this mask's reason
        # the machine's problem, not a bad mask
        raise_if_out_of_memory(err, "checking a mask at build", fix=BUILD_FIX)
        raise SniffError(f"the mask is not an image PIL can read ({err})") from err
    if fmt == "PNG" and mode != "I;16B":
        why = stream_problem(data)  # what the loader's PNG decoder would crash on
        if why is not None:
            raise SniffError(
                f"the mask's PNG is damaged: {why}; PIL read its pixels, but they cannot be "
                "trusted. Save the mask again (or restore it from its source)"
            )
        return bytes(data), kind
    return _as_png(im), kind


def _as_png(im: Image.Image) -> bytes:
    """``im`` re-encoded as PNG with the same values (palette indices and 16-bit kept)."""
    if im.mode in _BIG_ENDIAN_16 or im.mode == "I;16L":
        im = Image.frombytes("I;16", im.size, np.asarray(im).astype("<u2").tobytes())
    out = io.BytesIO()
    im.save(out, format="PNG")
    return out.getvalue()


def resize_mask(data: bytes, height: int, width: int) -> bytes:
    """A mask resized to ``height`` x ``width`` by nearest neighbour (values kept, never blended),
    as PNG: for an image the build re-encoded smaller (``max_side``)."""
    with Image.open(io.BytesIO(data)) as im:
        return _as_png(im.resize((width, height), Image.Resampling.NEAREST))


def decode_mask(data: bytes | memoryview | np.ndarray) -> np.ndarray:
    """A stored mask's values, (H, W) uint8 (``L``, ``P`` indices) or uint16 (``I;16``)."""
    with Image.open(io.BytesIO(memoryview(data).tobytes())) as im:  # type: ignore[arg-type]
        a = np.asarray(im)
    if im.mode.startswith("I;16"):
        return a.astype(np.uint16, copy=False)
    return a
