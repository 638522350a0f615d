"""Ultralytics YOLO training from a gpucache store (the ``ultralytics`` extra).

    from ultralytics import YOLO
    import gpucache.ultralytics

    YOLO("yolo11n.yaml").train(data="data.yaml", trainer=gpucache.ultralytics.DetectionTrainer)

The trainers are Ultralytics' own with datasets whose ``load_image`` reads a store built once
per node in the node cache; ``cache="ram"`` (or ``True``, ``"disk"``) asks for the decoded tier
(every image decoded once at Ultralytics' size, one file per node mapped by every rank and
worker), ``cache=False`` for the raw tier (JPEGs decoded from the store at every load); a
dataset's ``gpucache_tier`` says which it reads (docs/guides/ultralytics.md). Importing
``gpucache`` never imports this module; importing this module needs Ultralytics.
"""

from __future__ import annotations

try:
    import ultralytics as _ultralytics  # noqa: F401  # the extra's check, before the names below
except ImportError as err:
    raise ImportError(
        "gpucache.ultralytics needs Ultralytics: pip install 'gpucache-loader[ultralytics]' "
        "(or pip install ultralytics)."
    ) from err

from ._datasets import ClassificationDataset, YOLODataset, build_yolo_dataset
from ._trainers import ClassificationTrainer, DetectionTrainer, SegmentationTrainer

__all__ = [
    "DetectionTrainer",
    "SegmentationTrainer",
    "ClassificationTrainer",
    "build_yolo_dataset",
    "YOLODataset",
    "ClassificationDataset",
]
