"""EXIF orientation: the one table of what each value of the tag does to the stored pixels.

Every path that orients an image or a box reads it here: the CPU decode (whole images, regions,
restart-marker segments, reduced DCT scales), the nvjpeg backend (``orient`` after a decoder that
skips the tag, and the batched resampler that folds it into its addresses), the DALI graph's
per-sample rows. Values outside 1-8 mean 1 (as libjpeg-turbo's decoders and PIL read them).
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["ORIENT", "TABLE", "steps", "steps_of", "orient", "coded_box"]

#: EXIF Orientation (1-8) -> (transpose, flip rows, flip columns), applied in that order to the
#: stored pixels to give the displayed image (TIFF 6.0 / EXIF 2.3 definitions of the tag's values).
ORIENT: dict[int, tuple[bool, bool, bool]] = {
    1: (False, False, False),
    2: (False, False, True),
    3: (False, True, True),
    4: (False, True, False),
    5: (True, False, False),
    6: (True, False, True),
    7: (True, True, True),
    8: (True, True, False),
}

#: ``ORIENT`` as a (9, 3) bool array indexed by the orientation (row 0 is orientation 1's).
TABLE = np.array([ORIENT.get(o, ORIENT[1]) for o in range(9)], dtype=bool)


def steps(orientation: int) -> tuple[bool, bool, bool]:
    """``(transpose, flip rows, flip columns)`` of one orientation (outside 1-8: none)."""
    return ORIENT.get(int(orientation), ORIENT[1])


def steps_of(orientations: np.ndarray) -> np.ndarray:
    """(N, 3) bool: :func:`steps` of each orientation, vectorized."""
    o = np.asarray(orientations, dtype=np.int64)
    return TABLE[np.where((o >= 1) & (o <= 8), o, 1)]


def orient(img: torch.Tensor, orientation: int) -> torch.Tensor:
    """The CHW image as displayed under EXIF ``orientation`` (a view: no copy)."""
    transpose, flip_rows, flip_cols = steps(orientation)
    if transpose:
        img = img.transpose(-1, -2)
    dims = [d for d, on in ((-2, flip_rows), (-1, flip_cols)) if on]
    return img.flip(dims) if dims else img


def coded_box(
    top: int, left: int, h: int, w: int, orientation: int, height: int, width: int
) -> tuple[int, int, int, int]:
    """Map a box on the oriented ``height`` x ``width`` image to the coded (stored) image."""
    transpose, flip_rows, flip_cols = steps(orientation)
    if flip_rows:
        top = height - top - h
    if flip_cols:
        left = width - left - w
    return (left, top, w, h) if transpose else (top, left, h, w)
