"""PIL images as gpucache's decoders give them: 8 bits per channel, upright under the store's
orientation record. Shared by the CPU decode of non-JPEG images and the build-time re-encode.

16-bit samples keep their high byte (0-65535 -> 0-255), as PIL itself reads 16-bit RGB, RGBA
and gray+alpha PNGs; PIL opens 16-bit gray (PNG, TIFF) as ``I;16``/``I;16B`` and 32-bit
integer TIFF as ``I``, whose own conversion to 8 bits clips every value over 255 to white.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from PIL import Image

#: PIL modes of integer gray wider than 8 bits; their values are read as 16-bit samples.
WIDE = frozenset({"I", "I;16", "I;16B", "I;16L", "I;16N"})
STRIP = 1 << 20  # pixels of a wide image converted at a time


def _transpositions() -> dict[int, Image.Transpose]:
    from PIL import Image

    t = Image.Transpose
    return {
        2: t.FLIP_LEFT_RIGHT,
        3: t.ROTATE_180,
        4: t.FLIP_TOP_BOTTOM,
        5: t.TRANSPOSE,
        6: t.ROTATE_270,
        7: t.TRANSVERSE,
        8: t.ROTATE_90,
    }


def eight_bit(im: Image.Image) -> Image.Image:
    """``im`` with 8-bit samples: a :data:`WIDE` gray image becomes ``L`` (its high byte, values
    clipped to 0-65535 first), converted in strips of :data:`STRIP` pixels so that it costs
    the 8-bit image beyond its own pixels; any other image is returned as it is."""
    from PIL import Image

    if im.mode not in WIDE:
        return im
    w, h = im.size
    out = np.empty((h, w), dtype=np.uint8)
    rows = max(1, STRIP // max(w, 1))
    for y in range(0, h, rows):
        a = np.asarray(im.crop((0, y, w, min(h, y + rows))))
        if a.dtype.itemsize > 2:  # "I": 32-bit signed
            a = np.clip(a, 0, 65535)
        out[y : y + rows] = a >> 8
    return Image.fromarray(out)


def upright(im: Image.Image, orientation: int) -> Image.Image:
    """``im`` (as stored) turned as EXIF ``orientation`` says, the rule the store recorded for
    it (``samples["orientation"]``, see ``_sniff``); values outside 2-8 leave it as it is."""
    t = _transpositions().get(int(orientation))
    return im if t is None else im.transpose(t)


def bytes_per_pixel(mode: str) -> int:
    """What PIL holds a pixel of ``mode`` in (multi-band 8-bit modes take 4 bytes)."""
    return 1 if mode in ("1", "L", "P") else 2 if mode.startswith("I;16") else 4
