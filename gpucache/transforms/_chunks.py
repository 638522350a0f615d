"""How the batched transforms cut a batch, and the one work buffer they keep.

:func:`gpucache.transforms._resample.resample` pads every image of a chunk to the chunk's largest
crop box, so a batch run as one chunk costs the arithmetic and memory of its largest photo times the
batch size. Here the host sorts the batch's first crop boxes by area and cuts it (NumPy, no device
work) where

- the padded products would cost more than ``1 + PAD_WASTE`` times the images' own (by
  :func:`flops`), so the share of useful arithmetic stays at least ``1 / (1 + PAD_WASTE)`` in every
  chunk; the number of chunks grows with the spread of box sizes, not with the batch size; or
- the chunk's buffers (:func:`chunk_bytes`: joined images, padded batch in uint8 and float32,
  both filter matrices, the intermediate and output products, the taps and addresses) and the
  batch's output would pass ``BUDGET_BYTES``.

A chunk of one image whose buffers alone pass the budget runs its crop box in bands of rows (each
band gathered and multiplied in turn, the products accumulated), so no photo the pixel budget
admits makes the stage hold more than the budget but for its filter matrices and products, which
grow with the box's sides, not its area.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..base._plan import Col

#: Device memory the batched transforms hold at once, every buffer of the stage counted (joined
#: images, padded crops, filter matrices, products, taps, addresses and the batch's uint8 output):
#: 256 MiB. Where a batch's output alone passes half of it, its chunks still get half.
BUDGET_BYTES = 256 << 20
#: Padded arithmetic a chunk may add beyond its images' own, as a share of theirs: 1.0 keeps at
#: least half of every chunk's matrix products useful.
PAD_WASTE = 1.0


def flops(n: Any, hc: Any, wc: Any, oh: int, ow: int) -> Any:
    """Floating-point operations of the two matrix products for ``n`` images padded to an
    ``hc`` x ``wc`` box, resized to ``oh`` x ``ow`` (3 channels): ``A @ X`` then ``@ Bᵀ``
    (ints or NumPy arrays of them)."""
    return 6 * n * oh * wc * (hc + ow)


def chunk_bytes(
    n: int,
    box: tuple[int, int],
    out: tuple[int, int],
    taps: int,
    flat: int,
    band: int | None = None,
) -> int:
    """Device bytes a chunk of ``n`` images padded to the ``box`` (hc, wc), resized to ``out``
    (oh, ow), holds: ``flat`` bytes of joined images, the gathered box in uint8 and float32
    (``band`` rows of it at a time; the second product and the uint8 result reuse that memory),
    both filter matrices, the first product, the filter taps (``taps`` a window, with their
    temporaries) and the row addresses."""
    (hc, wc), (oh, ow) = box, out
    band = hc if band is None else band
    return (
        flat
        + 5 * max(3 * n * band * wc, 3 * n * oh * ow)
        + 4 * n * (oh * hc + ow * wc + 3 * oh * wc)
        + 40 * n * max(oh, ow) * taps
        + 24 * n * hc
    )


def batch_bytes(n: int, hc: int, wc: int, oh: int, ow: int) -> int:
    """Device bytes a batch holds beside its chunks: its uint8 output and the gather's row and
    column addresses over its largest box (with their temporaries)."""
    return 3 * n * oh * ow + 24 * n * (hc + wc)


@dataclass
class Chunk:
    """Positions of the batch in one chunk, its padded box and the rows gathered at a time."""

    rows: np.ndarray
    box: tuple[int, int]
    band: int


def plan_chunks(
    plans: np.ndarray, image_elems: np.ndarray, budget: int = BUDGET_BYTES
) -> list[Chunk]:
    """The chunks of a batch of ``plans`` (N, 11) whose images hold ``image_elems`` uint8 values
    each: boxes sorted by area (stable), cut greedily where the padding or the memory bound
    would be passed (module doc)."""
    n = len(plans)
    oh, ow = int(plans[0, Col.HEIGHT2]), int(plans[0, Col.WIDTH2])
    out_size = (oh, ow)
    h1, w1 = plans[:, Col.HEIGHT1].astype(np.int64), plans[:, Col.WIDTH1].astype(np.int64)
    rh, rw = np.maximum(plans[:, Col.RH], 1), np.maximum(plans[:, Col.RW], 1)
    support = np.maximum(np.maximum(h1 / rh, w1 / rw), 1.0)
    taps = (np.ceil(2 * support) + 1).astype(np.int64)
    useful = flops(1, h1, w1, oh, ow)
    fixed = batch_bytes(n, int(h1.max()), int(w1.max()), oh, ow)
    room = max(budget - fixed, budget // 2)  # what the chunks may hold
    order = np.argsort(h1 * w1, kind="stable")
    cuts, start = [0], 0
    hc = wc = k = flat = big = 0
    work = 0
    boxes = zip(h1[order].tolist(), w1[order].tolist())
    sizes = zip(image_elems[order].tolist(), taps[order].tolist(), useful[order].tolist())
    for pos, ((h, w), (e, t, u)) in enumerate(zip(boxes, sizes)):
        nh, nw, nk, nbig = max(hc, h), max(wc, w), max(k, t), max(big, e)
        m = pos + 1 - start
        if m > 1 and (
            flops(m, nh, nw, oh, ow) > (1 + PAD_WASTE) * (work + u)
            or chunk_bytes(m, (nh, nw), out_size, nk, flat + e + nbig) > room
        ):
            cuts.append(pos)
            start, nh, nw, nk, nbig, flat, work = pos, h, w, t, e, 0, 0
        hc, wc, k, big = nh, nw, nk, nbig
        flat, work = flat + e, work + u
    cuts.append(n)
    out = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        rows = order[a:b].astype(np.int64)
        box = (int(h1[rows].max()), int(w1[rows].max()))
        band = box[0]
        m, k = len(rows), int(taps[rows].max())
        flat = 0 if m == 1 else int(image_elems[rows].sum() + image_elems[rows].max())
        if chunk_bytes(m, box, out_size, k, flat) > room:  # one image: its rows in bands
            fixed = chunk_bytes(m, box, out_size, k, flat, band=0)
            band = int(np.clip((room - fixed) // (15 * m * box[1]), 1, box[0]))
        out.append(Chunk(rows, box, band))
    return out[::-1]  # the largest first: the work buffer grows once, at the first chunk


class Scratch:
    """The work buffer of a batch's intermediates, kept across batches so that batches of varying
    crop sizes reuse one block instead of asking the caching allocator for new sizes each time.

    It grows to what a batch asks (at least doubling, up to ``limit``), and gives its block back
    (to the caching allocator, for the rest of the program) once ``window`` takes in a row have
    needed at most half of it, shrinking to the largest of them. A take over ``limit`` gets a
    buffer of its own that is not kept. Use it from one stream only: the batches that share it
    run in order."""

    def __init__(self, limit: int = BUDGET_BYTES, window: int = 16) -> None:
        self.limit, self.window = limit, window
        self._buffer: torch.Tensor | None = None
        self._recent: list[int] = []

    @property
    def nbytes(self) -> int:
        """Bytes held between batches."""
        return 0 if self._buffer is None else self._buffer.numel()

    def take(
        self, specs: Sequence[tuple[tuple[int, ...], torch.dtype]], device: torch.device
    ) -> list[torch.Tensor]:
        """Disjoint views of the buffer, one of each (shape, dtype), uninitialised."""
        sizes = [int(np.prod(shape)) * dtype.itemsize for shape, dtype in specs]
        spans = [(size + 63) // 64 * 64 for size in sizes]  # every view 64-byte aligned
        need = sum(spans)
        self._recent = [*self._recent[-(self.window - 1) :], need]
        buffer = self._buffer
        if buffer is not None and buffer.device != device:
            buffer = self._buffer = None
        if need > self.limit:
            buffer = torch.empty(need, dtype=torch.uint8, device=device)  # not kept
        elif buffer is None or buffer.numel() < need:
            grown = max(need, min(2 * self.nbytes, self.limit))
            self._buffer = None  # the old block goes back before the new one is asked for
            buffer = self._buffer = torch.empty(grown, dtype=torch.uint8, device=device)
        elif len(self._recent) == self.window and 2 * max(self._recent) <= buffer.numel():
            self._buffer = None
            buffer = self._buffer = torch.empty(max(self._recent), dtype=torch.uint8, device=device)
        out, offset = [], 0
        for (shape, dtype), size, span in zip(specs, sizes, spans):
            out.append(buffer[offset : offset + size].view(dtype).view(shape))
            offset += span
        return out
