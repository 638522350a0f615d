"""Images and their masks from two folders: ``JpegCache.from_folder(root, masks=MASK_ROOT)``.

With masks, ``root`` is not an ImageFolder class tree: every image file under it (any depth, the
extensions ImageFolder takes, sorted by path; a ``MASK_ROOT`` inside ``root`` is left out) is a
sample without a class label, and its mask is found in the same relative folder under
``MASK_ROOT`` by this rule, the first file that exists winning:

1. key: the image's stem, then the stem less its last ``_word`` (``x_leftImg8bit`` -> ``x``);
2. suffix, for each key: none, then :data:`MASK_SUFFIXES` in order;
3. extension, for each name: ``.png``, then the other lossless ones of :data:`MASK_EXTENSIONS`.

So ``ISIC_0000000.jpg`` pairs with ``ISIC_0000000_segmentation.png`` (ISIC 2017),
``JPEGImages/x.jpg`` with ``SegmentationClass/x.png`` (Pascal VOC), ``images/training/x.jpg``
with ``annotations/training/x.png`` (ADE20K) and ``leftImg8bit/train/city/x_leftImg8bit.png``
with ``gtFine/train/city/x_gtFine_labelIds.png`` (Cityscapes; not its ``_color`` or
``_instanceIds`` files). An image without a mask is a bad input (``on_error``), named with the
mask paths looked for. Each mask folder is listed once: O(files), no stat per candidate.
"""

from __future__ import annotations

import os
from pathlib import Path

from ._build import IMG_EXTENSIONS
from ._inputs import Refused

#: Mask name suffixes tried after the bare key, in order (docs/guides/segmentation.md).
MASK_SUFFIXES = (
    "_segmentation",  # ISIC
    "_mask",
    "_gtFine_labelIds",  # Cityscapes, fine annotations
    "_gtCoarse_labelIds",  # Cityscapes, coarse annotations
    "_labelIds",
    "_label",
    "_labels",
    "_seg",
    "_gt",
)
#: Mask extensions tried, in order (lossless formats only: never a JPEG).
MASK_EXTENSIONS = (".png", ".bmp", ".tif", ".tiff", ".gif", ".pgm", ".ppm")


def _keys(stem: str) -> list[str]:
    head, sep, _ = stem.rpartition("_")
    return [stem, head] if sep and head else [stem]


def find_mask(stem: str, names: set[str]) -> str | None:
    """The mask file name (among ``names``, one folder's files) of an image of stem ``stem``."""
    for key in _keys(stem):
        for suffix in ("", *MASK_SUFFIXES):
            for ext in MASK_EXTENSIONS:
                if key + suffix + ext in names:
                    return key + suffix + ext
    return None


def pair_folder(root: Path, mask_root: Path) -> tuple[list[str], list[str | Refused]]:
    """``(images, masks)``: every image under ``root`` with its mask under ``mask_root`` (a
    :class:`Refused` input naming where it was looked for, where there is none)."""
    for name, given in (("root", root), ("masks", mask_root)):
        if not given.is_dir():
            raise (NotADirectoryError if given.exists() else FileNotFoundError)(
                f"{name} {given} is not a folder; from_folder(root, masks=MASK_ROOT) takes a "
                "folder of images and the folder of their masks"
            )
    skip = os.path.realpath(mask_root)
    images: list[str] = []
    masks: list[str | Refused] = []
    for folder, _, files in sorted(os.walk(root, followlinks=True)):
        real = os.path.realpath(folder)
        if real == skip or real.startswith(os.path.join(skip, "")):
            continue
        picked = sorted(f for f in files if f.lower().endswith(IMG_EXTENSIONS))
        if not picked:
            continue
        rel = os.path.relpath(folder, root)
        where = os.path.normpath(os.path.join(mask_root, rel))
        try:
            names = set(os.listdir(where))
        except OSError:
            names = set()
        for f in picked:
            stem = os.path.splitext(f)[0]
            found = find_mask(stem, names)
            images.append(os.path.join(folder, f))
            masks.append(
                os.path.join(where, found)
                if found is not None
                else Refused(
                    os.path.join(where, f"{stem}[_suffix].png"),
                    "no mask file for this image (looked for the stem, and the stem less its "
                    "last _word, with the mask suffixes of docs/guides/segmentation.md)",
                )
            )
    if not images:
        raise FileNotFoundError(
            f"found no image under {root} (extensions {', '.join(IMG_EXTENSIONS)})"
        )
    return images, masks
