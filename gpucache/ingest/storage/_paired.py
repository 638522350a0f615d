"""A prefix of images with the prefix of their masks, listed and paired:
``JpegCache.from_folder("s3://b/images/", masks="s3://b/masks/")``.

Both prefixes are listed whole, in bounded pages (``_pages``; keys kept exact, ``//`` and any
character included). As on a disk (``.._pairs``): every image under the image prefix (any
depth, ImageFolder's extensions; a mask prefix inside it left out) is a sample without a class
label, in the order ``pair_folder`` gives the same tree (folders by path, files by name), and
its mask is the object of the same relative folder under the mask prefix that
``.._pairs.find_mask`` picks. The listing holds the images, then one mask an image, so one
fetch and one check that nothing changed cover both; an image without a mask has a missing
mask there (named and explained as on a disk), and the build reports the image with it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from .._build import IMG_EXTENSIONS
from .._pairs import MASK_EXTENSIONS, NO_MASK, find_mask, looked_for
from ._client import Listed, Listing, filesystem, protocol_of, redact, strip
from ._listing import _Names, _order, _Packer
from ._pages import _Budget, _entries

_Folder = tuple[int, str]  # a name's folder in ImageFolder's order (``_listing._order``)


def list_pairs(
    url: str, mask_url: str, storage_options: dict[str, Any] | None, fs: Any = None
) -> tuple[Listing, int]:
    """``(listing, n)``: the ``n`` images under ``url`` then their ``n`` masks under
    ``mask_url`` (a mask that was not found kept as missing, with its reason)."""
    proto = protocol_of(url)
    if protocol_of(mask_url) != proto:
        raise ValueError(
            f"the images ({redact(url)}) and their masks ({redact(mask_url)}) are in different "
            "storage services; put both in one (a bucket, or two buckets of one service)"
        )
    fs = fs or filesystem(url, storage_options)
    where = f"{redact(url)} with masks {redact(mask_url)}"
    budget = _Budget(where)
    mask_base = _base(mask_url)
    images_base = _base(url)
    inside = mask_base[len(images_base) :] if mask_base.startswith(images_base) else None
    images = _listed(fs, url, budget, IMG_EXTENSIONS, skip=inside)
    if not len(images):
        raise FileNotFoundError(
            f"found no image under {redact(url)} (extensions {', '.join(IMG_EXTENSIONS)})"
        )
    masks = _listed(fs, mask_url, budget, MASK_EXTENSIONS)
    if not len(masks):
        raise FileNotFoundError(
            f"found no mask under {redact(mask_url)} (extensions {', '.join(MASK_EXTENSIONS)}); "
            "from_folder(root, masks=MASK_ROOT) takes a prefix of images and the prefix of "
            "their masks, in the same relative folders"
        )
    pack, n = _Packer(), 0
    mask_parts: list[tuple[str, _Names]] = []  # one a folder: added after every image
    missing: list[int] = []  # images without a mask
    mask_groups = _groups(masks)
    pending = next(mask_groups, None)
    for folder, members in _groups(images):
        while pending is not None and pending[0] < folder:
            pending = next(mask_groups, None)
        here: dict[str, int] = {}
        if pending is not None and pending[0] == folder:
            here = {masks.name(j).rpartition("/")[2]: j for j in pending[1]}
        rel = f"{folder[1]}/" if folder[0] else ""
        taken, paired = _Names(), _Names()
        for i in members:
            name = images.name(i).rpartition("/")[2]
            taken.add(name, images.sizes[i], images.tags[i])
            stem = os.path.splitext(name)[0]
            found = find_mask(stem, here)
            if found is None:
                missing.append(n)
                paired.add(looked_for(stem), -1, 0)
            else:
                j = here[found]
                paired.add(found, masks.sizes[j], masks.tags[j])
            n += 1
        pack.add(images_base + rel, taken)
        mask_parts.append((mask_base + rel, paired))
    for prefix, paired in mask_parts:
        pack.add(prefix, paired)
    listing = pack.listing(
        proto, Listed(where, fs, lambda: list_pairs(url, mask_url, storage_options, fs)[0])
    )
    listing.missing = {n + k: NO_MASK for k in missing}
    return listing, n


def _base(url: str) -> str:
    """``proto://bucket/prefix/`` of a URL (a prefix ends with one slash; none at the top)."""
    bucket, _, key = strip(url).partition("/")
    prefix = key.rstrip("/") + "/" if key.strip("/") else ""
    return f"{protocol_of(url)}://{bucket}/{prefix}"


def _listed(
    fs: Any, url: str, budget: _Budget, extensions: tuple[str, ...], *, skip: str | None = None
) -> _Names:
    """The objects under the prefix ``url`` whose names end in one of ``extensions`` (images:
    any case, as ImageFolder; masks: as ``find_mask`` names them), relative to it, in
    ImageFolder's order; ``skip``: a relative folder left out (the masks inside the images)."""
    base = _base(url)
    bucket, _, prefix = strip(base).partition("/")
    lower = extensions == IMG_EXTENSIONS
    names = _Names()
    with budget.stops_all():
        for page in _entries(fs, base, bucket, prefix, budget):
            for key, size, tag in page:
                rel = key[len(prefix) :]
                if skip is not None and rel.startswith(skip):
                    continue
                if (rel.lower() if lower else rel).endswith(extensions):
                    names.add(rel, size, tag)
    return names.ordered()


def _groups(names: _Names) -> Iterator[tuple[_Folder, range]]:
    """Each folder of ``names`` (in ImageFolder's order) with the range of its names."""
    start, folder = 0, None
    for i in range(len(names)):
        here = _order(names.name(i))[:2]
        if here != folder:
            if folder is not None:
                yield folder, range(start, i)
            start, folder = i, here
    if folder is not None:
        yield folder, range(start, len(names))
