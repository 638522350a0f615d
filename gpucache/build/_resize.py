"""Build-time re-encoding, opt-in: the size cap (``max_side=``) and the quality (``jpeg_quality=``).

``max_side``: an image whose long side (as decoded, after EXIF orientation) is larger is decoded
with PIL, turned upright, resized so that its long side is ``max_side`` (Lanczos, after libjpeg's
DCT-domain reduction to no less than 3x the target, as ``Image.thumbnail`` does), and encoded as a
baseline JPEG at ``jpeg_quality`` (:data:`QUALITY` by default; 4:2:0, grayscale kept grayscale,
everything else RGB, as the CPU decoder would give it).

``jpeg_quality``: every other image is decoded, turned upright and encoded the same way at its own
size, and the result kept only where it is smaller than the image's bytes (FFCV's ``jpg`` mode,
less its growth: an image already stored at a lower quality keeps its bytes). Without
``jpeg_quality``, images under the cap keep their bytes exactly. It stays JPEG, so every backend
(GPU decoders included) decodes the store.

The store records what was changed, in two optional sections:

- ``resized``: uint32 ``(N, 3)``: each sample's original height, width (as decoded) and byte
  size when it was re-encoded, zeros when its bytes are the original ones;
- ``resized.args``: int64 ``[max_side, quality]`` (``max_side`` 0: no cap).
"""

from __future__ import annotations

import io
import math

import numpy as np

from ..store._oom import BUILD_FIX, OutOfMemory, is_out_of_memory
from ._sniff import Info, sniff

SECTION = "resized"
ARGS = "resized.args"
QUALITY = 90  # PIL's scale 1-95; what FFCV's jpg mode writes too


def resized(cache) -> np.ndarray | None:
    """Boolean mask of the samples re-encoded under the store's ``max_side``, or None if the
    store was built without one."""
    rec = cache.extra.get(SECTION)
    return None if rec is None else rec[:, 0] > 0


def max_side_of(cache) -> tuple[int | None, int] | None:
    """``(max_side, quality)`` the store was built with (``max_side`` None when it was built
    with ``jpeg_quality`` alone), or None when nothing was re-encoded at build."""
    args = cache.extra.get(ARGS)
    return None if args is None else (int(args[0]) or None, int(args[1]))


def reencode(data, max_side: int | None, quality: int = QUALITY) -> bytes:
    """``data`` (encoded image bytes) decoded, upright, its long side scaled to ``max_side``
    (None: kept), encoded as JPEG. Raises what PIL raises for bytes it cannot decode."""
    from PIL import Image, ImageOps

    with Image.open(io.BytesIO(data)) as im:
        w, h = im.size  # as stored; the scale is the same after orientation
        if max_side is not None:
            scale = max_side / max(w, h)
            im.draft(None, (math.ceil(w * scale * 3), math.ceil(h * scale * 3)))
        im = ImageOps.exif_transpose(im)
        im = im.convert("L" if im.mode in ("1", "L", "I", "I;16", "F") else "RGB")
        if max_side is not None:
            ow, oh = im.size
            s = max_side / max(ow, oh)
            im = im.resize((max(1, round(ow * s)), max(1, round(oh * s))), Image.LANCZOS)
        out = io.BytesIO()
        im.save(out, "JPEG", quality=quality)
    return out.getvalue()


def _check(name: str, value, low: int, high: int | None, example: str) -> None:
    if value is None:
        return
    if (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low
            or (high is not None and value > high)):
        span = f"an integer from {low} to {high}" if high is not None else "a positive integer"
        raise ValueError(f"{name} must be {span} ({example}) or None, got {value!r}.")


class Reencode:
    """A build rewriter (see ``_pipeline.read_chunk``): images over ``max_side`` resized and
    re-encoded; with ``jpeg_quality``, every other image re-encoded where that saves bytes."""

    columns = {SECTION: ("<u4", 3)}

    def __init__(self, max_side: int | None, jpeg_quality: int | None = None) -> None:
        _check("max_side", max_side, 1, None, "pixels of the long side to cap images at, e.g. 512")
        _check("jpeg_quality", jpeg_quality, 1, 100, "PIL's JPEG quality, e.g. 90")
        self.max_side = None if max_side is None else int(max_side)
        self.all = jpeg_quality is not None  # every image, not only those over the cap
        self.quality = QUALITY if jpeg_quality is None else int(jpeg_quality)

    def __call__(self, data, info: Info):
        over = self.max_side is not None and max(info.height, info.width) > self.max_side
        if not over and not self.all:
            return data, info, {SECTION: (0, 0, 0)}
        try:
            out = reencode(data, self.max_side if over else None, self.quality)
            new = sniff(memoryview(out))
        except Exception as err:  # undecodable pixels: kept as they are; decode reports it
            if is_out_of_memory(err):  # not the image's fault: never left as it was, unasked
                raise OutOfMemory(f"re-encoding a {info.width}x{info.height} image at build", err,
                                  fix=BUILD_FIX) from err
            return data, info, {SECTION: (0, 0, 0)}
        if not over and len(out) >= len(data):  # no smaller at this quality: the bytes stay
            return data, info, {SECTION: (0, 0, 0)}
        return out, new, {SECTION: (info.height, info.width, len(data))}

    def sections(self, columns: dict, k: int) -> dict[str, np.ndarray]:
        return {ARGS: np.array([self.max_side or 0, self.quality], dtype="<i8")}
