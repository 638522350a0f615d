"""Batched, seeded pixel and label transforms; wrappers that let any callable join a Compose.

Every random draw comes from the ``torch.Generator`` the loader seeds from (seed, epoch, batch)
(:func:`batch_generator`), on the CPU, so a batch gets the same augmentation on every device and
backend. Draws are per sample; the arithmetic runs on the whole batch, on the batch's device.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ._device import to_device


def batch_generator(*key: int) -> torch.Generator:
    """The CPU generator a batch's pixel and label transforms draw from, seeded by ``key``
    (the loader's seed, epoch, batch and, with several ranks, rank)."""
    state = np.random.SeedSequence([*map(int, key), 0x9E37]).generate_state(1, np.uint64)
    return torch.Generator().manual_seed(int(state[0]) % 2**63)


def _uniform(n: int, low: float, high: float, g: torch.Generator | None) -> torch.Tensor:
    return torch.rand(n, generator=g, dtype=torch.float64).mul_(high - low).add_(low).float()


@contextlib.contextmanager
def seeded_global_rng(generator: torch.Generator | None, device: torch.device) -> Iterator[None]:
    """Run a callable that draws from torch's global RNG (torchvision's random transforms) with a
    seed taken from ``generator``; the global state is restored afterwards."""
    if generator is None:
        yield
        return
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    devices = (
        [device.index if device.index is not None else torch.cuda.current_device()]
        if device.type == "cuda"
        else []
    )
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def _blend(x: torch.Tensor, other: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """torchvision's blend, with one ratio per sample: x * r + other * (1 - r), clamped."""
    out = x.float().mul(ratio).add_(other.float().mul(1 - ratio))
    if x.is_floating_point():
        return out.clamp_(0, 1).to(x.dtype)
    return out.clamp_(0, 255).to(x.dtype)


def _gray(x: torch.Tensor) -> torch.Tensor:
    r, g, b = x.float().unbind(dim=-3)
    out = r.mul(0.2989).add_(g, alpha=0.587).add_(b, alpha=0.114).unsqueeze(-3)
    return out if x.is_floating_point() else out.floor_()


def _factors(spec: float | Sequence[float], name: str) -> tuple[float, float] | None:
    if isinstance(spec, (int, float)):
        if spec < 0:
            raise ValueError(f"{name} must be >= 0, got {spec}")
        return None if spec == 0 else (max(0.0, 1 - spec), 1 + spec)
    low, high = (float(v) for v in spec)
    if not 0 <= low <= high:
        raise ValueError(f"{name} range must satisfy 0 <= low <= high, got {spec}")
    return low, high


class ColorJitter:
    """Per-sample brightness, contrast and saturation, as torchvision's ``ColorJitter`` defines
    them (same factor ranges and blend formulas), applied in that fixed order to an (N, 3, H, W)
    batch, uint8 or float in [0, 1]. Place it before ``Normalize``. For hue, use
    ``PerSample(torchvision.transforms.v2.ColorJitter(hue=...))``."""

    random = True

    def __init__(
        self,
        brightness: float | Sequence[float] = 0,
        contrast: float | Sequence[float] = 0,
        saturation: float | Sequence[float] = 0,
        *,
        p: float = 1.0,
    ):
        self.brightness = _factors(brightness, "brightness")
        self.contrast = _factors(contrast, "contrast")
        self.saturation = _factors(saturation, "saturation")
        self.p = p

    def factors(self, n: int, generator: torch.Generator | None) -> dict[str, torch.Tensor]:
        """Per-sample factors (1 = unchanged), drawn in a fixed order."""
        out: dict[str, torch.Tensor] = {}
        apply = torch.rand(n, generator=generator) < self.p
        for name in ("brightness", "contrast", "saturation"):
            rng: tuple[float, float] | None = getattr(self, name)
            if rng is not None:
                f = _uniform(n, *rng, generator)
                out[name] = torch.where(apply, f, torch.ones_like(f))
        return out

    def __call__(
        self, x: torch.Tensor, *, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        if x.dim() != 4 or x.shape[1] != 3:
            raise ValueError(
                f"ColorJitter takes an (N, 3, H, W) batch, got shape "
                f"{tuple(x.shape)}; place it before Normalize/ToDtype layout changes."
            )
        for name, f in self.factors(len(x), generator).items():
            r = to_device(f, x.device).view(-1, 1, 1, 1)  # pinned, non_blocking: no host wait
            if name == "brightness":
                x = _blend(x, torch.zeros((), device=x.device), r)
            elif name == "contrast":
                x = _blend(x, _gray(x).mean(dim=(-3, -2, -1), keepdim=True), r)
            else:
                x = _blend(x, _gray(x), r)
        return x


class PerSample:
    """Run ``transform`` (e.g. a torchvision v2 ``RandAugment``) on each image of the batch
    separately, so each sample gets its own random parameters, seeded from (seed, epoch, batch).
    A torchvision transform given a whole batch draws its parameters once for the batch."""

    random = True

    def __init__(self, transform: Callable[[torch.Tensor], torch.Tensor]):
        if not callable(transform):
            raise TypeError(f"PerSample takes a callable on one image, got {transform!r}")
        self.transform = transform

    def __call__(
        self, x: torch.Tensor | list[torch.Tensor], *, generator: torch.Generator | None = None
    ) -> torch.Tensor | list[torch.Tensor]:
        device = x.device if isinstance(x, torch.Tensor) else x[0].device
        with seeded_global_rng(generator, device):
            out = [self.transform(img) for img in x]
        return torch.stack(out) if isinstance(x, torch.Tensor) else out

    def __repr__(self) -> str:
        return f"PerSample({self.transform!r})"


class PerBatch:
    """Run ``transform`` once on the whole batch: one random draw shared by every sample of the
    batch, seeded from (seed, epoch, batch). Saying so silences the warning a random torchvision
    op gets when it would run on a whole batch unwrapped; for a draw per sample use
    :class:`PerSample`."""

    def __init__(self, transform: Callable[[torch.Tensor], torch.Tensor]):
        if not callable(transform):
            raise TypeError(f"PerBatch takes a callable on a batch, got {transform!r}")
        self.transform = transform

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.transform(x)

    def __repr__(self) -> str:
        return f"PerBatch({self.transform!r})"


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
