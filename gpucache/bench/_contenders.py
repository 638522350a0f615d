"""The contenders, and how each one's data set and loader are made (same workers, batch, transform).

======================  ===============================================================
``pil``                 torch DataLoader + torchvision ImageFolder + PIL + v2 transforms, files
``bytes-fork``          DataLoader over a list-of-bytes RAM cache + decode_jpeg, fork workers
``bytes-spawn``         the same under spawn (every worker unpickles its own copy)
``cpu-mem-fork``        GpuCachedLoader, cpu backend, store built in memory, fork workers
``cpu-mem-spawn``       the same under spawn (the store is moved to shared memory once)
``cpu-file-fork``       GpuCachedLoader, cpu backend, store opened from a saved file, fork (ROI)
``cpu-file-spawn``      the same under spawn
``cpu-full-fork``       cpu-file-fork with ROI decode off: every JPEG decoded in full, then cropped
``cpu-rst-fork``        GpuCachedLoader cpu, the store transcoded with restart markers, fork
``cpu-decoded-fork``    GpuCachedLoader cpu over a decoded tier (``--decoded S``), fork
``nvjpeg``, ``dali``    GpuCachedLoader GPU backends, store from file (when CUDA is present)
======================  ===============================================================
"""

from __future__ import annotations

import gc
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from torch.utils.data import Dataset

from .._errors import BenchError
from ._common import CROP, MEAN, STD, Config, Source

if TYPE_CHECKING:
    from ..node._jpegcache import JpegCache
    from ..transforms import Transform

GPU_BACKENDS = ("nvjpeg", "dali")


@dataclass(frozen=True)
class Contender:
    name: str
    kind: str  # "pil" | "bytes" | "gpucache"
    what: str
    context: str | None = None  # multiprocessing start method; None: the platform's default
    backing: str | None = None  # gpucache: "memory" | "file" | "rst" (restart-marker, memory)
    backend: Literal["cpu", "nvjpeg", "dali"] | None = None  # gpucache contenders
    roi: bool = True  # gpucache cpu: decode only the crop box when nvImageCodec is there
    decoded: bool = False  # gpucache: over a decoded tier of side ``Config.decoded``


CONTENDERS = {
    c.name: c
    for c in (
        Contender("pil", "pil", "DataLoader + ImageFolder + PIL + torchvision v2, from files"),
        Contender(
            "bytes-fork", "bytes", "DataLoader over a list of bytes + decode_jpeg, fork", "fork"
        ),
        Contender(
            "bytes-spawn", "bytes", "DataLoader over a list of bytes + decode_jpeg, spawn", "spawn"
        ),
        Contender(
            "cpu-mem-fork",
            "gpucache",
            "GpuCachedLoader cpu, in-memory store, fork",
            "fork",
            "memory",
            "cpu",
        ),
        Contender(
            "cpu-mem-spawn",
            "gpucache",
            "GpuCachedLoader cpu, in-memory store, spawn",
            "spawn",
            "memory",
            "cpu",
        ),
        Contender(
            "cpu-file-fork",
            "gpucache",
            "GpuCachedLoader cpu, store opened from file, fork (crops decoded region-only)",
            "fork",
            "file",
            "cpu",
        ),
        Contender(
            "cpu-file-spawn",
            "gpucache",
            "GpuCachedLoader cpu, store opened from file, spawn",
            "spawn",
            "file",
            "cpu",
        ),
        Contender(
            "cpu-full-fork",
            "gpucache",
            "GpuCachedLoader cpu, file store, fork, ROI decode off (full decode, then crop)",
            "fork",
            "file",
            "cpu",
            roi=False,
        ),
        Contender(
            "cpu-rst-fork",
            "gpucache",
            "GpuCachedLoader cpu, restart-marker store (only the crop's segments decoded), fork",
            "fork",
            "rst",
            "cpu",
        ),
        Contender(
            "cpu-decoded-fork",
            "gpucache",
            "GpuCachedLoader cpu, decoded tier (pixels decoded once, --decoded S), fork",
            "fork",
            "file",
            "cpu",
            decoded=True,
        ),
        Contender(
            "nvjpeg",
            "gpucache",
            "GpuCachedLoader nvjpeg (GPU), store from file",
            None,
            "file",
            "nvjpeg",
        ),
        Contender(
            "dali", "gpucache", "GpuCachedLoader dali (GPU), store from file", None, "file", "dali"
        ),
    )
}


def tv_transform(pipeline: str, *, pil: bool, normalize: bool = False) -> Callable[[Any], Any]:
    """The torchvision v2 transforms of the DataLoader contenders (uint8 out; with
    ``normalize``, float32 out of ToDtype + Normalize, run in the DataLoader's workers)."""
    import torch
    from torchvision.transforms import v2

    if pipeline == "train":
        ops = [v2.RandomResizedCrop(CROP, antialias=True), v2.RandomHorizontalFlip()]
    else:
        ops = [v2.Resize(256, antialias=True), v2.CenterCrop(CROP)]
    ops += [v2.PILToTensor()] if pil else []
    if normalize:
        ops += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)]
    composed: Callable[[Any], Any] = v2.Compose(ops)  # torchvision has no annotations
    return composed


def gc_transform(pipeline: str, normalize: bool = False) -> list[Transform]:
    """The same pipeline in gpucache's transforms (uint8 out; with ``normalize``, float32 out
    of Normalize, as the README's example ends)."""
    from .. import transforms as T

    if pipeline == "train":
        ops: list[Transform] = [T.RandomResizedCrop(CROP), T.RandomHorizontalFlip()]
    else:
        ops = [T.Resize(256), T.CenterCrop(CROP)]
    return ops + ([T.Normalize(MEAN, STD)] if normalize else [])


def _no_region(components: int) -> None:
    """No region decoder for any JPEG: every sample decoded in full, then cropped."""
    return None


class NoRoi:
    """worker_init_fn that takes ROI decode away in the worker (its region decoder chooser
    patched to find none), then runs ``inner``."""

    def __init__(self, inner: Callable[[int], None] | None = None) -> None:
        self.inner = inner

    def __call__(self, worker_id: int) -> None:
        from ..decode import _roi

        _roi.region_decoder = _no_region
        if self.inner is not None:
            self.inner(worker_id)


class ListOfBytes(Dataset[tuple[Any, int]]):
    """The usual home-made RAM cache: a Python list of each file's bytes, decoded on access.

    Decodes with the same libjpeg-turbo call as gpucache's cpu backend (PIL for non-JPEG), so the
    comparison is about how the bytes are held and moved, not about the decoder."""

    def __init__(self, samples: list[tuple[str, int]], transform: Callable[[Any], Any]) -> None:
        self.items = [Path(p).read_bytes() for p, _ in samples]
        self.targets = [int(label) for _, label in samples]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import torch

        from ..decode._jpeg import decode_jpeg

        data = self.items[i]
        try:
            with warnings.catch_warnings():  # "the given buffer is not writable"
                warnings.simplefilter("ignore")
                img = decode_jpeg(torch.frombuffer(data, dtype=torch.uint8))
        except RuntimeError:  # PNG/GIF/WebP named as an image: what PIL reads
            import io

            from PIL import Image

            with Image.open(io.BytesIO(data)) as im:
                img = torch.from_numpy(np.asarray(im.convert("RGB")).copy()).permute(2, 0, 1)
        return self.transform(img), self.targets[i]


class Runner:
    """One contender's data set or store, its loader, and what an epoch must give."""

    def __init__(self, contender: Contender, source: Source, cfg: Config) -> None:
        self.c, self.source, self.cfg = contender, source, cfg
        self.loader: Any = None  # a DataLoader or a GpuCachedLoader, once made
        self.data: Any = None  # a DataLoader contender's data set
        self.cache: JpegCache | None = None  # a gpucache contender's store
        self.expected: np.ndarray | None = None  # label counts of one epoch
        self.data_bytes = 0
        self.device = "cpu"
        self.batch_size = cfg.batch_size
        self.it: Iterator[Any] | None = None  # the open iterator of timing.step

    def setup(self) -> float:
        """Make the data set or store (timed); no workers yet."""
        t0 = time.perf_counter()
        c, src, ncls = self.c, self.source, len(self.source.classes)
        if c.kind == "pil":
            from torchvision.datasets import ImageFolder

            tv = tv_transform(self.cfg.pipeline, pil=True, normalize=self.cfg.normalize)
            ds = ImageFolder(src.root, transform=tv)
            if [s[0] for s in ds.samples] != [s[0] for s in src.samples]:  # a probe's repeats
                ds.samples = ds.imgs = [(p, int(y)) for p, y in src.samples]
                ds.targets = [int(y) for _, y in src.samples]
            self.data, self.data_bytes = ds, src.nbytes
            self.expected = np.bincount(ds.targets, minlength=ncls)
        elif c.kind == "bytes":
            tv = tv_transform(self.cfg.pipeline, pil=False, normalize=self.cfg.normalize)
            ds = ListOfBytes(src.samples, tv)
            self.data, self.data_bytes = ds, sum(len(b) for b in ds.items)
            self.expected = np.bincount(ds.targets, minlength=ncls)
        else:
            from ..node._jpegcache import JpegCache

            if c.backing == "memory":
                self.cache = JpegCache.from_files(
                    [p for p, _ in src.samples],
                    [y for _, y in src.samples],
                    classes=src.classes,
                    progress=False,
                )
            else:
                if src.store is None:
                    raise BenchError("no saved store for a file-backed contender")
                self.cache = JpegCache.open(src.store)
                if c.backing == "rst":  # transcoded from the saved store (timed as setup)
                    from ..ingest._build import restart_store

                    plain, self.cache = self.cache, restart_store(self.cache)
                    plain.close()
            self.data_bytes = self.cache.nbytes
            self.expected = np.bincount(self.cache.labels, minlength=ncls)
            if c.backend != "cpu":
                self.device = "cuda"
        return time.perf_counter() - t0

    def make_loader(
        self,
        *,
        batch_size: int | None = None,
        workers: int | None = None,
        worker_init_fn: Callable[[int], None] | None = None,
    ) -> None:
        import torch

        bs = batch_size or self.cfg.batch_size
        w = self.cfg.workers if workers is None else workers
        shuffle = self.cfg.pipeline == "train"
        if self.c.kind in ("pil", "bytes"):
            from torch.utils.data import DataLoader

            self.loader = DataLoader(
                self.data,
                batch_size=bs,
                shuffle=shuffle,
                num_workers=w,
                persistent_workers=w > 0,
                pin_memory=False,
                multiprocessing_context=self.c.context if w > 0 else None,
                generator=torch.Generator().manual_seed(self.cfg.seed),
                worker_init_fn=worker_init_fn,
            )
        else:
            from ..loader._loader import GpuCachedLoader

            if not self.c.roi:
                if w == 0:
                    raise BenchError(
                        f"{self.c.name} switches ROI off in its workers: needs workers > 0"
                    )
                worker_init_fn = NoRoi(worker_init_fn)
            assert self.cache is not None and self.c.backend is not None  # set up: a store
            self.loader = GpuCachedLoader(
                self.cache,
                batch_size=bs,
                shuffle=shuffle,
                seed=self.cfg.seed,
                transform=gc_transform(self.cfg.pipeline, self.cfg.normalize),
                device=self.device,
                backend=self.c.backend,
                num_workers=w,
                multiprocessing_context=self.c.context,
                worker_init_fn=worker_init_fn,
                decoded=self.cfg.decoded if self.c.decoded else None,
            )
        self.batch_size = bs

    def close(self) -> None:
        self.it = None
        loader, self.loader = self.loader, None
        if loader is not None and hasattr(loader, "close"):
            loader.close()
        elif loader is not None and getattr(loader, "_iterator", None) is not None:
            loader._iterator._shutdown_workers()  # DataLoader's persistent workers
        if self.cache is not None:
            self.cache.close()
        self.cache = self.data = None
        gc.collect()
