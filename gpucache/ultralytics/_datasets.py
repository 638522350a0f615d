"""Ultralytics' datasets with their images from a gpucache store.

:class:`YOLODataset` is Ultralytics' own (labels, rect shapes, mosaic, mixup, letterbox and
collate untouched) with ``load_image`` reading the store: the decoded tier when ``cache`` asks
for it (``"ram"``, ``True`` or ``"disk"``) and it fits, the raw tier (a JPEG decode a call)
otherwise. :class:`ClassificationDataset` is Ultralytics' own with each image decoded from the
store and its class taken from the store's labels.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from PIL import Image
from ultralytics.data.build import build_yolo_dataset as _ultralytics_build
from ultralytics.data.dataset import ClassificationDataset as _UClassificationDataset
from ultralytics.data.dataset import YOLODataset as _UYOLODataset
from ultralytics.data.utils import get_split_fraction
from ultralytics.utils import LOCAL_RANK, colorstr

from .._errors import GpucacheError
from ..decode._sample import decode_sample
from ..node._dir import default_dir
from ..node._jpegcache import JpegCache
from ..store._store import Store
from . import _pixels

__all__ = ["YOLODataset", "ClassificationDataset", "build_yolo_dataset"]


def _store(
    paths: list[str], labels: np.ndarray, cache_dir: str | os.PathLike[str] | None
) -> tuple[Store, np.ndarray]:
    """The store of ``paths`` in the node cache (built once per node, reused while the files
    are unchanged) and each path's sample in it (-1: left out by the build as a bad image)."""
    cache = JpegCache.from_files(
        paths,
        labels,
        metadata=[str(i) for i in range(len(paths))],
        cache_dir=default_dir() if cache_dir is None else cache_dir,
        progress=LOCAL_RANK <= 0,
    )
    index = np.full(len(paths), -1, dtype=np.int64)
    meta = cache.metadata
    assert meta is not None
    index[np.asarray([int(m) for m in meta], dtype=np.int64)] = np.arange(len(cache))
    return cache, index


def _decoded_asked(cache: Any) -> bool:
    c = cache.lower() if isinstance(cache, str) else ("ram" if cache is True else None)
    return c in ("ram", "disk")


class YOLODataset(_UYOLODataset):  # type: ignore[misc]  # ultralytics has no types
    """Ultralytics' ``YOLODataset`` whose ``load_image`` reads a gpucache store.

    ``gpucache_tier``: ``"decoded"`` (pixels decoded once per node at Ultralytics' size, mapped
    by every process) or ``"raw"`` (decoded from the store's JPEG bytes at every load);
    ``gpucache_reason``: why the decoded tier asked for is not used (None otherwise).
    """

    def __init__(
        self, *args: Any, cache: Any = None, cache_dir: str | None = None, **kwargs: Any
    ) -> None:
        decoded = _decoded_asked(cache)
        # "ram" keeps Ultralytics' no-buffer path (mosaic draws from the whole data set); its
        # own cache is never built (check_cache_ram below)
        super().__init__(*args, cache="ram" if decoded else None, **kwargs)
        self.gpucache_store, self.gpucache_index = _store(
            list(self.im_files), np.arange(len(self.im_files)), cache_dir
        )
        imgsz = self.imgsz
        side = int(max(imgsz)) if isinstance(imgsz, (tuple, list)) else int(imgsz)
        pixels = _pixels.choose(self.gpucache_store, side, decoded=decoded, budget=None)
        self.gpucache_pixels = pixels
        self.gpucache_tier: str = pixels.tier
        self.gpucache_reason: str | None = pixels.reason

    def check_cache_ram(self, safety_margin: float = 1.0) -> bool:
        return False  # the store's decoded tier holds the images, once per node

    def check_cache_disk(self, safety_margin: float = 0.1) -> bool:
        return False

    def load_image(
        self, i: int, rect_mode: bool = True, resize_short: bool = False
    ) -> tuple[np.ndarray, tuple[int, int], tuple[int, int]]:
        """Image ``i`` as Ultralytics' own ``load_image`` returns it: BGR HWC resized so its
        long side is ``imgsz``, its original ``(h0, w0)`` and its resized ``(h, w)``."""
        j = int(self.gpucache_index[i])
        if j < 0 or not rect_mode or resize_short or self.channels != 3:
            return super().load_image(i, rect_mode, resize_short)  # type: ignore[no-any-return]
        if self.ims[i] is not None:  # in the mosaic buffer (raw tier)
            return self.ims[i], self.im_hw0[i], self.im_hw[i]
        s = self.gpucache_store.samples[j]
        h0, w0 = int(s["height"]), int(s["width"])
        try:
            im = self.gpucache_pixels.load(j)
        except (GpucacheError, RuntimeError, OSError, ValueError):  # Ultralytics' own read then
            return super().load_image(i, rect_mode, resize_short)  # type: ignore[no-any-return]
        hw = (int(im.shape[0]), int(im.shape[1]))
        if self.augment and self.cache != "ram":  # Ultralytics' buffer for mosaic, as its own
            self.ims[i], self.im_hw0[i], self.im_hw[i] = im, (h0, w0), hw
            self.buffer.append(i)
            if 1 < len(self.buffer) >= self.max_buffer_length:
                k = self.buffer.pop(0)
                self.ims[k], self.im_hw0[k], self.im_hw[k] = None, None, None
        return im, (h0, w0), hw


class ClassificationDataset(_UClassificationDataset):  # type: ignore[misc]
    """Ultralytics' ``ClassificationDataset`` with each image decoded from a gpucache store
    (the raw tier: classification transforms crop the full image) and its class from the
    store's labels."""

    def __init__(self, *args: Any, cache_dir: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cache_ram = self.cache_disk = False
        paths = [str(s[0]) for s in self.samples]
        labels = np.asarray([int(s[1]) for s in self.samples], dtype=np.int64)
        self.gpucache_store, self.gpucache_index = _store(paths, labels, cache_dir)
        self.gpucache_tier = "raw"
        self.gpucache_reason: str | None = None

    def cache_images(self) -> None:
        pass  # the store holds the images (Ultralytics' own RAM cache is not built)

    def __getitem__(self, i: int) -> dict[str, Any]:
        j = int(self.gpucache_index[i])
        if j < 0:  # left out of the store: Ultralytics' own read
            return super().__getitem__(i)  # type: ignore[no-any-return]
        rgb = decode_sample(self.gpucache_store, j).permute(1, 2, 0).numpy()
        sample = self.torch_transforms(Image.fromarray(np.ascontiguousarray(rgb)))
        return {"img": sample, "cls": int(self.gpucache_store.labels[j])}


def build_yolo_dataset(
    cfg: Any,
    img_path: str | list[str],
    batch: int,
    data: dict[str, Any],
    mode: str = "train",
    rect: bool = False,
    stride: int = 32,
    multi_modal: bool = False,
    fraction: float | None = None,
    *,
    cache_dir: str | None = None,
) -> Any:
    """Ultralytics' ``build_yolo_dataset`` (the same arguments), making a :class:`YOLODataset`
    that reads a gpucache store. ``cache_dir``: the node cache folder (None: the default one).
    Depth, semantic and multi-modal datasets are Ultralytics' own, unchanged."""
    if cfg.task in ("depth", "semantic") or multi_modal:
        return _ultralytics_build(
            cfg, img_path, batch, data, mode, rect, stride, multi_modal, fraction
        )
    pad = 0.0 if mode == "train" else 0.5
    rect = cfg.rect or rect
    if data.get("complete"):
        fraction = 1.0
    elif fraction is None:
        fraction = get_split_fraction(cfg.fraction, "train" if mode == "train" else cfg.split)
    return YOLODataset(
        img_path=img_path,
        imgsz=cfg.imgsz,
        batch_size=batch,
        augment=mode == "train",
        hyp=cfg,
        rect=rect,
        cache=cfg.cache or None,
        cache_dir=cache_dir,
        single_cls=cfg.single_cls or False,
        stride=stride,
        pad=pad,
        prefix=colorstr(f"{mode}: "),
        task=cfg.task,
        classes=cfg.classes,
        data=data,
        fraction=fraction,
    )
