"""The ``from_*`` builders for objects in storage (``s3://``, ``gs://``, ``az://`` URLs).

Always built once per node, in the node cache (its default folder without ``cache_dir``): the
node's first rank lists the objects (the key covers every URL with its size and ETag), fetches
them into a spool beside the store (resumed if a build was killed) and builds; the other ranks
wait and map the store, as for files. ``storage_options`` go to the client and nowhere else:
not into the key, the store, its records or a log line.
"""

from __future__ import annotations

import csv
import io
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ..ingest._inputs import Samples
from ..ingest._sources import Members, given
from ..ingest.storage._client import is_url, redact
from ..store._store import Store
from ._cache import built_for

if TYPE_CHECKING:
    from ..ingest._options import BuildOptions
    from ..ingest.storage._client import Listing

S = TypeVar("S", bound=Store)
MASKS_AT = "masks at"  # in a scan's extra: the listing's objects from the next value on are masks


def any_url(items: Any) -> bool:
    """True when a source names objects in storage (a URL, or a list holding one)."""
    if isinstance(items, os.PathLike):
        text = os.fspath(items)
        if isinstance(text, str) and re.match(r"(s3a?|gs|gcs|az|abfss?):/[^/]", text):
            raise ValueError(
                f"{text!r} looks like a URL turned into a path (pathlib folds its '//' into "
                f"'/'); pass the URL as a string: {text.replace(':/', '://', 1)!r}"
            )
        return False
    if isinstance(items, str):
        return is_url(items)
    try:
        return any(isinstance(x, str) and is_url(x) for x in items)
    except TypeError:
        return False


def _all_urls(items: Sequence[Any], what: str) -> list[str]:
    out = [os.fspath(x) if isinstance(x, os.PathLike) else x for x in items]
    local = [x for x in out if not (isinstance(x, str) and is_url(x))]
    if local:
        raise ValueError(
            f"{what} mixes URLs of objects in storage with other items (first: "
            f"{local[0]!r}); build one store from URLs and another from local files, or copy "
            "the data to one place"
        )
    return out


def from_folder(cls: type[S], root: str, options: BuildOptions, masks: str | None = None) -> S:
    """``JpegCache.from_folder`` of a prefix in ImageFolder layout (``s3://b/train/``), or of a
    prefix of unlabeled images with the prefix of their masks (``masks``)."""
    if masks is not None:
        return _folder_with_masks(cls, root, masks, options)
    from ..ingest.storage._listing import list_folder

    def scan() -> tuple[Listing, tuple[Any, ...]]:
        listing, labels, classes = list_folder(root, options.storage_options)
        return listing, (labels, classes, *options.keyed())

    make = _objects_maker(cls, options, metadata=False)
    request = (redact(root.rstrip("/") + "/"), *options.keyed())
    return built_for(cls, scan, make, request, options, remote=True)


def _folder_with_masks(cls: type[S], root: str, masks: str, options: BuildOptions) -> S:
    """Both prefixes listed and paired (``ingest.storage._paired``), fetched as one listing:
    the images, then their masks (the key covers both with their sizes and ETags)."""
    from ..ingest._build import check_labels
    from ..ingest.storage._paired import list_pairs

    def scan() -> tuple[Listing, tuple[Any, ...]]:
        listing, n = list_pairs(root, masks, options.storage_options)
        labels, classes = check_labels(n, None, None)
        return listing, (labels, classes, *options.keyed(), MASKS_AT, n)

    make = _objects_maker(cls, options, metadata=False)
    request = (
        redact(root.rstrip("/") + "/"),
        *options.keyed(),
        "masks",  # after the options, as for the other builders
        redact(masks.rstrip("/") + "/"),
    )
    return built_for(cls, scan, make, request, options, remote=True)


def from_files(
    cls: type[S],
    urls: Sequence[Any],
    labels: Any,
    metadata: Sequence[str] | None,
    classes: Sequence[str] | None,
    options: BuildOptions,
    masks: Sequence[Any] | None = None,
) -> S:
    """``JpegCache.from_files`` of object URLs (``masks``: their masks' URLs)."""
    from ..ingest.storage._listing import list_urls

    urls = _all_urls(urls, "the list")
    samples = given(len(urls), labels, classes, metadata)
    mask_urls = _mask_urls(masks, len(urls))

    def scan() -> tuple[Listing, tuple[Any, ...]]:
        listing = list_urls([*urls, *mask_urls], options.storage_options)
        extra = (samples.labels, samples.classes, samples.metadata, *options.keyed())
        return listing, (*extra, *_masks_at(masks, urls))

    make = _objects_maker(cls, options, metadata=True)
    request = ([redact(u) for u in urls], *options.keyed())
    if masks is not None:  # after the options: a store without masks keeps its key
        request = (*request, "masks", [redact(u) for u in mask_urls])
    return built_for(cls, scan, make, request, options, remote=True)


def _mask_urls(masks: Sequence[Any] | None, n: int) -> list[str]:
    """The masks' URLs (none without masks), one per image, all URLs."""
    if masks is None:
        return []
    if len(masks) != n:
        raise ValueError(f"masks has {len(masks)} entries for {n} items; give one mask per item.")
    return _all_urls(masks, "the masks")


def _masks_at(masks: Sequence[Any] | None, urls: Sequence[str]) -> tuple[Any, ...]:
    """What the scan's extra ends with when the listing's second half is masks: the marker and
    where they start (``_objects_maker`` reads it)."""
    return () if masks is None else (MASKS_AT, len(urls))


def csv_lists_urls(path: str | os.PathLike[str]) -> bool:
    """True for a CSV in storage, or a local CSV whose first file cell is a URL."""
    path = os.fspath(path)
    if is_url(path):
        return True
    try:
        with open(path, newline="", encoding="utf-8") as f:
            head = f.read(1 << 16)
    except (OSError, UnicodeDecodeError):
        return False  # the local builder reports it
    rows = [r for r in csv.reader(io.StringIO(head)) if r and r[0].strip()]
    return any(is_url(r[0].strip()) for r in rows[:2])


def from_csv(
    cls: type[S],
    path: str | os.PathLike[str],
    classes: Sequence[str] | None,
    delimiter: str,
    header: bool | None,
    options: BuildOptions,
    mask_column: str | int | None = None,
) -> S:
    """``JpegCache.from_csv`` of a CSV listing object URLs (the CSV itself local or in storage;
    its relative rows are taken against its own folder), read once per node."""
    from ..ingest._sources import read_csv
    from ..ingest.storage._listing import list_urls

    where = os.fspath(path)

    def scan() -> tuple[Listing, tuple[Any, ...]]:
        files, labels, names, meta, masks = read_csv(
            where,
            classes=classes,
            delimiter=delimiter,
            header=header,
            storage_options=options.storage_options,
            mask_column=mask_column,
        )
        urls = _all_urls(files, f"the CSV {redact(where)}")
        mask_urls = _mask_urls(masks, len(urls))
        extra = (labels, names, meta, *options.keyed(), *_masks_at(masks, urls))
        return list_urls([*urls, *mask_urls], options.storage_options), extra

    make = _objects_maker(cls, options, metadata=True)
    local = where if is_url(where) else os.path.abspath(where)
    request: tuple[Any, ...] = (redact(local), classes, delimiter, header, *options.keyed())
    if mask_column is not None:  # after the options: a store without masks keeps its key
        request = (*request, "masks", mask_column)
    return built_for(cls, scan, make, request, options, remote=True)


def from_webdataset(
    cls: type[S],
    shards: Any,
    classes: Sequence[str] | None,
    metadata_ext: str | None,
    options: BuildOptions,
    mask_ext: str | None = None,
) -> S:
    """``JpegCache.from_webdataset`` of shards in storage (``mask_ext``: the masks' member
    extension, fetched with the shards); brace patterns as WebDataset writes
    them (``train-{000..003}.tar``) and globs (``*.tar``) are expanded against the bucket."""
    from ..ingest.storage._listing import list_shards
    from ..ingest.storage._objects import build_shards

    patterns = _all_urls([shards] if isinstance(shards, str) else list(shards), "shards")
    extra = (classes, metadata_ext, *options.keyed())
    if mask_ext is not None:  # after the options: a store without masks keeps its key
        extra = (*extra, "masks", mask_ext)

    def scan() -> tuple[Listing, tuple[Any, ...]]:
        return list_shards(patterns, options.storage_options), extra

    def make(
        listing: Listing,
        extra: Sequence[Any],
        on_progress: Callable[..., None] | None,
        base: Path,
    ) -> S:
        members = Members(classes, metadata_ext, mask_ext)
        store: S = build_shards(cls, listing, options, members, base=base, on_progress=on_progress)
        return store

    request = ([redact(p) for p in patterns], *extra)
    return built_for(cls, scan, make, request, options, remote=True)


def _objects_maker(
    cls: type[S], options: BuildOptions, *, metadata: bool
) -> Callable[[Listing, Sequence[Any], Callable[..., None] | None, Path], S]:
    """The build step of a listing of objects: the scan's extra is (labels, classes[, metadata],
    ...)."""
    from ..ingest.storage._objects import build_objects

    def make(
        listing: Listing,
        extra: Sequence[Any],
        on_progress: Callable[..., None] | None,
        base: Path,
    ) -> S:
        store: S = build_objects(
            cls,
            listing,
            Samples(extra[0], extra[1], extra[2] if metadata else None),
            options,
            base=base,
            on_progress=on_progress,
            masks_at=extra[-1] if isinstance(extra[-2], str) and extra[-2] == MASKS_AT else None,
        )
        return store

    return make
