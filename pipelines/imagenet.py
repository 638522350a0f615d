"""ImageNet-style train and val loaders on gpucache's public API.

train: RandomResizedCrop(224) + horizontal flip, normalized float16/float32 on the device.
val:   Resize(256) + CenterCrop(224), normalized the same way.
"""

from __future__ import annotations

import torch

from gpucache import GpuCachedLoader, JpegCache
from gpucache import transforms as T

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def train_transform(size: int = 224, *, dtype: torch.dtype = torch.float32) -> T.Compose:
    return T.Compose(
        [T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.Normalize(MEAN, STD, dtype=dtype)]
    )


def val_transform(
    size: int = 224, resize: int = 256, *, dtype: torch.dtype = torch.float32
) -> T.Compose:
    return T.Compose([T.Resize(resize), T.CenterCrop(size), T.Normalize(MEAN, STD, dtype=dtype)])


def train_loader(
    cache: JpegCache,
    *,
    batch_size: int = 256,
    seed: int = 0,
    size: int = 224,
    dtype: torch.dtype = torch.float32,
    **kwargs,
) -> GpuCachedLoader:
    """Shuffled, last partial batch dropped; extra keywords go to GpuCachedLoader."""
    return GpuCachedLoader(
        cache,
        batch_size=batch_size,
        shuffle=True,
        drop_last=True,
        seed=seed,
        transform=train_transform(size, dtype=dtype),
        **kwargs,
    )


def val_loader(
    cache: JpegCache,
    *,
    batch_size: int = 256,
    size: int = 224,
    dtype: torch.dtype = torch.float32,
    **kwargs,
) -> GpuCachedLoader:
    """In order, every sample once; resize to size * 8 / 7 (256 for 224), then center crop."""
    return GpuCachedLoader(
        cache,
        batch_size=batch_size,
        shuffle=False,
        drop_last=False,
        transform=val_transform(size, round(size * 8 / 7), dtype=dtype),
        **kwargs,
    )
