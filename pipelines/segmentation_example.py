"""Segmentation with Lightning on a store of image and mask pairs: train, val and test splits.

    python -m pipelines.segmentation_example --synthetic 96               # generated ISIC-like data
    python -m pipelines.segmentation_example --images ISIC-2017_Training_Data \\
        --masks ISIC-2017_Training_Part1_GroundTruth --size 224 --epochs 20

One store (``JpegCache.from_folder(images, masks=masks)``: ISIC 2017, Pascal VOC, ADE20K and
Cityscapes layouts pair in one call), split by index into train/val/test (80/10/10, seeded), each
split one ``GpuCachedLoader(indices=...)`` call: train with RandomResizedCrop + flip, val and test
with Resize + CenterCrop; each mask follows its image's crops and flips by nearest neighbour.
ISIC masks hold 0 and 255: ``T.MapMaskValues({0: 0, 255: 1})`` makes them class ids 0/1 on the
device. A tiny fully convolutional net is trained with cross entropy (``ignore_index=255``, the
loader's ``mask_fill``), and the test split's per-class IoU is printed.
"""

from __future__ import annotations

import argparse
import io
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import nn

from gpucache import GpuCachedLoader, JpegCache
from gpucache import transforms as T
from gpucache.testing import natural_image

try:
    import lightning as L
except ImportError as err:  # the example trains with Lightning, an extra of the clone
    raise SystemExit(
        "pipelines.segmentation_example trains with Lightning, which is not installed: "
        "pip install -e '.[lightning]' in the clone (or pip install lightning)."
    ) from err

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
IGNORE = 255


def synthetic_isic(n: int, root: Path) -> tuple[Path, Path]:
    """``n`` ISIC-like pairs: a photo with a dark lesion painted in, and its 0/255 mask
    (``ISIC_0000000.jpg`` and ``ISIC_0000000_segmentation.png`` in parallel folders)."""
    from PIL import Image, ImageDraw

    images, masks = root / "images", root / "masks"
    images.mkdir(parents=True, exist_ok=True)
    masks.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        w, h = int(rng.integers(120, 200)), int(rng.integers(100, 160))
        mask = Image.new("L", (w, h), 0)
        cx, cy, r = w * rng.uniform(0.3, 0.7), h * rng.uniform(0.3, 0.7), min(w, h) * 0.25
        t = np.linspace(0, 2 * np.pi, 24, endpoint=False)
        k = 1 + 0.2 * rng.standard_normal(24)
        pts = list(zip(cx + r * k * np.cos(t), cy + r * k * np.sin(t)))
        ImageDraw.Draw(mask).polygon(pts, fill=255)
        photo = natural_image(w, h, seed=i).copy()
        lesion = np.asarray(mask) > 0
        photo[lesion] = (photo[lesion] * 0.3 + np.array([90, 40, 30]) * 0.7).astype(np.uint8)
        out = io.BytesIO()
        Image.fromarray(photo).save(out, "JPEG", quality=90)
        (images / f"ISIC_{i:07d}.jpg").write_bytes(out.getvalue())
        mask.save(masks / f"ISIC_{i:07d}_segmentation.png")
    return images, masks


def splits(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Train/val/test store indices, 80/10/10, from one seeded permutation."""
    order = np.random.default_rng(seed).permutation(n)
    a, b = int(n * 0.8), int(n * 0.9)
    return {"train": np.sort(order[:a]), "val": np.sort(order[a:b]), "test": np.sort(order[b:])}


def small_fcn(classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=2, dilation=2),
        nn.ReLU(),
        nn.Conv2d(16, classes, 1),
    )


class Segmenter(L.LightningModule):
    def __init__(self, *, cache: JpegCache, size: int, batch_size: int, workers: int, lr: float):
        super().__init__()
        self.cache, self.size, self.batch_size, self.workers = cache, size, batch_size, workers
        self.lr, self.classes = lr, 2
        self.model = small_fcn(self.classes)
        self.parts = splits(len(cache))
        self.confusion = torch.zeros(self.classes, self.classes, dtype=torch.long)

    def loader(self, part: str) -> GpuCachedLoader:
        s = self.size
        geometry = (
            [T.RandomResizedCrop(s, scale=(0.3, 1.0)), T.RandomHorizontalFlip()]
            if part == "train"
            else [T.Resize(s), T.CenterCrop(s)]
        )
        return GpuCachedLoader(
            self.cache,
            indices=self.parts[part],
            batch_size=self.batch_size,
            shuffle=part == "train",
            seed=0,
            num_workers=self.workers,
            device=self.device,
            mask_fill=IGNORE,
            transform=[*geometry, T.Normalize(MEAN, STD), T.MapMaskValues({0: 0, 255: 1})],
        )

    def train_dataloader(self) -> GpuCachedLoader:
        return self.loader("train")

    def val_dataloader(self) -> GpuCachedLoader:
        return self.loader("val")

    def test_dataloader(self) -> GpuCachedLoader:
        return self.loader("test")

    def _loss(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        images, masks = batch
        logits = self.model(images)
        return nn.functional.cross_entropy(logits, masks.long(), ignore_index=IGNORE), logits

    def training_step(self, batch, batch_idx):
        loss, _ = self._loss(batch)
        self.log("loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss, _ = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True)

    def test_step(self, batch, batch_idx):
        _, masks = batch
        loss, logits = self._loss(batch)
        pred, want = logits.argmax(1).flatten(), masks.long().flatten()
        keep = want != IGNORE
        pairs = want[keep] * self.classes + pred[keep]
        self.confusion += (
            torch.bincount(pairs, minlength=self.classes**2).view(self.classes, self.classes).cpu()
        )
        self.log("test_loss", loss)

    def iou(self) -> list[float]:
        """Per-class intersection over union from the test split's confusion matrix."""
        c = self.confusion.double()
        inter = c.diag()
        union = c.sum(0) + c.sum(1) - inter
        return (inter / union.clamp(min=1)).tolist()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", help="image folder (with --masks)")
    p.add_argument("--masks", help="mask folder, paired by relative path and stem")
    p.add_argument("--synthetic", type=int, default=96, help="pairs to generate if no --images")
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.01)
    args = p.parse_args(argv)
    if args.images:
        if not args.masks:
            p.error("--images needs --masks (the folder of their masks)")
        images, masks = Path(args.images), Path(args.masks)
    else:
        root = Path(tempfile.gettempdir()) / f"gpucache-isic-like-{args.synthetic}-{os.getuid()}"
        images, masks = synthetic_isic(args.synthetic, root)
    cache = JpegCache.from_folder(images, masks=masks, progress=False)
    model = Segmenter(
        cache=cache,
        size=args.size,
        batch_size=args.batch_size,
        workers=args.workers,
        lr=args.lr,
    )
    trainer = L.Trainer(
        max_epochs=args.epochs,
        accelerator="auto",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    trainer.test(model, verbose=False)
    for name, value in zip(("background", "lesion"), model.iou()):
        print(f"test IoU {name}: {value:.3f}")
    print(f"test mIoU: {sum(model.iou()) / model.classes:.3f}")


if __name__ == "__main__":
    main()
