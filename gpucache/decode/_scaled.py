"""Plans for ``exact=False``: the DCT scale a JPEG decodes at, and boxes cut on its grid.

A plan (:mod:`gpucache.transforms`) samples output pixel j of an axis at the source position
``t1 + (t2 + j + 0.5) * h1 / rh`` (crop1 at t1, h1 long, resized to rh, crop2 at t2), through
an antialiased bilinear filter that sees only crop1. :func:`fast_plan` gives a plan that samples
within a small fraction of a source pixel of the same positions while decoding less:

- a crop after the resize (``Resize(256)`` + ``CenterCrop(224)``) is cut before it, as FFCV's
  centre-crop decoder does: the box becomes that crop's part of crop1 plus context;
- the box's edges fall on whole pixels of the 1/d grid of the DCT scale it decodes at, with a
  few output pixels of context (taken outside crop1 where its edge is off the grid: the box
  the plan resizes then has that context, where ``exact=True`` has none), so that the scaled
  decode does not move them; where no such edge is near, the edge is crop1's own, and the
  scaled decode rounds it to the nearest scaled pixel (at most d/2 source pixels);
- the scale d (1/2, 1/4, 1/8) is the coarsest at which the box keeps :data:`SCALE_MARGIN`
  scaled pixels per output pixel: libjpeg's scaled IDCT, a sharper low-pass than the
  antialiased resize, differs from it most when the resize after it has little left to do.

None of it is bit-exact; docs/guides/backends.md states the difference measured on photos.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from ..transforms._orientation import steps

#: scaled pixels per output pixel (each way) the box must keep to decode at 1/2, 1/4 or 1/8
SCALE_MARGIN = 2.0
_CONTEXT = 24  # the most output pixels of context an edge looks through for one on the grid
#: the most a box edge may move the samples (output pixels) at a scale; further, the next finer
_MAX_SHIFT = 0.05


def reduced_scale(h1: int, w1: int, rh: int, rw: int) -> int:
    """The largest libjpeg-turbo DCT scale denominator (8, 4, 2; else 1) at which an ``h1`` x
    ``w1`` box still holds :data:`SCALE_MARGIN` x ``rh`` x ``rw`` pixels (plus one each way)."""
    m = SCALE_MARGIN
    for d in (8, 4, 2):
        if h1 >= d * (m * rh + 1) and w1 >= d * (m * rw + 1):
            return d
    return 1


def _edge(
    lo: float, step: float, reach: int, d: int, g: int, size: int, bound: int
) -> tuple[int, int, float]:
    """One side of a box: (k, edge, shift), the box edge ``edge`` (a source pixel) at k output
    pixels of context beyond the crop edge at source position ``lo`` (``step`` source pixels an
    output pixel, negative for the start side); ``reach`` is the k at which the position is
    crop1's edge, and the box must hold source pixel ``bound`` (the last its resize reads).
    The grid's pixels are at ``g`` + multiples of ``d`` (``g`` > 0 where the coded image is
    flipped along this axis: the scaled decode's grid starts at the other end).

    The first k (fewest pixels of context, from 1, or 0 when the crop edge is crop1's) whose
    position lies within 0.05 scaled pixels of the 1/``d`` grid, else the nearest if that is
    within half an output pixel; else crop1's edge (k = ``reach``), where the full resize
    stops too, and also where a position short of it rounds onto it. Positions past ``reach``
    lie outside crop1, inside the image of ``size``. ``shift``: how far (source pixels) the
    edge, once decoded at 1/``d``, is from the position the plan samples."""
    sign = 1 if step > 0 else -1
    image_end = size if step > 0 else 0
    crop1_edge = round(lo + reach * step)
    best = None
    for k in range(0 if reach == 0 else 1, _CONTEXT + 1):
        x = lo + k * step
        if (x - image_end) * sign > 1e-9:  # past the image's edge
            break
        edge = min(max(g + d * round((x - g) / d), 0), size)
        if edge == crop1_edge and k <= reach:  # that very box, sampled exactly
            return reach, crop1_edge, 0.0
        if (edge - bound) * sign < 0:  # short of the pixels the crop's resize reads
            continue
        err = abs(edge - x)
        if err <= 0.05 * d:
            return k, edge, err
        if best is None or err < best[0]:
            best = (err, k, edge)
    snapped = abs(g + d * round((crop1_edge - g) / d) - crop1_edge)  # a scaled decode's move
    if best is None or best[0] > min(0.5 * abs(step), snapped):
        return reach, crop1_edge, snapped
    return best[1], best[2], best[0]


class Axis(NamedTuple):
    """One axis of a plan: crop1 [t1, t1 + h1) of the image, resized to ``r``, then crop2
    [t2, t2 + h2) (its rows, or its columns)."""

    t1: int
    h1: int
    r: int
    t2: int
    h2: int


@functools.lru_cache(maxsize=4096)  # eval plans repeat per image size
def _cut(axis: Axis, size: int, d: int, g: int) -> tuple[int, int, int, int, float]:
    """One axis of :func:`fast_plan`: the plan's ``axis`` of an axis of ``size`` source
    pixels, decoded at 1/``d`` on a grid at ``g`` (:func:`_edge`). Returns the box (start, length),
    (n, offset): the box resized to n holds crop2 at offset, sampled where the plan samples
    it to within a small fraction of a source pixel (:func:`_edge` for each side), and the
    larger of its edges' shifts, in output pixels. The box holds every source pixel crop2's
    resize reads, so it is never empty, even for an image a pixel or two across enlarged many
    times, whose crop would otherwise round to nothing."""
    t1, h1, r, t2, h2 = axis
    s = h1 / r
    support = max(s, 1.0)  # the antialiased bilinear filter's half-width, in source pixels
    first = t1 + max(int((t2 + 0.5) * s - support + 0.5), 0)  # its taps, as torch takes them
    last = t1 + min(int((t2 + h2 - 0.5) * s + support + 0.5), h1)
    o, a, e1 = _edge(t1 + t2 * s, -s, t2, d, g, size, first)
    o2, b, e2 = _edge(t1 + (t2 + h2) * s, s, r - t2 - h2, d, g, size, last)
    return a, b - a, h2 + o + o2, o, max(e1, e2) / s


def fast_plan(
    plan: list[int], height: int, width: int, *, orientation: int = 1, scalable: bool
) -> tuple[list[int], int]:
    """``plan`` for a ``height`` x ``width`` image (as oriented by its EXIF ``orientation``) as
    ``exact=False`` decodes it, and the DCT scale denominator its box decodes at (1 unless
    ``scalable``: the compiled decoder's route). A scale at which a box edge would move the
    samples by more than :data:`_MAX_SHIFT` output pixels (a training box against the image's
    edge, with no context beyond it, off the grid) gives way to the next finer one.

    A plan whose crop2 pads (a crop larger than the resized image) stays as it is."""
    t1, l1, h1, w1, rh, rw, t2, l2, h2, w2, flip = plan
    if min(t2, l2) < 0 or t2 + h2 > rh or l2 + w2 > rw:
        return plan, 1
    d = reduced_scale(round(h2 * h1 / rh), round(w2 * w1 / rw), h2, w2) if scalable else 1
    _, flip_h, flip_w = steps(orientation)
    while True:
        if d == 1 and (t2, l2, h2, w2) == (0, 0, rh, rw):
            return plan, 1  # decoded as it is, exactly
        rows, cols = Axis(t1, h1, rh, t2, h2), Axis(l1, w1, rw, l2, w2)
        top, hb, nh, ot, e1 = _cut(rows, height, d, height % d if flip_h else 0)
        left, wb, nw, ol, e2 = _cut(cols, width, d, width % d if flip_w else 0)
        if d == 1 or max(e1, e2) <= _MAX_SHIFT:
            return [top, left, hb, wb, nh, nw, ot, ol, h2, w2, flip], d
        d //= 2
