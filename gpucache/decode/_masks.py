"""Masks through a sample's geometric plan: decoded beside their image, moved by nearest neighbour.

A stored mask is in its image's displayed orientation and has its size (``store/_masks.py``), so
a sample's plan (crop1 -> resize -> crop2 -> flip, :mod:`gpucache.transforms`) applies to it as
drawn. The whole plan is one gather per axis: output row ``y`` reads resized row ``r = t2 + y``,
which reads mask row ``t1 + ((2r + 1) * h1) // (2 * rh)`` (the nearest source pixel centre,
computed in integers so every backend picks the same one), and likewise for columns, mirrored
when the plan flips. A row or column outside the resized image (a plan that pads: CenterCrop on
a small image, :class:`~gpucache.transforms.Letterbox`, :class:`~gpucache.transforms.Pad`) gets
the fill value (the loader's ``mask_fill``, 255 by default). Values are never blended.

PNG masks are decoded with torchvision's ``decode_png`` (libpng; palette PNGs give their
indices), as fast as PIL or faster: ``decode_png(data, ImageReadMode.UNCHANGED)`` against
``np.asarray(Image.open(...))``, one thread, 2026-12-06, 2 cores under load 2.6: 375 x 500
generated masks with six class blocks, 8-bit 0.23 against 0.34 ms, palette 0.20 against 0.22 ms,
16-bit 0.39 against 0.59 ms; the 396 lesion masks of ``benchmarks/segmentation.py`` (0.2
megapixels on average) 0.41 ms each way. A PNG it decodes to more than one channel goes through
PIL (:func:`gpucache.ingest._masks.decode_mask`). Masks come out uint8 for a store whose masks
are all 8-bit (``L``, ``P``) and int32 when any is 16-bit (``I;16``), so a batch has one dtype.

:func:`apply_mask_plan` does one sample (the cpu workers); :func:`gather_masks` does a batch in
a constant number of torch ops on any device (the GPU backends, and CI on CPU tensors); both
read the same indices, so they agree exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, overload

import numpy as np
import torch

from ..base._plan import Col
from ..ingest._masks import decode_mask
from ..store._masks import MaskKind, Masks
from ..store._png import check_stored, torchvision_reads
from ..store._store import Store
from ..transforms._device import to_device
from ._jpeg import quiet_torchvision_deprecation
from ._options import DecodeOptions


def warm() -> None:
    """Import the PNG decoder here (1.4 s: torchvision.io brings sympy): called before the cpu
    workers start, so forked workers inherit it instead of each paying it on its first mask."""
    import torchvision.io  # noqa: F401


def mask_dtype(masks: Masks) -> torch.dtype:
    """The dtype of a store's mask batches: int32 when any mask is 16-bit, else uint8."""
    return torch.int32 if bool((masks.kinds == int(MaskKind.I16)).any()) else torch.uint8


def check_fill(fill: int, dtype: torch.dtype) -> None:
    """A ``mask_fill`` that ``dtype`` holds, or a ValueError with the range."""
    top = 255 if dtype == torch.uint8 else 2**31 - 1
    low = 0 if dtype == torch.uint8 else -(2**31)
    if isinstance(fill, bool) or not isinstance(fill, int) or not low <= fill <= top:
        raise ValueError(
            f"mask_fill must be an integer in [{low}, {top}] for this store's "
            f"{str(dtype).removeprefix('torch.')} masks, got {fill!r}"
        )


def decode_one(cache: Store, i: int, dtype: torch.dtype) -> torch.Tensor:
    """Sample ``i``'s mask as an (H, W) tensor of ``dtype``."""
    from torchvision.io import ImageReadMode, decode_png

    masks = cache.masks
    assert masks is not None, "only a store with masks has a mask to decode"
    expected = (int(masks.heights[i]), int(masks.widths[i]))
    # a record that lies, or a damaged PNG, is refused before any pixel decodes
    check_stored(masks[i], int(masks.kinds[i]), *expected)
    quiet_torchvision_deprecation()
    x = None
    try:
        if torchvision_reads(masks[i]):  # not 1-, 2- or 4-bit palettes, read by PIL below
            x = decode_png(masks._bytes_tensor(i), ImageReadMode.UNCHANGED)
    except RuntimeError:
        x = None
    if x is None or x.shape[0] != 1:  # not one channel here: PIL's reading is the reference
        m = torch.from_numpy(
            decode_mask(masks[i]).astype(np.int32 if dtype != torch.uint8 else np.uint8)
        )
        x = m[None]
    if tuple(x.shape[1:]) != expected:
        raise ValueError(f"its mask decoded at {tuple(x.shape[1:])}, the store says {expected}")
    if dtype == torch.uint8 and x.dtype != torch.uint8:  # never cut values to 8 bits
        raise ValueError(f"its mask decoded as {x.dtype}, the store records 8-bit masks only")
    return x[0] if x.dtype == dtype else x[0].to(dtype)


def plan_indices(
    plans: torch.Tensor, h2: int, w2: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For plans (N, 11) int64 of one output size: the source rows (N, h2) and columns (N, w2)
    each output pixel reads (clamped into the mask) and whether each row and column lies inside
    the resized image (False: padding). A constant number of ops on the plans' device."""
    p = plans
    y = torch.arange(h2, device=p.device)[None]
    x = torch.arange(w2, device=p.device)[None]
    flip = p[:, Col.FLIP, None] != 0
    x = torch.where(flip, p[:, Col.WIDTH2, None] - 1 - x, x)
    r = p[:, Col.TOP2, None] + y
    c = p[:, Col.LEFT2, None] + x
    rh, rw = p[:, Col.RH, None], p[:, Col.RW, None]
    ok_r, ok_c = (r >= 0) & (r < rh), (c >= 0) & (c < rw)
    r, c = torch.minimum(r.clamp(min=0), rh - 1), torch.minimum(c.clamp(min=0), rw - 1)
    rows = p[:, Col.TOP1, None] + torch.div(
        (2 * r + 1) * p[:, Col.HEIGHT1, None], 2 * rh, rounding_mode="floor"
    )
    cols = p[:, Col.LEFT1, None] + torch.div(
        (2 * c + 1) * p[:, Col.WIDTH1, None], 2 * rw, rounding_mode="floor"
    )
    return rows, cols, ok_r, ok_c


def _axis(
    first: int, size: int, resized: int, start: int, n: int, flip: int
) -> tuple[np.ndarray, np.ndarray]:
    """One axis of :func:`plan_indices` for one sample, in numpy (a per-sample call costs a
    few microseconds, where torch's small ops cost 0.3 ms): source indices and inside flags."""
    out = np.arange(n, dtype=np.int64)
    if flip:
        out = n - 1 - out
    r = start + out
    ok = (r >= 0) & (r < resized)
    r = np.clip(r, 0, resized - 1)
    return first + ((2 * r + 1) * size) // (2 * resized), ok


def apply_mask_plan(mask: torch.Tensor, plan: Sequence[int], fill: int) -> torch.Tensor:
    """One (H, W) mask through one plan: the (height2, width2) mask aligned with its image
    (the same indices as :func:`plan_indices`, computed in numpy)."""
    t1, l1, h1, w1, rh, rw, t2, l2, h2, w2, flip = (int(v) for v in plan)
    rows, ok_r = _axis(t1, h1, rh, t2, h2, 0)
    cols, ok_c = _axis(l1, w1, rw, l2, w2, flip)
    a = mask.numpy()
    out = a.take(rows.clip(0, a.shape[0] - 1), 0).take(cols.clip(0, a.shape[1] - 1), 1)
    if not (ok_r.all() and ok_c.all()):
        out[~ok_r] = fill
        out[:, ~ok_c] = fill
    return torch.from_numpy(out)


def gather_masks(
    padded: torch.Tensor, plans: torch.Tensor, fill: int, *, size: tuple[int, int]
) -> torch.Tensor:
    """A fixed-size batch of masks through their plans on ``padded``'s device: ``padded`` is
    (N, Hmax, Wmax), mask ``k`` in its top-left corner; ``plans`` (N, 11) int64 on the same
    device, all of the output ``size`` (height, width), which the caller reads from its host
    plans: reading it from ``plans`` would make the host wait for the device. One gather and
    one select, whatever N."""
    n = len(plans)
    if n == 0:
        return padded[:0, :0, :0]
    h2, w2 = size
    rows, cols, ok_r, ok_c = plan_indices(plans, h2, w2)
    rows = rows.clamp(0, padded.shape[1] - 1)
    cols = cols.clamp(0, padded.shape[2] - 1)
    k = torch.arange(n, device=padded.device)[:, None, None]
    out = padded[k, rows[:, :, None], cols[:, None, :]]
    ok = ok_r[:, :, None] & ok_c[:, None, :]
    return torch.where(ok, out, torch.full((), fill, dtype=out.dtype, device=out.device))


@overload
def fill_padding(images: torch.Tensor, plans: np.ndarray, fill: int) -> torch.Tensor: ...
@overload
def fill_padding(
    images: list[torch.Tensor], plans: np.ndarray, fill: int
) -> list[torch.Tensor]: ...
def fill_padding(
    images: torch.Tensor | list[torch.Tensor], plans: np.ndarray, fill: int
) -> torch.Tensor | list[torch.Tensor]:
    """``images`` (uint8, as the batched resize made them, with zero padding) with ``fill``
    where their plans pad: the rows and columns :func:`plan_indices` finds outside the resized
    image. A constant number of ops for a batch tensor, on its device; the GPU backends run it
    on their batched resize's output. The plans cross to the device in a pinned
    ``non_blocking`` copy: the calling thread never waits for the device."""
    if not fill or not len(plans):
        return images
    p = np.ascontiguousarray(plans, dtype=np.int64)
    if isinstance(images, torch.Tensor):
        h2, w2 = images.shape[-2:]
        return _fill(images, to_device(torch.from_numpy(p), images.device), h2, w2, fill)
    out = []
    for k, x in enumerate(images):
        h2, w2 = x.shape[-2:]
        on = to_device(torch.from_numpy(p[k : k + 1]), x.device)
        out.append(_fill(x[None], on, h2, w2, fill)[0])
    return out


def _fill(x: torch.Tensor, plans: torch.Tensor, h2: int, w2: int, fill: int) -> torch.Tensor:
    _, _, ok_r, ok_c = plan_indices(plans, h2, w2)
    ok = (ok_r[:, :, None] & ok_c[:, None, :])[:, None]
    return torch.where(ok, x, torch.full((), fill, dtype=x.dtype, device=x.device))


class MaskOptions(NamedTuple):
    """What :func:`decode_batch` needs to bring masks along (from :class:`DecodeOptions`)."""

    fill: int  # mask value where a plan pads
    dtype: torch.dtype

    @classmethod
    def of(cls, options: DecodeOptions) -> MaskOptions | None:
        if not options.masks:
            return None
        return cls(options.mask_fill, getattr(torch, options.mask_dtype))

    def apply(
        self, cache: Store, i: int, plan: Sequence[int], size: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """Sample ``i``'s mask through ``plan``; ``size``: the image's size in the decoded tier,
        to which the mask is first resized (nearest neighbour, the image's scale)."""
        mask = decode_one(cache, i, self.dtype)
        if size is not None and tuple(mask.shape) != size:
            h, w = mask.shape
            scaled = [0, 0, h, w, size[0], size[1], 0, 0, size[0], size[1], 0]
            mask = apply_mask_plan(mask, scaled, self.fill)
        return apply_mask_plan(mask, plan, self.fill)
