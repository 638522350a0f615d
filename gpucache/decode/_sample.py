"""One sample decoded on the CPU: libjpeg-turbo for JPEG, PIL for the other formats; a JPEG whose
plan crops is decoded only inside the crop box (:mod:`._roi`, :mod:`._roi_rst`; same pixels),
with ``exact=False`` at a reduced DCT scale when the plan shrinks the box enough (:mod:`._scaled`;
close to, not the same as, the exact pixels; docs/guides/backends.md). libjpeg's warnings about
corrupt data come back per sample (:func:`._roi.take_warning`)."""

from __future__ import annotations

import io
from typing import NamedTuple

import numpy as np
import torch

from ..base._plan import BOX1
from ..ingest._pixels import eight_bit
from ..ingest._sniff import JPEG_KINDS, Kind
from ..store._limits import check_pixels
from ..store._store import Store
from . import _roi, _roi_rst
from ._jpeg import decode_jpeg
from ._outcome import check_size

ROI_KINDS = (Kind.JPEG, Kind.JPEG_PROGRESSIVE)  # not arithmetic-coded


def decode_pil(data: np.ndarray) -> torch.Tensor:
    """PNG, GIF (first frame), WebP, BMP, TIFF, PNM -> RGB uint8 CHW, EXIF orientation applied,
    16-bit samples scaled to 8 bits (:func:`gpucache.ingest._pixels.eight_bit`)."""
    from PIL import Image, ImageOps

    # numpy's stubs give ndarray the buffer protocol only from Python 3.12 on (numpy#26783)
    with Image.open(io.BytesIO(data)) as im:  # type: ignore[arg-type]
        rgb = eight_bit(ImageOps.exif_transpose(im)).convert("RGB")
    return torch.from_numpy(np.asarray(rgb).copy()).permute(2, 0, 1)


def decode_sample(cache: Store, i: int) -> torch.Tensor:
    """Sample ``i`` of ``cache`` as RGB uint8 CHW (refused before decoding if over the pixel budget)."""
    check_pixels(cache, i)
    return _decode_full(cache, i, cache.samples["kind"][i])


def _decode_full(cache: Store, i: int, kind: int) -> torch.Tensor:
    """Sample ``i`` decoded in full (libjpeg-turbo for JPEG, PIL otherwise); budget not checked."""
    if kind in JPEG_KINDS:
        return decode_jpeg(cache._bytes_tensor(i))
    return decode_pil(cache[i])


class Record(NamedTuple):
    """What decoding one sample needs of its store record (read once a batch, as Python ints)."""

    i: int  # store index
    kind: int
    components: int
    precision: int
    orientation: int
    height: int
    width: int
    restart: int  # restart interval in MCUs (0: none)


def decode_box(
    cache: Store,
    s: Record,
    plan: list[int],
    regions: dict[int, _roi.Region | None],
    denom: int,
    mismatched: list[tuple[int, str]],
) -> tuple[torch.Tensor, bool, int]:
    """Sample ``s.i`` cropped to the plan's first crop box; True if only the box was decoded;
    the DCT scale denominator it was decoded at. A sample whose bytes do not match its restart
    interval (``s.restart``) is decoded without it and noted in ``mismatched``.

    With ``denom`` > 1 (``exact=False``, :func:`._scaled.fast_plan`) the box is decoded at
    1/``denom`` DCT scale (compiled decoder only), so the result is smaller than the box."""
    i, height, width = s.i, s.height, s.width
    t1, l1, h1, w1 = plan[BOX1]
    box = (t1, l1, h1, w1)
    region = regions.get(s.components)
    if (
        region is not None
        and s.kind in ROI_KINDS
        and s.precision == 8
        and 0 <= t1
        and 0 <= l1
        and t1 + h1 <= height
        and l1 + w1 <= width
    ):
        denom = denom if region is _roi._c_region else 1
        image = _roi.Oriented(height, width, s.orientation)
        whole = (h1, w1) == (height, width)
        if whole and denom == 1:  # no crop: whole, but through the compiled decoder,
            if region is not _roi._c_region:  # which reports libjpeg's warnings per sample
                return _decode_full(cache, i, s.kind), False, 1
            return _roi.decode_crop(cache[i], (0, 0, height, width), image, region=region), False, 1
        try:
            x = None
            if s.restart:
                try:
                    x = _roi_rst.decode_crop(
                        cache[i], s.restart, box, image, region=region, denom=denom
                    )
                except _roi_rst.IntervalMismatch as err:  # decoded as a plain store would
                    why = _roi_rst.mismatch_reason(s.restart, err)
                    mismatched.append((i, f"sample {i} ({cache.paths[i]}): {why}"))
            if x is None:
                x = _roi.decode_crop(cache[i], box, image, region=region, denom=denom)
        except _roi.ScaleRefused:  # sampling factors it does not scale: the exact path
            if mismatched and mismatched[-1][0] == i:
                s = s._replace(restart=0)
            return decode_box(cache, s, plan, regions, 1, mismatched)
        return x, not whole, denom
    img = check_size(cache, i, _decode_full(cache, i, s.kind))
    return img[:, t1 : t1 + h1, l1 : l1 + w1], False, 1
