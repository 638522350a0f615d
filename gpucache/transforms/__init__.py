"""Batch transforms, split in two kinds.

Geometric transforms (:class:`RandomResizedCrop`, :class:`Resize`, :class:`CenterCrop`,
:class:`RandomHorizontalFlip`, :class:`Letterbox`, :class:`Pad`) never see pixels when they run: from each sample's stored height and
width and the loader's seeded generator they add to a per-sample *plan*, 11 integers::

    crop1 (top, left, height, width) in the decoded image   -> resize to (rh, rw)
    -> crop2 (top, left, height, width) in the resized image -> flip (0/1)

The plan is drawn in the main process, so the same seed gives the same crops whatever the worker
count or backend; each backend then executes it (per sample on the CPU, batched on the GPU).

Batch steps follow the geometry and run on the whole batch, on the output device: pixel ops
(:class:`ToDtype`, :class:`Normalize`, :class:`ColorJitter`, :class:`PerSample`, or any callable
such as a torchvision v2 transform) and ops that also change the labels (:class:`MixUp`,
:class:`CutMix`, :class:`WithLabels`). Random ones draw per sample from a generator seeded by
(seed, epoch, batch).

This module re-exports the public names; each kind lives in a module of its own: the base
classes (``_transform``), the geometric plans (``_geometric``), the pixel steps (``_pixel``), the
steps that change labels (``_mixing``), the batch generator (``_generator``), ``Compose``
(``_compose``) and the running of its steps (``_steps``).
"""

from __future__ import annotations

from ..base._plan import PLAN_FIELDS as PLAN_FIELDS  # the plan's columns by name
from ._boxes import map_boxes, map_points
from ._compose import Compose
from ._generator import batch_generator
from ._geometric import CenterCrop, Letterbox, Pad, RandomHorizontalFlip, RandomResizedCrop, Resize
from ._maskops import MapMaskValues
from ._mixing import CutMix, MixUp, WithLabels
from ._pixel import ColorJitter, Normalize, PerBatch, PerSample, ToDtype
from ._transform import Transform

__all__ = [
    "Compose",
    "RandomResizedCrop",
    "Resize",
    "CenterCrop",
    "RandomHorizontalFlip",
    "Letterbox",
    "Pad",
    "MapMaskValues",
    "ToDtype",
    "Normalize",
    "Transform",
    "ColorJitter",
    "MixUp",
    "CutMix",
    "PerSample",
    "PerBatch",
    "WithLabels",
    "batch_generator",
    "map_boxes",
    "map_points",
]
