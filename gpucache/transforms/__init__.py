"""Batch transforms, split in two kinds.

Geometric transforms (:class:`RandomResizedCrop`, :class:`Resize`, :class:`CenterCrop`,
:class:`RandomHorizontalFlip`, :class:`Letterbox`, :class:`Pad`) never see pixels when they run: from each sample's stored height and
width and the loader's seeded generator they add to a per-sample *plan*, 11 integers::

    crop1 (top, left, height, width) in the decoded image   -> resize to (rh, rw)
    -> crop2 (top, left, height, width) in the resized image -> flip (0/1)

The plan is drawn in the main process, so the same seed gives the same crops whatever the worker
count or backend; each backend then executes it (per sample on the CPU, batched on the GPU).

Batch steps follow the geometry and run on the whole batch, on the output device: pixel ops
(:class:`ToDtype`, :class:`Normalize`, :class:`ColorJitter`, :class:`PerSample`, or any callable
such as a torchvision v2 transform) and ops that also change the labels (:class:`MixUp`,
:class:`CutMix`, :class:`WithLabels`). Random ones draw per sample from a generator seeded by
(seed, epoch, batch).
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar, cast

import numpy as np
import torch

from ..base._plan import PLAN_FIELDS as PLAN_FIELDS  # the plan's columns by name
from ..base._plan import PLAN_WIDTH, Col
from . import _tvcompat
from ._augment import (
    ColorJitter,
    CutMix,
    MixUp,
    PerBatch,
    PerSample,
    WithLabels,
    batch_generator,
    seeded_global_rng,
)
from ._boxes import map_boxes, map_points
from ._device import DeviceConstants
from ._maskops import MapMaskValues

#: A batch's labels through Compose.apply: a tensor from the loader, None from a plain call.
_Labels = TypeVar("_Labels", torch.Tensor, None)


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


class Transform:
    """Base class. Geometric ones implement ``plan``; pixel ones implement ``__call__``."""

    geometric = False

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


class Geometric(Transform):
    geometric = True

    def plan(self, p: np.ndarray, rng: np.random.Generator) -> None:
        """Update the plans ``p`` (n x 11, in place) for samples whose current size is their
        (height2, width2)."""
        raise NotImplementedError


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


class ToDtype(Transform):
    """uint8 batch -> ``dtype`` (scaled to [0, 1] when ``scale``), in the layout asked for.

    ``layout="NHWC"`` gives shape (N, H, W, C); ``"channels_last"`` keeps shape (N, C, H, W) with
    channels-last memory, the format convolutions prefer on recent GPUs.
    """

    def __init__(
        self,
        dtype: torch.dtype = torch.float32,
        *,
        scale: bool = True,
        layout: Literal["NCHW", "NHWC", "channels_last"] = "NCHW",
    ):
        if layout not in ("NCHW", "NHWC", "channels_last"):
            raise ValueError(f"layout must be 'NCHW', 'NHWC' or 'channels_last', got {layout!r}")
        self.dtype, self.scale, self.layout = dtype, scale, layout

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.uint8 and self.dtype.is_floating_point:
            x = x.to(self.dtype)
            if self.scale:
                x = x.mul_(1 / 255)
        else:
            x = x.to(self.dtype)
        return _layout(x, self.layout)


def _layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "NHWC":
        return x.permute(0, 2, 3, 1).contiguous() if x.dim() == 4 else x.permute(1, 2, 0)
    if layout == "channels_last" and x.dim() == 4:
        return x.contiguous(memory_format=torch.channels_last)
    return x


class Normalize(Transform):
    """(x - mean) / std per channel. A uint8 batch is first scaled to [0, 1] in ``dtype``.

    The per-channel constants are made once per device and layout (pinned, ``non_blocking``), so
    a batch costs one fused multiply-add and no host synchronisation."""

    def __init__(
        self,
        mean: Sequence[float],
        std: Sequence[float],
        *,
        dtype: torch.dtype = torch.float32,
        layout: Literal["NCHW", "NHWC", "channels_last"] = "NCHW",
    ):
        self.mean, self.std, self.dtype, self.layout = list(mean), list(std), dtype, layout
        self._constants = DeviceConstants()

    def _affine(self, uint8: bool, nhwc: bool) -> torch.Tensor:
        """(scale, bias), stacked in one tensor, with x * scale + bias == (x / 255 - mean) / std
        (uint8), else without the 1/255; shaped for the layout."""
        mean = torch.tensor(self.mean, dtype=torch.float64)
        std = torch.tensor(self.std, dtype=torch.float64)
        scale = (1 / 255 if uint8 else 1.0) / std
        shape = (-1,) if nhwc else (-1, 1, 1)
        return torch.stack([scale, -mean / std]).float().view(2, *shape)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        scale, bias, x = self._operands(x)
        # one fused multiply-add in float32 (uint8 promoted inside it), then the cast
        out = torch.addcmul(bias, x, scale)
        return _layout(out.to(self.dtype), self.layout)

    def _operands(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        nhwc = x.shape[-1] == len(self.mean) and x.shape[-3] != len(self.mean)
        uint8 = x.dtype == torch.uint8
        both = self._constants.get(x.device, (uint8, nhwc), lambda: self._affine(uint8, nhwc))
        return both[0], both[1], x if uint8 or x.dtype == torch.float32 else x.float()

    def _into(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """``self(x)`` written into ``out`` (float32, NCHW), converted there, then scaled and
        shifted in place: a multiply and an add where ``__call__`` fuses them, so a value may
        differ by one float32 rounding (at most 2.4e-7 for ImageNet's constants), and 2.7x
        faster than the fused multiply-add on uint8 (0.08 against 0.22 ms a 224 x 224 image,
        one core)."""
        scale, bias, x = self._operands(x)
        out.copy_(x).mul_(scale).add_(bias)

    def __repr__(self) -> str:
        return (
            f"Normalize(mean={self.mean!r}, std={self.std!r}, dtype={self.dtype!r}, "
            f"layout={self.layout!r})"
        )


_ACCEPTED = (
    "gpucache.transforms geometric ops (RandomResizedCrop, Resize, CenterCrop, "
    "RandomHorizontalFlip, or torchvision's, which are translated to them) first, then "
    "batch steps: gpucache.transforms pixel ops (ColorJitter, Normalize, ToDtype, "
    "PerSample(...), PerBatch(...)), label-changing ops (MixUp, CutMix, WithLabels(...), "
    "torchvision's v2.MixUp/v2.CutMix) or any callable on the batch (a torchvision v2 "
    "transform or Compose, a function)"
)


def _kind(t: object) -> str:
    """What a Compose item is: 'geometric', 'pixel' (images -> images), 'labels' or 'masks'
    (masks -> masks, :class:`MapMaskValues`)."""
    if getattr(t, "on_masks", False):
        return "masks"
    if isinstance(t, Transform):
        return "geometric" if t.geometric else "pixel"
    if (
        getattr(t, "with_labels", False)
        or type(t).__name__ in ("MixUp", "CutMix")
        and type(t).__module__.startswith("torchvision")
    ):
        return "labels"
    if not callable(t):
        raise TypeError(f"{t!r} ({type(t).__name__}) is not a transform; accepted: {_ACCEPTED}.")
    return "pixel"


def _run(
    t: Callable[..., Any],
    x: torch.Tensor | list[torch.Tensor],
    generator: torch.Generator | None,
) -> torch.Tensor | list[torch.Tensor]:
    """One pixel step on a batch tensor, or on each image of a list (variable sizes)."""
    if isinstance(t, Transform):
        return t(x) if isinstance(x, torch.Tensor) else [t(i[None])[0] for i in x]
    if getattr(t, "random", False):  # gpucache's seeded ops take the generator
        return (
            t(x, generator=generator)
            if isinstance(x, torch.Tensor) or isinstance(t, PerSample)
            else [t(i[None], generator=generator)[0] for i in x]
        )
    device = x.device if isinstance(x, torch.Tensor) else x[0].device
    with seeded_global_rng(generator, device):  # foreign callables draw from torch's global RNG
        return t(x) if isinstance(x, torch.Tensor) else [t(i) for i in x]


class Compose(Transform):
    """Geometric transforms first (any order among them), then batch steps in the order given.

    Batch steps run on the output device after decoding. Random ones draw from the generator the
    loader seeds per (seed, epoch, batch); callables that use torch's global RNG (torchvision's)
    run with the global RNG seeded from it and restored afterwards.

    torchvision pipelines are taken apart first: a torchvision ``Compose`` (v1 or v2, nested too)
    is flattened and its ``RandomResizedCrop``, ``Resize``, ``CenterCrop``,
    ``RandomHorizontalFlip``, ``Normalize`` and ``ToDtype`` become gpucache's own, with a plan per
    sample; options gpucache cannot reproduce are a ``TypeError`` with the fix, and another random
    torchvision op left to run on a whole batch tensor warns (wrap it in :class:`PerSample` or
    :class:`PerBatch`)."""

    # the geometric steps, a list, where a single transform has its class flag (read by _kind,
    # which a Compose never meets: a nested Compose, gpucache's or torchvision's, is flattened)
    geometric: list[Geometric]  # type: ignore[assignment]
    transforms: list[Any]

    def __init__(self, transforms: Sequence[Any]):
        flat: list[Any] = []
        for t in transforms:
            flat += t.transforms if isinstance(t, Compose) else [t]
        self.transforms = _tvcompat.translate(flat)
        kinds = [_kind(t) for t in self.transforms]
        before_kinds: list[str | None] = [None, *kinds[:-1]]
        for t, k, before in zip(self.transforms, kinds, before_kinds):
            if k == "geometric" and before not in (None, "geometric"):
                raise ValueError(
                    f"{t!r} comes after a pixel transform; put geometric transforms "
                    "(crops, resizes, flips) before ToDtype/Normalize and other "
                    "batch steps."
                )
        self.geometric = [t for t, k in zip(self.transforms, kinds) if k == "geometric"]
        self.steps = [(k, t) for t, k in zip(self.transforms, kinds) if k != "geometric"]
        self.pixel = [t for k, t in self.steps if k == "pixel"]
        if self.fixed_size:  # a variable-size batch runs each pixel step per image
            _tvcompat.warn_batch_draws(self.steps)

    def plan(self, heights: np.ndarray, widths: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        p = identity_plans(heights, widths)
        for t in self.geometric:
            t.plan(p, rng)
        return p

    @property
    def fixed_size(self) -> bool:
        """True when every sample comes out at one size, so a batch can be one tensor."""
        fixed = False
        for t in self.geometric:
            if isinstance(t, (RandomResizedCrop, CenterCrop, Letterbox)):
                fixed = True
            elif isinstance(t, Resize):
                fixed = not isinstance(t.size, int) and len(t.size) == 2
        return fixed

    @property
    def changes_labels(self) -> bool:
        return any(k == "labels" for k, _ in self.steps)

    def apply(
        self,
        images: torch.Tensor | list[torch.Tensor],
        labels: _Labels,
        *,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor | list[torch.Tensor], _Labels]:
        """Run the batch steps: ``(images, labels)`` in, ``(images, labels)`` out."""
        return apply_steps(self.steps, images, labels, generator)

    def per_sample_steps(self) -> int:
        """How many of the first batch steps act on each sample alone and may run where the
        sample was decoded (a CPU worker): :func:`per_sample_prefix` of :attr:`steps`."""
        return per_sample_prefix([t for _, t in self.steps])

    def __call__(
        self, x: torch.Tensor | list[torch.Tensor], *, generator: torch.Generator | None = None
    ) -> torch.Tensor | list[torch.Tensor]:
        if self.changes_labels:
            raise ValueError(
                "this Compose has steps that change labels (MixUp/CutMix/"
                "WithLabels); call compose.apply(images, labels)."
            )
        return self.apply(x, None, generator=generator)[0]

    def __repr__(self) -> str:
        return "Compose([" + ", ".join(map(repr, self.transforms)) + "])"


def apply_steps(
    steps: Sequence[tuple[str, Any]],
    images: torch.Tensor | list[torch.Tensor],
    labels: _Labels,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor | list[torch.Tensor], _Labels]:
    """Run ``steps`` (``Compose.steps``: (kind, step) pairs) on a batch, drawing from
    ``generator``; ``(images, labels)`` in, ``(images, labels)`` out."""
    for kind, t in steps:
        if kind == "pixel":
            images = _run(t, images, generator)
            continue
        if kind == "masks":  # run on the masks by apply_mask_steps
            continue
        if not isinstance(images, torch.Tensor):
            raise ValueError(
                f"{t!r} mixes samples, which needs one fixed-size batch tensor; "
                "add RandomResizedCrop/CenterCrop/Resize((h, w)) before it."
            )
        if getattr(t, "random", False):
            images, labels = t(images, labels, generator=generator)
        else:
            with seeded_global_rng(generator, images.device):
                images, labels = t(images, labels)
    return images, labels


def apply_mask_steps(
    steps: Sequence[tuple[str, Any]], masks: torch.Tensor | list[torch.Tensor]
) -> torch.Tensor | list[torch.Tensor]:
    """Run the mask steps of ``steps`` (``Compose.steps``) on a batch's masks, in order."""
    for kind, t in steps:
        if kind == "masks":
            masks = t(masks) if isinstance(masks, torch.Tensor) else [t(m) for m in masks]
    return masks


def _per_sample(t: object) -> bool:
    """Whether batch step ``t`` acts on each sample alone and can be sent to a worker process:
    gpucache's ToDtype and Normalize (not into channels-last memory, which a batch sent as one
    buffer would not keep), ColorJitter (its draws are per sample, from the batch's generator)
    and PerSample (a picklable transform on each image)."""
    if isinstance(t, (ToDtype, Normalize)):
        return t.layout != "channels_last"
    if not isinstance(t, (ColorJitter, PerSample)):
        return False
    try:
        pickle.dumps(t)
    except Exception:  # noqa: BLE001 - a lambda, a local function: it stays in the loop's process
        return False
    return True


def per_sample_prefix(steps: Sequence[object]) -> int:
    """The number of leading ``steps`` that act on each sample alone (and pickle): they may run
    in the worker that decoded the batch, on the same generator, with the same result; the
    steps after the first other one (MixUp, CutMix, any callable) stay in the loop's process."""
    n = 0
    while n < len(steps) and _per_sample(steps[n]):
        n += 1
    return n


def elementwise_prefix(steps: Sequence[object]) -> int:
    """The number of leading ``steps`` that map each pixel alone (ToDtype, Normalize into
    NCHW): they can run on each sample as soon as it is resized, straight into the batch's
    output (one pass to float), with the same result as on the batch."""
    n = 0
    while n < len(steps) and isinstance(steps[n], (ToDtype, Normalize)):
        if getattr(steps[n], "layout", "NCHW") != "NCHW":
            break
        n += 1
    return n


def elementwise_into(steps: Sequence[Any], x: torch.Tensor, out: torch.Tensor) -> None:
    """Run ``steps`` (an :func:`elementwise_prefix`) on one sample ``x`` (1, C, H, W) into
    ``out`` (1, C, H, W, of the steps' output dtype): a float32 Normalize at the end writes there
    directly, the same values as on the batch."""
    for t in steps[:-1]:
        x = t(x)
    last = steps[-1]
    if isinstance(last, Normalize) and last.dtype == torch.float32 and last.layout == "NCHW":
        last._into(x, out)
    else:
        out.copy_(last(x))


def as_compose(transform: object) -> Compose:
    """A Compose from None, one transform or callable, or a list/tuple of them."""
    if transform is None:
        return Compose([])
    if isinstance(transform, Compose):
        return transform
    if isinstance(transform, Transform) or callable(transform):
        return Compose([transform])
    if isinstance(transform, (list, tuple)):
        return Compose(list(transform))
    raise TypeError(
        f"transform={transform!r} ({type(transform).__name__}) is not accepted; give "
        f"one transform or a list of them: {_ACCEPTED}."
    )


__all__ = [
    "Compose",
    "RandomResizedCrop",
    "Resize",
    "CenterCrop",
    "RandomHorizontalFlip",
    "Letterbox",
    "Pad",
    "MapMaskValues",
    "ToDtype",
    "Normalize",
    "Transform",
    "ColorJitter",
    "MixUp",
    "CutMix",
    "PerSample",
    "PerBatch",
    "WithLabels",
    "batch_generator",
    "map_boxes",
    "map_points",
]
