"""The batch steps that change the labels too: :class:`MixUp`, :class:`CutMix` (seeded, one draw
a batch, as torchvision's) and :class:`WithLabels` for any callable ``(images, labels)``."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from ._generator import seeded_global_rng


class WithLabels:
    """Mark a callable ``(images, labels) -> (images, labels)`` (torchvision's ``v2.MixUp``,
    ``v2.CutMix``, ``v2.RandomChoice([...])`` of them, a user function) as a batch transform that
    sees and changes the labels. torchvision's MixUp/CutMix are recognised without it."""

    with_labels = True
    random = True

    def __init__(
        self, transform: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    ):
        if not callable(transform):
            raise TypeError(
                f"WithLabels takes a callable (images, labels) -> (images, labels), "
                f"got {transform!r}"
            )
        self.transform = transform

    def __call__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        *,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with seeded_global_rng(generator, images.device):
            return self.transform(images, labels)

    def __repr__(self) -> str:
        return f"WithLabels({self.transform!r})"


def _soft(labels: torch.Tensor, num_classes: int | None, name: str) -> torch.Tensor:
    if labels.dim() == 2 and labels.is_floating_point():
        return labels
    if labels.dim() == 1 and not labels.is_floating_point():
        if num_classes is None:
            raise ValueError(f"{name} needs num_classes= to one-hot int labels")
        if labels.min() < 0:
            raise ValueError(f"{name}: unlabeled samples (label -1) cannot be mixed")
        return F.one_hot(labels, num_classes).float()
    raise ValueError(
        f"{name} takes int labels (N,) or float targets (N, C), got "
        f"{labels.dtype} {tuple(labels.shape)}"
    )


class _Mix:
    with_labels = True
    random = True

    def __init__(self, *, alpha: float = 1.0, num_classes: int | None = None, p: float = 1.0):
        if alpha <= 0:
            raise ValueError(f"alpha must be > 0, got {alpha}")
        self.alpha, self.num_classes, self.p = float(alpha), num_classes, p

    def lam(self, generator: torch.Generator | None) -> float | None:
        """The mixing weight of this batch (one Beta(alpha, alpha) draw), or None to skip it."""
        if float(torch.rand((), generator=generator)) >= self.p:
            return None
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        return float(np.random.default_rng(seed).beta(self.alpha, self.alpha))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(alpha={self.alpha}, num_classes={self.num_classes})"


class MixUp(_Mix):
    """Blend each sample with the next one in the batch (torchvision's MixUp: one lambda per
    batch): images ``lam * x + (1 - lam) * x.roll(1)``, labels one-hot and mixed the same way.
    uint8 images are mixed in float and rounded back to uint8."""

    def __call__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        *,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        soft = _soft(labels, self.num_classes, "MixUp")
        lam = self.lam(generator)
        if lam is None or len(images) < 2:
            return images, soft
        mixed = images.float().mul(lam).add_(images.roll(1, 0).float(), alpha=1 - lam)
        if not images.is_floating_point():
            mixed = mixed.round_().clamp_(0, 255)
        return mixed.to(images.dtype), soft.mul(lam).add_(soft.roll(1, 0), alpha=1 - lam)


class CutMix(_Mix):
    """Paste a box of the next sample into each sample (torchvision's CutMix: one box per batch);
    labels are mixed by the pasted area."""

    def box(
        self, lam: float, h: int, w: int, generator: torch.Generator | None
    ) -> tuple[int, int, int, int]:
        cy, cx = (int(torch.randint(0, s, (1,), generator=generator)) for s in (h, w))
        r = math.sqrt(1 - lam)
        bh, bw = int(r * h), int(r * w)
        top, left = max(cy - bh // 2, 0), max(cx - bw // 2, 0)
        return top, left, min(cy + bh // 2, h), min(cx + bw // 2, w)

    def __call__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        *,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if images.dim() != 4 or images.shape[1] not in (1, 3):
            raise ValueError(
                f"CutMix takes an (N, C, H, W) batch, got shape "
                f"{tuple(images.shape)}; put it before an NHWC layout change."
            )
        soft = _soft(labels, self.num_classes, "CutMix")
        lam = self.lam(generator)
        if lam is None or len(images) < 2:
            return images, soft
        h, w = images.shape[-2:]
        y0, x0, y1, x1 = self.box(lam, h, w, generator)
        out = images.clone()
        out[..., y0:y1, x0:x1] = images.roll(1, 0)[..., y0:y1, x0:x1]
        kept = 1 - (y1 - y0) * (x1 - x0) / (h * w)
        return out, soft.mul(kept).add_(soft.roll(1, 0), alpha=1 - kept)
