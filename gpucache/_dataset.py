"""JpegDataset: a map-style ``torch.utils.data.Dataset`` over a :class:`JpegCache`.

For code that keeps its ``DataLoader`` (detection pipelines with mosaic, cv2/albumentations
augmentation, Ultralytics-style datasets): ``dataset[i]`` decodes one sample on the CPU with
libjpeg-turbo (EXIF orientation applied) and returns ``(image, target)`` like ImageFolder does.

Sharing with DataLoader workers costs O(1): the dataset pickles as its store, and a saved or
shared store pickles as its path (workers map the same pages read-only). An in-memory store is
moved into shared memory once, the first time the dataset is pickled (``cache.share()``, which
checks the room first), so spawn and forkserver workers attach to one copy instead of each
receiving their own. Under fork nothing is pickled and nothing is shared.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
from torch.utils.data import Dataset

from .decode._outcome import check_size
from .decode._sample import decode_sample
from .store._store import Store
from .store._targets import dense_targets, ragged_targets

log = logging.getLogger(__name__)

_OUTPUTS = ("tensor", "numpy", "pil")


class JpegDataset(Dataset[tuple[Any, ...]]):
    """Decode samples of ``cache`` one at a time, for a ``torch.utils.data.DataLoader``.

    ``output``: ``"tensor"`` (RGB uint8 CHW ``torch.Tensor``, what torchvision v2 transforms take),
    ``"numpy"`` (RGB uint8 HWC contiguous ``ndarray``, for cv2 / albumentations; ``bgr=True`` gives
    cv2's channel order) or ``"pil"`` (a ``PIL.Image``, for torchvision v1 transforms).
    ``transform`` runs on each decoded image, ``target_transform`` on each target.
    ``return_info=True`` adds a third element: ``{"index", "path", "metadata", "targets"}``
    (metadata and ragged targets where the store has them; the default collate keeps strings as
    lists, ragged targets need your own ``collate_fn``).
    """

    def __init__(
        self,
        cache: Store,
        *,
        output: Literal["tensor", "numpy", "pil"] = "tensor",
        bgr: bool = False,
        transform: Callable[[Any], Any] | None = None,
        target_transform: Callable[[Any], Any] | None = None,
        return_info: bool = False,
    ) -> None:
        if not isinstance(cache, Store):
            raise TypeError(
                f"cache must be a gpucache.JpegCache, got {type(cache).__name__}; "
                "build one with JpegCache.from_folder(root) or JpegCache.open(path)."
            )
        if output not in _OUTPUTS:
            raise ValueError(f"output must be one of {_OUTPUTS}, got {output!r}.")
        if bgr and output != "numpy":
            raise ValueError(
                "bgr=True is for output='numpy' (cv2's channel order); torch and PIL "
                "images are RGB."
            )
        for name, fn in (("transform", transform), ("target_transform", target_transform)):
            if fn is not None and not callable(fn):
                raise TypeError(
                    f"{name} must be a callable taking one sample (a torchvision "
                    f"transform, a Compose, a function) or None, got "
                    f"{type(fn).__name__}."
                )
        self.cache, self.output, self.bgr = cache, output, bgr
        self.transform, self.target_transform = transform, target_transform
        self.return_info = return_info

    def __len__(self) -> int:
        return len(self.cache)

    def decode(self, i: int) -> Any:
        """Sample ``i``'s image in the dataset's ``output`` form, before ``transform``."""
        i = range(len(self.cache))[i]  # the pixel budget is checked before decoding
        img = check_size(self.cache, i, decode_sample(self.cache, i))
        if self.output == "tensor":
            return img
        hwc = img.permute(1, 2, 0)
        if self.bgr:
            hwc = hwc.flip(-1)
        arr = np.ascontiguousarray(hwc.numpy())
        if self.output == "numpy":
            return arr
        from PIL import Image

        return Image.fromarray(arr, mode="RGB")

    def target(self, i: int) -> Any:
        """Sample ``i``'s target: its row of float targets (C,) if the store has them, else the
        int label (``-1`` where unlabeled)."""
        dense = dense_targets(self.cache)
        return int(self.cache.labels[i]) if dense is None else dense[i].copy()

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        i = range(len(self.cache))[i]
        img, target = self.decode(i), self.target(i)
        if self.transform is not None:
            img = self.transform(img)
        if self.target_transform is not None:
            target = self.target_transform(target)
        if not self.return_info:
            return img, target
        meta = self.cache.metadata
        info: dict[str, Any] = {
            "index": i,
            "path": self.cache.paths[i],
            "metadata": None if meta is None else meta[i],
        }
        if info["metadata"] is None:
            del info["metadata"]  # the default collate cannot batch None
        ragged = ragged_targets(self.cache, [i])
        if ragged is not None:  # (K_i, C): batch these with your own collate_fn
            info["targets"] = ragged[0].copy()
        return img, target, info

    def __getstate__(self) -> dict[str, Any]:
        if not self.cache.is_shared:
            log.info(
                "gpucache: JpegDataset is being pickled (spawn/forkserver DataLoader "
                "workers); moving its in-memory store into shared memory once"
            )
            self.cache.share()
        return dict(vars(self))

    def __repr__(self) -> str:
        return f"JpegDataset({self.cache!r}, output={self.output!r}, transform={self.transform!r})"


__all__ = ["JpegDataset"]
