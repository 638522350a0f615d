"""Compose: geometric transforms first, then batch steps, sorted by kind; torchvision pipelines
translated first (:mod:`._tvcompat`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from . import _tvcompat
from ._geometric import CenterCrop, Letterbox, RandomResizedCrop, Resize, identity_plans
from ._steps import _Labels, apply_steps, per_sample_prefix
from ._transform import Geometric, Transform

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
