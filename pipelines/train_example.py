"""An example training loop: build (or open) a store, train a small CNN, check it on the training set.

    python -m pipelines.train_example --synthetic 256          # built-in synthetic photos
    python -m pipelines.train_example --data ROOT_OR_STORE     # an ImageFolder or a saved store

Runs on the GPU when one is present (decode on the GPU too), otherwise on the CPU with workers.
Prints a line an epoch: batches, images/s, loss, and the accuracy on the training images (eval
transform; no held-out split here, so it says how well the model fits, not how it generalizes).
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import torch
from torch import nn

from gpucache import JpegCache
from gpucache.testing import cached_jpeg_folder
from pipelines.imagenet import train_loader, val_loader


def small_cnn(num_classes: int) -> nn.Module:
    def block(i, o):
        return nn.Sequential(
            nn.Conv2d(i, o, 3, stride=2, padding=1), nn.BatchNorm2d(o), nn.ReLU(inplace=True)
        )

    return nn.Sequential(
        block(3, 16),
        block(16, 32),
        block(32, 64),
        block(64, 64),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, num_classes),
    )


def open_data(args) -> JpegCache:
    if args.data is None:
        return JpegCache.from_folder(cached_jpeg_folder(args.synthetic, seed=0))
    path = Path(args.data)
    return JpegCache.open(path) if path.is_file() else JpegCache.from_folder(path)


def main(argv=None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", help="ImageFolder root or saved store")
    p.add_argument("--synthetic", type=int, default=256, help="images to generate if no --data")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--size", type=int, default=128, help="crop size (224 for ImageNet)")
    p.add_argument("--workers", type=int, default=None)
    args = p.parse_args(argv)
    cache = open_data(args)
    log = logging.getLogger("train")
    log.info("%r", cache)
    with (
        train_loader(
            cache, batch_size=args.batch_size, size=args.size, num_workers=args.workers
        ) as train,
        val_loader(
            cache, batch_size=args.batch_size, size=args.size, num_workers=args.workers
        ) as val,
    ):
        model = small_cnn(len(cache.classes)).to(train.device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for epoch in range(args.epochs):
            model.train()
            t0, seen, loss_sum, batches = time.perf_counter(), 0, 0.0, 0
            for images, labels in train:
                loss = nn.functional.cross_entropy(model(images), labels)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                seen += len(labels)
                batches += 1
                loss_sum += loss.item() * len(labels)
            rate = seen / (time.perf_counter() - t0)
            model.eval()
            correct = total = 0
            with torch.no_grad():
                for images, labels in val:
                    correct += (model(images).argmax(1) == labels).sum().item()
                    total += len(labels)
            log.info(
                "epoch %d/%d: %d batches, %.0f img/s (%s backend, %s), loss %.3f, "
                "train-set acc %.3f",
                epoch + 1,
                args.epochs,
                batches,
                rate,
                train.backend_name,
                train.device,
                loss_sum / max(seen, 1),
                correct / max(total, 1),
            )
        log.info(
            "skipped samples: %d, decoded on CPU: %d", train.stats.skipped, train.stats.cpu_decoded
        )


if __name__ == "__main__":
    main()
