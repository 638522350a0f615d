"""The build-time size cap (``max_side=``): images whose long side exceeds it are re-encoded once.

An image whose long side (as decoded, after EXIF orientation) is larger than ``max_side`` is
decoded with PIL, turned upright, resized so that its long side is ``max_side`` (Lanczos, after
libjpeg's DCT-domain reduction to no less than 3x the target, as ``Image.thumbnail`` does), and
encoded as a baseline JPEG at :data:`QUALITY` (4:2:0, grayscale kept grayscale, everything else
RGB, as the CPU decoder would give it). Every other image keeps its bytes exactly. It stays JPEG,
so every backend (GPU decoders included) decodes the capped store.

The store records what was changed, in two optional sections:

- ``resized``: uint32 ``(N, 3)``: each sample's original height, width (as decoded) and byte
  size when it was re-encoded, zeros when its bytes are the original ones;
- ``resized.args``: int64 ``[max_side, quality]``.
"""

from __future__ import annotations

import io
import math

import numpy as np

from ._sniff import Info, sniff

SECTION = "resized"
ARGS = "resized.args"
QUALITY = 90  # PIL's scale 1-95; what FFCV's jpg mode writes too


def resized(cache) -> np.ndarray | None:
    """Boolean mask of the samples re-encoded under the store's ``max_side``, or None if the
    store was built without one."""
    rec = cache.extra.get(SECTION)
    return None if rec is None else rec[:, 0] > 0


def max_side_of(cache) -> tuple[int, int] | None:
    """``(max_side, quality)`` the store was built with, or None."""
    args = cache.extra.get(ARGS)
    return None if args is None else (int(args[0]), int(args[1]))


def reencode(data, max_side: int, quality: int = QUALITY) -> bytes:
    """``data`` (encoded image bytes) decoded, upright, its long side scaled to ``max_side``,
    encoded as JPEG. Raises what PIL raises for bytes it cannot decode."""
    from PIL import Image, ImageOps

    with Image.open(io.BytesIO(data)) as im:
        w, h = im.size  # as stored; the scale is the same after orientation
        scale = max_side / max(w, h)
        im.draft(None, (math.ceil(w * scale * 3), math.ceil(h * scale * 3)))
        im = ImageOps.exif_transpose(im)
        im = im.convert("L" if im.mode in ("1", "L", "I", "I;16", "F") else "RGB")
        ow, oh = im.size
        s = max_side / max(ow, oh)
        im = im.resize((max(1, round(ow * s)), max(1, round(oh * s))), Image.LANCZOS)
        out = io.BytesIO()
        im.save(out, "JPEG", quality=quality)
    return out.getvalue()


class MaxSide:
    """A build rewriter (see ``_pipeline.read_chunk``): re-encode images over ``max_side``."""

    columns = {SECTION: ("<u4", 3)}

    def __init__(self, max_side: int, quality: int = QUALITY) -> None:
        if isinstance(max_side, bool) or not isinstance(max_side, int) or max_side < 1:
            raise ValueError(f"max_side must be a positive number of pixels (the long side to "
                             f"cap images at, e.g. 512) or None, got {max_side!r}.")
        self.max_side, self.quality = max_side, quality

    def __call__(self, data, info: Info):
        if max(info.height, info.width) <= self.max_side:
            return data, info, {SECTION: (0, 0, 0)}
        try:
            out = reencode(data, self.max_side, self.quality)
            new = sniff(memoryview(out))
        except Exception:  # undecodable pixels: kept as they are; decode reports the sample
            return data, info, {SECTION: (0, 0, 0)}
        return out, new, {SECTION: (info.height, info.width, len(data))}

    def sections(self, columns: dict, k: int) -> dict[str, np.ndarray]:
        return {ARGS: np.array([self.max_side, self.quality], dtype="<i8")}
