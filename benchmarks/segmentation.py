#!/usr/bin/env python
"""Image + mask pairs: gpucache against DataLoader + PIL + torchvision v2, side by side.

Real photos (``/work/shared/data/hymenoptera`` by default: every JPEG under it), each given a
generated mask (a lesion-like blob of class 1 on 0, 8-bit PNG, the photo's displayed size)
written to a temporary folder. Both pipelines do the same work an epoch: read and decode each
image and its mask, RandomResizedCrop 224 + horizontal flip on both (the mask by nearest
neighbour), and yield uint8 batches of 32: (N, 3, 224, 224) images, (N, 224, 224) masks, with
2 worker processes, shuffled.

- gpucache: ``JpegCache.from_files(images, masks=masks)`` (built once, outside the timing),
  ``GpuCachedLoader(num_workers=2, backend="cpu")`` with ``T.RandomResizedCrop(224)`` and
  ``T.RandomHorizontalFlip()``;
- peer: ``DataLoader(num_workers=2, persistent_workers=True)`` over a Dataset that opens the
  image and the mask with PIL (EXIF orientation applied to the image, as gpucache does) and
  runs ``v2.Compose([v2.RandomResizedCrop(224), v2.RandomHorizontalFlip()])`` on
  ``(tv_tensors.Image, tv_tensors.Mask)``.

Rounds interleave (one epoch of each, in turn) after one untimed epoch each; the medians are
compared. ::

    python benchmarks/segmentation.py --out benchmarks/results/segmentation.json
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageOps

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # benchmarks._record, and gpucache from this checkout
from benchmarks._record import run_info, write_json  # noqa: E402

BATCH, SIZE, WORKERS = 32, 224, 2


def blob_mask(width: int, height: int, seed: int) -> bytes:
    """A lesion-like polygon of class 1 on 0, as an 8-bit PNG."""
    rng = np.random.default_rng(seed)
    im = Image.new("L", (width, height), 0)
    cx, cy = rng.uniform(0.3, 0.7) * width, rng.uniform(0.3, 0.7) * height
    r = rng.uniform(0.15, 0.35) * min(width, height)
    t = np.linspace(0, 2 * np.pi, 40, endpoint=False)
    k = 1 + 0.2 * rng.standard_normal(40)
    ImageDraw.Draw(im).polygon(list(zip(cx + r * k * np.cos(t), cy + r * k * np.sin(t))), fill=1)
    out = io.BytesIO()
    im.save(out, "PNG")
    return out.getvalue()


def write_masks(images: list[Path], folder: Path) -> list[Path]:
    masks = []
    for i, path in enumerate(images):
        with Image.open(path) as im:
            w, h = ImageOps.exif_transpose(im).size
        masks.append(folder / f"{i:05d}.png")
        masks[-1].write_bytes(blob_mask(w, h, i))
    return masks


class PairDataset(torch.utils.data.Dataset):
    """The usual way: PIL reads both files, torchvision v2 transforms them together."""

    def __init__(self, images: list[Path], masks: list[Path]):
        from torchvision.transforms import v2

        self.images, self.masks = images, masks
        self.tf = v2.Compose([v2.RandomResizedCrop(SIZE), v2.RandomHorizontalFlip()])

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        from torchvision import tv_tensors
        from torchvision.transforms.v2.functional import pil_to_tensor

        with Image.open(self.images[i]) as im:
            image = tv_tensors.Image(pil_to_tensor(ImageOps.exif_transpose(im).convert("RGB")))
        with Image.open(self.masks[i]) as m:
            mask = tv_tensors.Mask(torch.from_numpy(np.array(m)))
        return self.tf(image, mask)


def epoch(loader) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = 0
    for images, masks in loader:
        assert images.shape[-2:] == masks.shape[-2:] == (SIZE, SIZE)
        n += len(images)
    return time.perf_counter() - t0, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="/work/shared/data/hymenoptera")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    args = ap.parse_args()
    run = run_info()
    from gpucache import GpuCachedLoader, JpegCache
    from gpucache import transforms as T

    images = sorted(Path(args.data).rglob("*.jpg"))
    with tempfile.TemporaryDirectory() as tmp:
        masks = write_masks(images, Path(tmp))
        cache = JpegCache.from_files(images, masks=masks, progress=False)
        ours = GpuCachedLoader(
            cache,
            batch_size=BATCH,
            shuffle=True,
            seed=0,
            num_workers=WORKERS,
            device="cpu",
            backend="cpu",
            transform=[T.RandomResizedCrop(SIZE), T.RandomHorizontalFlip()],
        )
        peer = torch.utils.data.DataLoader(
            PairDataset(images, masks),
            batch_size=BATCH,
            shuffle=True,
            num_workers=WORKERS,
            persistent_workers=True,
        )
        loaders = {"gpucache": ours, "dataloader_pil_v2": peer}
        times: dict[str, list[float]] = {k: [] for k in loaders}
        for loader in loaders.values():  # workers started, caches warm: untimed
            epoch(loader)
        n = 0
        for _ in range(args.rounds):
            for name, loader in loaders.items():
                s, n = epoch(loader)
                times[name].append(s)
        ours.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "images": len(images),
        "store_mib": round(cache.nbytes / 2**20, 1) if hasattr(cache, "nbytes") else None,
        "batch_size": BATCH,
        "workers": WORKERS,
        "rounds": args.rounds,
        "seconds": times,
        "median_seconds": med,
        "images_per_second": {k: round(n / v, 1) for k, v in med.items()},
        "speedup": round(med["dataloader_pil_v2"] / med["gpucache"], 2),
    }
    for k, v in result["images_per_second"].items():
        print(f"{k:>20}: {v:8.1f} image+mask pairs/s (median of {args.rounds})")
    print(f"{'speedup':>20}: {result['speedup']:.2f}x")
    if args.out:
        write_json(args.out, result, run=run)


if __name__ == "__main__":
    main()
