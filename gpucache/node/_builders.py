"""How ``JpegCache.from_folder``, ``from_files``, ``from_csv``, ``from_webdataset`` and ``from_hf``
build: scan the input, build once per node under the node lock (``_cache.built_once``), or go
through a source (``gpucache.ingest._sources``).

The store is the lowest layer and imports nothing above it, yet users call these builders on
``JpegCache``. So the classmethods in ``store/_store.py`` keep their signatures and docstrings
(the public API and its reference) and only look their implementation up in
``gpucache.store._store.BUILDERS``; this module, in the node layer that orchestrates the layers
below it, fills that table when it is imported. ``gpucache/__init__.py`` imports it, and Python
runs that before any ``gpucache.*`` module, so the table is full wherever a ``JpegCache`` exists.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ..store import _store
from ..store._limits import DEFAULT_MAX_PIXELS
from . import _storage
from ._storage import any_url, csv_lists_urls

if TYPE_CHECKING:
    from ..store._store import JpegCache
    from ._cache import Listing


def _options(args: dict[str, Any]) -> dict[str, Any]:
    """The build options among a builder's arguments (``locals()``), for ``_storage`` (which
    takes the object-storage ones by name)."""
    return {k: args[k] for k in _store.BUILD_OPTIONS}


def from_folder(
    cls: type[JpegCache],
    root: str | os.PathLike[str],
    *,
    on_error: Literal["skip", "raise"] = "skip",
    num_threads: int | None = None,
    progress: bool = True,
    max_pixels: int | None = DEFAULT_MAX_PIXELS,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_max_bytes: int | None = None,
    restart_markers: bool = False,
    max_side: int | None = None,
    jpeg_quality: int | None = None,
    storage_options: dict[str, Any] | None = None,
    requests_in_flight: int | None = None,
) -> JpegCache:
    """``JpegCache.from_folder`` (see its docstring)."""
    if any_url(root):  # a prefix in storage (s3://bucket/train/)
        return _storage.from_folder(
            cls,
            os.fspath(root),
            storage_options=storage_options,
            requests_in_flight=requests_in_flight,
            **_options(locals()),
        )
    from ..ingest._build import build, scan_folder
    from ._cache import built_once

    def scan() -> Listing:
        paths, labels, classes = scan_folder(Path(root))
        return paths, (
            labels,
            classes,
            on_error,
            max_pixels,
            restart_markers,
            max_side,
            jpeg_quality,
        )

    cache = built_once(
        cls,
        scan,
        lambda paths, extra, on_progress: build(
            cls,
            paths,
            extra[0],
            extra[1],
            None,
            on_error=on_error,
            num_threads=num_threads,
            progress=progress,
            max_pixels=max_pixels,
            on_progress=on_progress,
            restart_markers=restart_markers,
            max_side=max_side,
            jpeg_quality=jpeg_quality,
        ),
        (os.path.abspath(root), on_error, max_pixels, restart_markers, max_side, jpeg_quality),
        cache_dir=cache_dir,
        max_bytes=cache_max_bytes,
    )
    cache.max_pixels = max_pixels
    return cache


def from_files(
    cls: type[JpegCache],
    paths: Sequence[str | os.PathLike[str]],
    labels: Sequence[int] | None = None,
    metadata: Sequence[str] | None = None,
    *,
    classes: Sequence[str] | None = None,
    on_error: Literal["skip", "raise"] = "skip",
    num_threads: int | None = None,
    progress: bool = True,
    max_pixels: int | None = DEFAULT_MAX_PIXELS,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_max_bytes: int | None = None,
    restart_markers: bool = False,
    max_side: int | None = None,
    jpeg_quality: int | None = None,
    storage_options: dict[str, Any] | None = None,
    requests_in_flight: int | None = None,
) -> JpegCache:
    """``JpegCache.from_files`` (see its docstring)."""
    if any_url(paths):  # object URLs
        return _storage.from_files(
            cls,
            paths,
            labels,
            metadata,
            classes=classes,
            storage_options=storage_options,
            requests_in_flight=requests_in_flight,
            **_options(locals()),
        )
    from ..ingest import _sources
    from ._cache import built_once

    extra = (
        labels,
        metadata,
        classes,
        on_error,
        max_pixels,
        restart_markers,
        max_side,
        jpeg_quality,
    )
    cache = built_once(
        cls,
        lambda: (paths, extra),
        lambda paths, _, on_progress: _sources.from_files(
            cls,
            paths,
            labels,
            metadata,
            classes=classes,
            on_error=on_error,
            num_threads=num_threads,
            progress=progress,
            max_pixels=max_pixels,
            on_progress=on_progress,
            restart_markers=restart_markers,
            max_side=max_side,
            jpeg_quality=jpeg_quality,
        ),
        (paths, *extra),
        cache_dir=cache_dir,
        max_bytes=cache_max_bytes,
    )
    cache.max_pixels = max_pixels
    return cache


def from_csv(
    cls: type[JpegCache],
    path: str | os.PathLike[str],
    *,
    classes: Sequence[str] | None = None,
    delimiter: str = ",",
    header: bool | None = None,
    on_error: Literal["skip", "raise"] = "skip",
    num_threads: int | None = None,
    progress: bool = True,
    max_pixels: int | None = DEFAULT_MAX_PIXELS,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_max_bytes: int | None = None,
    restart_markers: bool = False,
    max_side: int | None = None,
    jpeg_quality: int | None = None,
    storage_options: dict[str, Any] | None = None,
    requests_in_flight: int | None = None,
) -> JpegCache:
    """``JpegCache.from_csv`` (see its docstring): the CSV read once, the files it lists built
    (once per node with ``cache_dir`` or several ranks, keyed on those files)."""
    if csv_lists_urls(path):  # a CSV in storage, or one listing object URLs
        return _storage.from_csv(
            cls,
            path,
            classes=classes,
            delimiter=delimiter,
            header=header,
            storage_options=storage_options,
            requests_in_flight=requests_in_flight,
            **_options(locals()),
        )
    from ..ingest._build import build
    from ..ingest._sources import read_csv
    from ._cache import built_once

    options = (on_error, max_pixels, restart_markers, max_side, jpeg_quality)

    def scan() -> Listing:
        files, labels, names, meta = read_csv(
            path, classes=classes, delimiter=delimiter, header=header
        )
        return files, (labels, names, meta, *options)

    cache = built_once(
        cls,
        scan,
        lambda files, extra, on_progress: build(
            cls,
            files,
            extra[0],
            extra[1],
            extra[2],
            on_error=on_error,
            num_threads=num_threads,
            progress=progress,
            max_pixels=max_pixels,
            on_progress=on_progress,
            restart_markers=restart_markers,
            max_side=max_side,
            jpeg_quality=jpeg_quality,
        ),
        (os.path.abspath(path), classes, delimiter, header, *options),
        cache_dir=cache_dir,
        max_bytes=cache_max_bytes,
    )
    cache.max_pixels = max_pixels
    return cache


def from_webdataset(
    cls: type[JpegCache],
    shards: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    *,
    classes: Sequence[str] | None = None,
    metadata_ext: str | None = None,
    on_error: Literal["skip", "raise"] = "skip",
    num_threads: int | None = None,
    progress: bool = True,
    max_pixels: int | None = DEFAULT_MAX_PIXELS,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_max_bytes: int | None = None,
    restart_markers: bool = False,
    max_side: int | None = None,
    jpeg_quality: int | None = None,
    storage_options: dict[str, Any] | None = None,
    requests_in_flight: int | None = None,
) -> JpegCache:
    """``JpegCache.from_webdataset`` (see its docstring): built once per node with ``cache_dir``
    or several ranks, keyed on the shard files."""
    if any_url(shards):  # shards in storage, brace patterns expanded
        return _storage.from_webdataset(
            cls,
            shards,
            classes=classes,
            metadata_ext=metadata_ext,
            storage_options=storage_options,
            requests_in_flight=requests_in_flight,
            **_options(locals()),
        )
    from ..ingest import _sources
    from ..ingest._patterns import expand_local
    from ._cache import built_once

    listed = expand_local(  # brace patterns and globs, as for URLs
        [os.fspath(shards)]
        if isinstance(shards, (str, os.PathLike))
        else [os.fspath(s) for s in shards]
    )
    extra = (classes, metadata_ext, on_error, max_pixels, restart_markers, max_side, jpeg_quality)
    cache = built_once(
        cls,
        lambda: (listed, extra),
        lambda listed, _, on_progress: _sources.from_webdataset(
            cls,
            listed,
            classes=classes,
            metadata_ext=metadata_ext,
            on_error=on_error,
            num_threads=num_threads,
            progress=progress,
            max_pixels=max_pixels,
            on_progress=on_progress,
            restart_markers=restart_markers,
            max_side=max_side,
            jpeg_quality=jpeg_quality,
        ),
        ([os.path.abspath(s) for s in listed], *extra),
        cache_dir=cache_dir,
        max_bytes=cache_max_bytes,
    )
    cache.max_pixels = max_pixels
    return cache


def from_hf(
    cls: type[JpegCache],
    dataset: Any,  # a datasets.Dataset (datasets ships no types)
    *,
    image_column: str = "image",
    label_column: str | None = "label",
    classes: Sequence[str] | None = None,
    on_error: Literal["skip", "raise"] = "skip",
    num_threads: int | None = None,
    progress: bool = True,
    max_pixels: int | None = DEFAULT_MAX_PIXELS,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_max_bytes: int | None = None,
    restart_markers: bool = False,
    max_side: int | None = None,
    jpeg_quality: int | None = None,
) -> JpegCache:
    """``JpegCache.from_hf`` (see its docstring)."""
    from ..ingest import _sources

    if cache_dir is not None:
        raise ValueError(
            "cache_dir= needs files to key the saved store on, and a datasets.Dataset "
            "is an object: build once, cache.save(path), and JpegCache.open(path) "
            "where it is needed."
        )
    return _sources.from_hf(
        cls,
        dataset,
        image_column=image_column,
        label_column=label_column,
        classes=classes,
        on_error=on_error,
        num_threads=num_threads,
        progress=progress,
        max_pixels=max_pixels,
        restart_markers=restart_markers,
        max_side=max_side,
        jpeg_quality=jpeg_quality,
    )


_store.BUILDERS.update(
    from_folder=from_folder,
    from_files=from_files,
    from_csv=from_csv,
    from_webdataset=from_webdataset,
    from_hf=from_hf,
)
