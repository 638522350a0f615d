"""Lightning DDP on a store: a LightningModule whose train_dataloader is a GpuCachedLoader.

    python -m pipelines.lightning_example --data imagenet/train --devices 4 --accelerator gpu
    python -m pipelines.lightning_example --data ROOT --resume last.ckpt      # mid-epoch resume

Each DDP rank calls ``setup()`` and ``train_dataloader()`` after the process group is up, so
``JpegCache.from_folder`` builds once per node and the loader shards by the group's world size and
rank with rank 0's seed. Lightning saves the loader's ``state_dict()`` in its checkpoints (the loader is stateful) and
hands it back to ``load_state_dict()`` on ``Trainer.fit(ckpt_path=...)``, so training resumes after
the last batch of the checkpoint, at any world size. ``--record`` writes the labels each rank trains
on (tests/test_lightning.py uses data with one image per class, so a label names its sample).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning as L
import torch
from torch import nn

from gpucache import GpuCachedLoader, JpegCache
from gpucache import transforms as T


class StoreClassifier(L.LightningModule):
    def __init__(
        self,
        *,
        data: str,
        batch_size: int = 8,
        size: int = 32,
        workers: int = 2,
        lr: float = 0.05,
        record: str | None = None,
        fail_at_step: int | None = None,
    ):
        super().__init__()
        self.save_hyperparameters()
        classes = sorted(d.name for d in Path(data).iterdir() if d.is_dir())  # ImageFolder's
        self.model = nn.Sequential(
            nn.Conv2d(3, 8, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(8, len(classes)),
        )
        self.cache: JpegCache | None = None

    def setup(self, stage: str) -> None:
        # in every rank, after the process group is up: built once per node, mapped by all ranks
        self.cache = JpegCache.from_folder(self.hparams.data, progress=False)

    def train_dataloader(self) -> GpuCachedLoader:
        h = self.hparams
        return GpuCachedLoader(
            self.cache,
            batch_size=h.batch_size,
            shuffle=True,
            num_workers=h.workers,
            device=self.device,
            transform=T.Compose(
                [
                    T.RandomResizedCrop(h.size),
                    T.RandomHorizontalFlip(),
                    T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
                ]
            ),
        )

    def training_step(self, batch, batch_idx):
        images, labels = batch
        if self.hparams.fail_at_step == self.global_step:
            raise RuntimeError(f"stopping at step {self.global_step} on purpose (--fail-at-step)")
        if self.hparams.record:
            with open(Path(self.hparams.record) / f"seen-{self.global_rank}.jsonl", "a") as f:
                f.write(
                    json.dumps(
                        {"epoch": self.current_epoch, "batch": batch_idx, "labels": labels.tolist()}
                    )
                    + "\n"
                )
        loss = nn.functional.cross_entropy(self.model(images), labels)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="ImageFolder root")
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--checkpoints", default="checkpoints", help="folder for checkpoints")
    p.add_argument("--every-n-steps", type=int, default=None, help="checkpoint every N steps")
    p.add_argument("--resume", help="checkpoint to resume from")
    p.add_argument("--record", help="folder for the labels each rank trains on")
    p.add_argument("--fail-at-step", type=int, help="raise at this global step (a crash)")
    args = p.parse_args(argv)
    model = StoreClassifier(
        data=args.data,
        batch_size=args.batch_size,
        workers=args.workers,
        record=args.record,
        fail_at_step=args.fail_at_step,
    )
    ckpt = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=args.checkpoints, save_top_k=-1, every_n_train_steps=args.every_n_steps
    )
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy="ddp",
        max_epochs=args.epochs,
        callbacks=[ckpt],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, ckpt_path=args.resume)


if __name__ == "__main__":
    main()
