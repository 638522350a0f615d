"""Targets beyond int labels, stored in the file format, and boxes/points that follow the geometry.

Two named optional sections of the store (docs/reference/format.md):
- ``targets``: float32 (N, C), one row per sample: multi-label (multi-hot) or regression targets.
- ``targets_ragged`` float32 (M, K) + ``targets_ragged.offsets`` int64 (N + 1): sample ``i`` owns
  rows ``offsets[i]:offsets[i+1]`` (any number, e.g. boxes ``x0, y0, x1, y1, class``).

A plan (see :mod:`gpucache.transforms`) is crop1 -> resize -> crop2 -> flip. Coordinates are
continuous pixel coordinates of the decoded image (EXIF orientation applied): pixel ``(r, c)``
covers ``[c, c+1) x [r, r+1)``, so a box ``(x0, y0, x1, y1)`` with integer corners covers whole
pixels. Resizing scales these coordinates exactly (``align_corners=False``, as the resize does).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import numpy.typing as npt
import torch

from .._plan import OUT_SIZE, PLAN_WIDTH

if TYPE_CHECKING:
    from ._store import JpegCache

DENSE, RAGGED, OFFSETS = "targets", "targets_ragged", "targets_ragged.offsets"

#: Coordinates in and out: numpy or torch, the same kind out as in.
_Coords = TypeVar("_Coords", np.ndarray, torch.Tensor)
#: A plan's 11 numbers (see gpucache.transforms.PLAN_FIELDS).
Plan = np.ndarray | torch.Tensor | Sequence[float]


def with_targets(
    cache: JpegCache,
    *,
    targets: npt.ArrayLike | None = None,
    ragged: Sequence[npt.ArrayLike] | None = None,
    per_input: bool = False,
) -> JpegCache:
    """A new in-memory store: ``cache`` with float targets and/or ragged per-sample arrays.

    ``targets``: (N, C) numbers (multi-hot rows, regression values). ``ragged``: N arrays of
    shape (K_i, C) (or (K_i,)), the same C for all, K_i >= 0. Rows follow the store's samples;
    with ``per_input=True`` they follow the build's inputs instead and the rows of inputs the
    build skipped (``cache.report``) are dropped. ``save()`` / ``share()`` carry them."""
    n = len(cache)
    keep = None
    if per_input:
        report = cache.report
        if report is None:
            raise ValueError(
                "per_input=True needs a freshly built store (its build report "
                "says which inputs were skipped)."
            )
        keep = np.ones(report.total, dtype=bool)
        keep[[s.index for s in report.skipped]] = False
    extra = {k: v for k, v in cache.extra.items() if k not in (DENSE, RAGGED, OFFSETS)}
    if targets is not None:
        t = np.asarray(targets, dtype=np.float32)
        t = t[:, None] if t.ndim == 1 else t
        t = t[keep] if keep is not None and len(t) == len(keep) else t
        if t.ndim != 2 or len(t) != n:
            raise ValueError(
                f"targets must be (N, C) with N = {n} samples"
                f"{' (or one row per build input)' if per_input else ''}; got "
                f"shape {np.shape(targets)}."
            )
        extra[DENSE] = np.ascontiguousarray(t)
    if ragged is not None:
        rows = list(ragged)
        if keep is not None and len(rows) == len(keep):
            rows = [r for r, k in zip(rows, keep) if k]
        if len(rows) != n:
            raise ValueError(f"ragged must hold one array per sample ({n}), got {len(rows)}.")
        arrs = [np.asarray(r, dtype=np.float32) for r in rows]
        arrs = [a.reshape(-1, 1) if a.ndim == 1 else a for a in arrs]  # (K_i,) -> (K_i, 1)
        if any(a.ndim != 2 for a in arrs):
            raise ValueError("each ragged entry must be a (K_i, C) or (K_i,) array.")
        widths = {a.shape[1] for a in arrs if len(a)}
        if len(widths) > 1:
            raise ValueError(
                f"ragged arrays must share their row width (e.g. 5 for x0, y0, x1, "
                f"y1, class); got widths {sorted(widths)}."
            )
        width = widths.pop() if widths else 0
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum([len(a) for a in arrs], out=offsets[1:])
        values = np.zeros((int(offsets[-1]), width), dtype=np.float32)
        for a, lo in zip(arrs, offsets[:-1].tolist()):
            values[lo : lo + len(a)] = a
        extra[RAGGED], extra[OFFSETS] = values, offsets
    return cache._replace(extra=extra)


def dense_targets(cache: JpegCache) -> np.ndarray | None:
    """The store's (N, C) float32 targets, or None."""
    return cache.extra.get(DENSE)


def ragged_targets(cache: JpegCache, indices: npt.ArrayLike) -> list[np.ndarray] | None:
    """Each listed sample's (K_i, C) ragged array (read-only views), or None without any."""
    values, offsets = cache.extra.get(RAGGED), cache.extra.get(OFFSETS)
    if values is None or offsets is None:
        return None
    return [values[offsets[i] : offsets[i + 1]] for i in np.asarray(indices).tolist()]


def kept_rows(submitted: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """Rows of a submitted batch that a decoded batch kept (failed samples are left out, order
    kept; an index may repeat in a batch)."""
    rows, j = [], 0
    for r, i in enumerate(submitted.tolist()):
        if j < len(kept) and kept[j] == i:
            rows.append(r)
            j += 1
    return np.asarray(rows, dtype=np.int64)


def _plan(plan: Plan) -> list[float]:
    p = plan.tolist() if hasattr(plan, "tolist") else list(plan)
    if len(p) != PLAN_WIDTH:
        raise ValueError(
            f"a plan has {PLAN_WIDTH} numbers (see gpucache.transforms.PLAN_FIELDS), got {p}"
        )
    return [float(v) for v in p]


def map_points(points: _Coords, plan: Plan) -> _Coords:
    """Map (K, 2) ``x, y`` points of the decoded image into the output image of ``plan``."""
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
