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
mask paths looked for. Prefixes in object storage are paired by the same rule
(``storage._paired``). Each mask folder is listed once: O(files), no stat per candidate; the
pairs are packed paths (``PathList``), not a ``str`` per file.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Container
from pathlib import Path

from ._build import IMG_EXTENSIONS, PathList
from ._inputs import Refused
from ._lazy import OnAccess

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


#: Why an image without a mask is a bad input (the mask's name is :func:`looked_for`).
NO_MASK = (
    "no mask file for this image (looked for the stem, and the stem less its last _word, with "
    "the mask suffixes of docs/guides/segmentation.md)"
)


def looked_for(stem: str) -> str:
    """The name a missing mask is reported by, in the folder where it was looked for."""
    return f"{stem}[_suffix].png"


def find_mask(stem: str, names: Container[str]) -> str | None:
    """The mask file name (among ``names``, one folder's files) of an image of stem ``stem``."""
    for key in _keys(stem):
        for suffix in ("", *MASK_SUFFIXES):
            for ext in MASK_EXTENSIONS:
                if key + suffix + ext in names:
                    return key + suffix + ext
    return None


class _Packer:
    """Paths packed as ``PathList`` packs them: a folder index and the name's bytes a path."""

    def __init__(self) -> None:
        self.prefixes: list[str] = []
        self.folder_of, self.ends, self.blob = array("I"), array("Q"), bytearray()

    def folder(self, path: str) -> None:
        self.prefixes.append(os.path.join(path, ""))

    def add(self, name: bytes) -> None:
        self.folder_of.append(len(self.prefixes) - 1)
        self.blob += name
        self.ends.append(len(self.blob))

    def paths(self) -> PathList:
        return PathList(self.prefixes, self.folder_of, self.ends, bytes(self.blob))


class PairedMasks(OnAccess[str | Refused]):
    """Each image's mask path, packed, or a :class:`Refused` input where it has none."""

    def __init__(self, paths: PathList, missing: dict[int, Refused]) -> None:
        self._paths, self._missing = paths, missing

    def __len__(self) -> int:
        return len(self._paths)

    def item(self, i: int) -> str | Refused:
        refused = self._missing.get(i)
        return refused if refused is not None else self._paths[i]


def pair_folder(root: Path, mask_root: Path) -> tuple[PathList, PairedMasks]:
    """``(images, masks)``: every image under ``root`` with its mask under ``mask_root`` (a
    :class:`Refused` input naming where it was looked for, where there is none). Packed: about
    25 bytes a path, no ``str`` kept per file."""
    for name, given in (("root", root), ("masks", mask_root)):
        if not given.is_dir():
            raise (NotADirectoryError if given.exists() else FileNotFoundError)(
                f"{name} {given} is not a folder; from_folder(root, masks=MASK_ROOT) takes a "
                "folder of images and the folder of their masks"
            )
    skip = os.path.realpath(mask_root)
    images, masks = _Packer(), _Packer()
    missing: dict[int, Refused] = {}
    for folder, _, files in sorted(os.walk(root, followlinks=True)):
        real = os.path.realpath(folder)
        if real == skip or real.startswith(os.path.join(skip, "")):
            continue
        picked = sorted(f for f in files if f.lower().endswith(IMG_EXTENSIONS))
        if not picked:
            continue
        where = os.path.normpath(os.path.join(mask_root, os.path.relpath(folder, root)))
        try:
            names = set(os.listdir(where))
        except OSError:
            names = set()
        images.folder(folder)
        masks.folder(where)
        for f in picked:
            stem = os.path.splitext(f)[0]
            found = find_mask(stem, names)
            if found is None:
                missing[len(images.ends)] = Refused(os.path.join(where, looked_for(stem)), NO_MASK)
            images.add(os.fsencode(f))
            masks.add(os.fsencode(found or ""))
    if not images.ends:
        raise FileNotFoundError(
            f"found no image under {root} (extensions {', '.join(IMG_EXTENSIONS)})"
        )
    return images.paths(), PairedMasks(masks.paths(), missing)
