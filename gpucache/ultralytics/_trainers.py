"""Ultralytics' trainers whose datasets read a gpucache store (``trainer=`` of ``YOLO.train``).

Each is Ultralytics' own trainer with ``build_dataset`` replaced, so its training and its
validation during training read the store; everything else (model, loss, optimiser, callbacks,
DDP) is Ultralytics'. ``gpucache_cache_dir``: the node cache folder the stores (and the decoded
tier) are built in; None: gpucache's default one. Set it on a subclass to choose another.
"""

from __future__ import annotations

from typing import Any, ClassVar

from ultralytics.models.yolo.classify import ClassificationTrainer as _UClassificationTrainer
from ultralytics.models.yolo.detect import DetectionTrainer as _UDetectionTrainer
from ultralytics.models.yolo.segment import SegmentationTrainer as _USegmentationTrainer
from ultralytics.utils.torch_utils import unwrap_model

from ._datasets import ClassificationDataset, build_yolo_dataset

__all__ = ["DetectionTrainer", "SegmentationTrainer", "ClassificationTrainer"]


def _yolo_dataset(trainer: Any, img_path: str, mode: str, batch: int | None) -> Any:
    """What Ultralytics' ``DetectionTrainer.build_dataset`` makes, reading the store."""
    gs = max(int(unwrap_model(trainer.model).stride.max()), 32)
    return build_yolo_dataset(
        trainer.args,
        img_path,
        batch,  # type: ignore[arg-type]  # None outside rect mode, as Ultralytics passes it
        trainer.data,
        mode=mode,
        rect=mode == "val",
        stride=gs,
        cache_dir=trainer.gpucache_cache_dir,
    )


class DetectionTrainer(_UDetectionTrainer):  # type: ignore[misc]  # ultralytics has no types
    """Ultralytics' ``DetectionTrainer`` with its images from a gpucache store."""

    gpucache_cache_dir: ClassVar[str | None] = None

    def build_dataset(self, img_path: str, mode: str = "train", batch: int | None = None) -> Any:
        return _yolo_dataset(self, img_path, mode, batch)


class SegmentationTrainer(_USegmentationTrainer):  # type: ignore[misc]
    """Ultralytics' ``SegmentationTrainer`` with its images from a gpucache store (polygons
    stay Ultralytics' labels)."""

    gpucache_cache_dir: ClassVar[str | None] = None

    def build_dataset(self, img_path: str, mode: str = "train", batch: int | None = None) -> Any:
        return _yolo_dataset(self, img_path, mode, batch)


class ClassificationTrainer(_UClassificationTrainer):  # type: ignore[misc]
    """Ultralytics' ``ClassificationTrainer`` with its images from a gpucache store and its
    classes from the store's labels."""

    gpucache_cache_dir: ClassVar[str | None] = None

    def build_dataset(self, img_path: str, mode: str = "train", batch: int | None = None) -> Any:
        return ClassificationDataset(
            img_path,
            self.args,
            augment=mode == "train",
            prefix="train" if mode == "train" else self.args.split,
            names=self.data["names"],
            cache_dir=self.gpucache_cache_dir,
        )
