"""The geometric transforms: each adds to the per-sample plans (crop, resize, crop, flip) from
the samples' sizes and the loader's seeded generator, never seeing a pixel."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

import numpy as np

from ..base._plan import PLAN_WIDTH, Col
from ._transform import Geometric


def identity_plans(heights: np.ndarray, widths: np.ndarray) -> np.ndarray:
    n = len(heights)
    p = np.zeros((n, PLAN_WIDTH), dtype=np.int64)
    p[:, Col.HEIGHT1], p[:, Col.WIDTH1] = heights, widths
    p[:, Col.RH], p[:, Col.RW] = heights, widths
    p[:, Col.HEIGHT2], p[:, Col.WIDTH2] = heights, widths
    return p


def _size2(size: int | Sequence[int]) -> tuple[int, int]:
    if isinstance(size, int):
        return size, size
    if len(size) == 1:
        return size[0], size[0]
    if len(size) != 2:
        raise ValueError(f"size must be an int or (height, width), got {size!r}")
    return int(size[0]), int(size[1])


def _crop(p: np.ndarray, k: int, top: int, left: int, h: int, w: int) -> None:
    """Crop sample k's current output (the crop2 box) to (top, left, h, w) of it."""
    row = p[k]
    if row[Col.FLIP]:  # already flipped: the crop is taken from the mirrored image
        left = int(row[Col.WIDTH2]) - left - w
    no_resize = row[Col.RH] == row[Col.HEIGHT1] and row[Col.RW] == row[Col.WIDTH1]
    no_crop2 = (
        row[Col.TOP2] == 0
        and row[Col.LEFT2] == 0
        and row[Col.HEIGHT2] == row[Col.RH]
        and row[Col.WIDTH2] == row[Col.RW]
    )
    inside = 0 <= top and 0 <= left and top + h <= row[Col.HEIGHT2] and left + w <= row[Col.WIDTH2]
    if no_resize and no_crop2 and inside:
        # no resize and no crop2 yet: fold into crop1, so the decoder can crop before resizing
        row[Col.TOP1] += top
        row[Col.LEFT1] += left
        row[Col.HEIGHT1], row[Col.WIDTH1], row[Col.RH], row[Col.RW] = h, w, h, w
        row[Col.HEIGHT2], row[Col.WIDTH2] = h, w
        return
    row[Col.TOP2] += top
    row[Col.LEFT2] += left
    row[Col.HEIGHT2], row[Col.WIDTH2] = h, w


def _resize(p: np.ndarray, k: int, h: int, w: int) -> None:
    row = p[k]
    crop2 = (row[Col.TOP2], row[Col.LEFT2], row[Col.HEIGHT2], row[Col.WIDTH2])
    if crop2 != (0, 0, row[Col.RH], row[Col.RW]):
        raise ValueError(
            "a resize after a crop of a resized image is not supported; put Resize "
            "before CenterCrop (as in Resize(256) + CenterCrop(224))."
        )
    row[Col.RH], row[Col.RW], row[Col.HEIGHT2], row[Col.WIDTH2] = h, w, h, w


class RandomResizedCrop(Geometric):
    """torchvision's RandomResizedCrop: a random area/aspect crop resized to ``size``."""

    def __init__(
        self,
        size: int | Sequence[int],
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
    ):
        self.size = _size2(size)
        # copied as tuples (a list may be given); pairs, as the signature says
        self.scale = cast(tuple[float, float], tuple(scale))
        self.ratio = cast(tuple[float, float], tuple(ratio))

    def box(self, height: int, width: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
        area = height * width
        log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for _ in range(10):
            target = area * rng.uniform(*self.scale)
            aspect = math.exp(rng.uniform(*log_ratio))
            w = int(round(math.sqrt(target * aspect)))
            h = int(round(math.sqrt(target / aspect)))
            if 0 < w <= width and 0 < h <= height:
                return (
                    int(rng.integers(0, height - h + 1)),
                    int(rng.integers(0, width - w + 1)),
                    h,
                    w,
                )
        in_ratio = width / height  # fallback: central crop, as torchvision does
        if in_ratio < min(self.ratio):
            w, h = width, int(round(width / min(self.ratio)))
        elif in_ratio > max(self.ratio):
            h, w = height, int(round(height * max(self.ratio)))
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def plan(self, p: np.ndarray, rng: np.random.Generator) -> None:
        for k in range(len(p)):
            _crop(p, k, *self.box(int(p[k, Col.HEIGHT2]), int(p[k, Col.WIDTH2]), rng))
            _resize(p, k, *self.size)


class Resize(Geometric):
    """Resize (bilinear, antialiased). An int sets the shorter side, as torchvision does."""

    def __init__(self, size: int | Sequence[int], *, max_size: int | None = None):
        self.size, self.max_size = size, max_size

    def out_size(self, h: int, w: int) -> tuple[int, int]:
        if not isinstance(self.size, int) and len(self.size) == 2:
            return int(self.size[0]), int(self.size[1])
        s = self.size if isinstance(self.size, int) else self.size[0]
        short, long = (h, w) if h <= w else (w, h)
        new_short, new_long = s, int(s * long / short)
        if self.max_size is not None and new_long > self.max_size:
            new_short, new_long = int(self.max_size * new_short / new_long), self.max_size
        return (new_short, new_long) if h <= w else (new_long, new_short)

    def plan(self, p: np.ndarray, rng: np.random.Generator) -> None:
        for k in range(len(p)):
            _resize(p, k, *self.out_size(int(p[k, Col.HEIGHT2]), int(p[k, Col.WIDTH2])))


class CenterCrop(Geometric):
    """Central crop; pads with zeros where the image is smaller, as torchvision does."""

    def __init__(self, size: int | Sequence[int]):
        self.size = _size2(size)

    def plan(self, p: np.ndarray, rng: np.random.Generator) -> None:
        ch, cw = self.size
        for k in range(len(p)):
            h, w = int(p[k, Col.HEIGHT2]), int(p[k, Col.WIDTH2])
            _crop(p, k, int(round((h - ch) / 2.0)), int(round((w - cw) / 2.0)), ch, cw)


class Letterbox(Geometric):
    """Resize keeping the aspect ratio so the image fits in ``size``, then pad it to ``size``,
    centred (a letterbox). Padded pixels get the loader's ``fill`` (images) and ``mask_fill``
    (masks); boxes and points map through it (:func:`map_boxes`)."""

    def __init__(self, size: int | Sequence[int]):
        self.size = _size2(size)

    def plan(self, p: np.ndarray, rng: np.random.Generator) -> None:
        th, tw = self.size
        for k in range(len(p)):
            h, w = int(p[k, Col.HEIGHT2]), int(p[k, Col.WIDTH2])
            scale = min(th / h, tw / w)
            nh, nw = max(1, min(th, round(h * scale))), max(1, min(tw, round(w * scale)))
            _resize(p, k, nh, nw)
            _crop(p, k, -((th - nh) // 2), -((tw - nw) // 2), th, tw)


class Pad(Geometric):
    """Pad each side by ``padding`` pixels: an int (all sides), (left/right, top/bottom) or
    (left, top, right, bottom), as torchvision's ``Pad``. Padded pixels get the loader's
    ``fill`` (images) and ``mask_fill`` (masks)."""

    def __init__(self, padding: int | Sequence[int]):
        pad = [padding] if isinstance(padding, int) else [int(v) for v in padding]
        if len(pad) not in (1, 2, 4) or min(pad) < 0:
            raise ValueError(f"padding must be an int or 2 or 4 non-negative ints, got {padding!r}")
        if len(pad) == 1:
            pad *= 4
        elif len(pad) == 2:
            pad *= 2
        self.padding = tuple(pad)

    def plan(self, p: np.ndarray, rng: np.random.Generator) -> None:
        left, top, right, bottom = self.padding
        for k in range(len(p)):
            h, w = int(p[k, Col.HEIGHT2]), int(p[k, Col.WIDTH2])
            _crop(p, k, -top, -left, h + top + bottom, w + left + right)


class RandomHorizontalFlip(Geometric):
    def __init__(self, p: float = 0.5):
        self.p = p

    def plan(self, plans: np.ndarray, rng: np.random.Generator) -> None:
        plans[:, Col.FLIP] ^= rng.random(len(plans)) < self.p
