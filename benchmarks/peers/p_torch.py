"""Contenders on torch's DataLoader or gpucache: ``pil`` and ``gpucache`` (and what the
``p_litdata`` and ``p_streaming`` drivers share).

Every sample's label is its index in ``cfg["files"]``, so the runner can check that an epoch
delivers each sample exactly once. The torchvision contenders share one v2 pipeline (train:
RandomResizedCrop 224 + flip; eval: Resize 256 + CenterCrop 224, antialiased, uint8 out).
"""

from __future__ import annotations

import os
from pathlib import Path

CROP = 224


def tv_transform(pipeline: str, *, pil: bool):
    from torchvision.transforms import v2

    if pipeline == "train":
        ops = [v2.RandomResizedCrop(CROP, antialias=True), v2.RandomHorizontalFlip()]
    else:
        ops = [v2.Resize(256, antialias=True), v2.CenterCrop(CROP)]
    return v2.Compose(ops + ([v2.PILToTensor()] if pil else []))


def decode(data: bytes):
    """libjpeg-turbo decode through torchvision (RGB, CHW uint8)."""
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)


class _Loader:
    """Holds a DataLoader-like ``loader`` (persistent workers) and yields its batches."""

    loader = None
    setup_info: dict = {}

    def batches(self):
        return iter(self.loader)

    def close(self):
        it = getattr(self.loader, "_iterator", None)
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
        if hasattr(self.loader, "close"):
            self.loader.close()


def _dataloader(ds, cfg, **kw):
    import torch
    from torch.utils.data import DataLoader

    w = cfg["workers"]
    return DataLoader(
        ds,
        batch_size=cfg["batch_size"],
        num_workers=w,
        persistent_workers=w > 0,
        generator=torch.Generator().manual_seed(cfg["seed"]),
        **kw,
    )


class Pil(_Loader):
    """torch DataLoader + torchvision ImageFolder + PIL + v2, reading the files."""

    def __init__(self, cfg):
        from torchvision.datasets import ImageFolder

        ds = ImageFolder(cfg["root"], transform=tv_transform(cfg["pipeline"], pil=True))
        ds.samples = ds.imgs = [(p, i) for i, p in enumerate(cfg["files"])]
        ds.targets = list(range(len(cfg["files"])))
        self.loader = _dataloader(ds, cfg, shuffle=cfg["pipeline"] == "train")


class Gpucache(_Loader):
    """GpuCachedLoader, cpu backend, from a saved store built with ``build_kw`` (e.g. restart
    markers, a size cap); ``transform_kw`` and ``loader_kw`` go to the transforms and the loader."""

    def __init__(self, cfg):
        import numpy as np

        from gpucache import GpuCachedLoader, JpegCache
        from gpucache.bench._contenders import gc_transform

        opt = cfg.get("options", {})
        build_kw = opt.get("build_kw", {})
        path = Path(cfg["work"]) / "store.gpucache"
        if not path.exists():
            labels = np.arange(len(cfg["files"]), dtype=np.int64)
            cache = JpegCache.from_files(cfg["files"], labels, progress=False, **build_kw)
            cache.save(path)
            cache.close()
        self.cache = JpegCache.open(path)
        self.setup_info = {"store_bytes": path.stat().st_size}
        self.loader = GpuCachedLoader(
            self.cache,
            batch_size=cfg["batch_size"],
            shuffle=cfg["pipeline"] == "train",
            seed=cfg["seed"],
            transform=gc_transform(cfg["pipeline"], **opt.get("transform_kw", {})),
            device="cpu",
            backend="cpu",
            num_workers=cfg["workers"],
            **opt.get("loader_kw", {}),
        )

    def close(self):
        self.loader.close()
        self.cache.close()


def _du(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def make(name: str, cfg: dict):
    os.makedirs(cfg["work"], exist_ok=True)
    return {"pil": Pil, "gpucache": Gpucache}[name](cfg)
