"""Boxes and points through a sample's geometric plan: the geometry the pixels go through.

A plan (see :mod:`gpucache.transforms`) is crop1 -> resize -> crop2 -> flip. Coordinates are
continuous pixel coordinates of the decoded image (EXIF orientation applied): pixel ``(r, c)``
covers ``[c, c+1) x [r, r+1)``, so a box ``(x0, y0, x1, y1)`` with integer corners covers whole
pixels. Resizing scales these coordinates exactly (``align_corners=False``, as the resize does).
The store keeps the boxes themselves (ragged targets, :mod:`gpucache.store._targets`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import numpy as np
import torch

from ..base._plan import OUT_SIZE, PLAN_WIDTH

__all__ = ["map_points", "map_boxes"]

#: Coordinates in and out: numpy or torch, the same kind out as in.
_Coords = TypeVar("_Coords", np.ndarray, torch.Tensor)
#: A plan's 11 numbers (see gpucache.transforms.PLAN_FIELDS).
Plan = np.ndarray | torch.Tensor | Sequence[float]


def _plan(plan: Plan) -> list[float]:
    p = plan.tolist() if hasattr(plan, "tolist") else list(plan)
    if len(p) != PLAN_WIDTH:
        raise ValueError(
            f"a plan has {PLAN_WIDTH} numbers (see gpucache.transforms.PLAN_FIELDS), got {p}"
        )
    return [float(v) for v in p]


def map_points(points: _Coords, plan: Plan) -> _Coords:
    """Map (K, 2) ``x, y`` points of the decoded image into the output image of ``plan``."""
    # unpacked in the order of gpucache.base._plan.Col
    t1, l1, h1, w1, rh, rw, t2, l2, h2, w2, flip = _plan(plan)
    xp = torch if isinstance(points, torch.Tensor) else np
    pts = points.double() if isinstance(points, torch.Tensor) else points.astype(np.float64)
    x = (pts[..., 0] - l1) * (rw / w1) - l2
    y = (pts[..., 1] - t1) * (rh / h1) - t2
    if flip:
        x = w2 - x
    out: _Coords = xp.stack([x, y], -1)
    return out


def map_boxes(boxes: _Coords, plan: Plan, *, clip: bool = True) -> _Coords:
    """Map (K, 4) ``x0, y0, x1, y1`` boxes of the decoded image into the output image of ``plan``
    (crop, resize, flip). ``clip`` clips them to the output; a box that ends up outside has zero
    area (filter with ``(b[:, 2] > b[:, 0]) & (b[:, 3] > b[:, 1])``). Numpy or torch in and out."""
    xp = torch if isinstance(boxes, torch.Tensor) else np
    b = boxes.double() if isinstance(boxes, torch.Tensor) else boxes.astype(np.float64)
    lo = map_points(b[..., 0:2], plan)
    hi = map_points(b[..., 2:4], plan)
    x0, x1 = xp.minimum(lo[..., 0], hi[..., 0]), xp.maximum(lo[..., 0], hi[..., 0])
    out: _Coords = xp.stack([x0, lo[..., 1], x1, hi[..., 1]], -1)
    if clip:
        h2, w2 = _plan(plan)[OUT_SIZE]
        limits = [w2, h2, w2, h2]
        for k in range(4):
            out[..., k] = out[..., k].clip(0, limits[k])
    return out
