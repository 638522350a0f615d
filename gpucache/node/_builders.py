"""What ``JpegCache.from_folder``, ``from_files``, ``from_csv``, ``from_webdataset`` and ``from_hf``
do (``_jpegcache.py`` holds their public signatures): scan the input, then build once per node
under the node lock (``_cache.built_for``) or in memory, through the build of ``gpucache.ingest``;
URLs of objects in storage go to ``_storage``.

Each takes the class to build (``cls``, the public ``JpegCache``) and the build options as one
``BuildOptions``; the node cache's key holds the input (paths, or the root, CSV or shards named)
and what decides the store's content: labels, classes, the source's own options and
``options.keyed()``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ..store._store import Store
from . import _storage
from ._cache import built_for
from ._storage import any_url, csv_lists_urls

if TYPE_CHECKING:
    from ..ingest._options import BuildOptions
    from ._cache import Listing

S = TypeVar("S", bound=Store)


def from_folder(cls: type[S], root: str | os.PathLike[str], options: BuildOptions) -> S:
    """``JpegCache.from_folder`` (see its docstring)."""
    if any_url(root):  # a prefix in storage (s3://bucket/train/)
        return _storage.from_folder(cls, os.fspath(root), options)
    from ..ingest._build import build, scan_folder

    def scan() -> Listing:
        paths, labels, classes = scan_folder(Path(root))
        return paths, (labels, classes, *options.keyed())

    return built_for(
        cls,
        scan,
        lambda paths, extra, on_progress: build(
            cls, paths, extra[0], extra[1], None, options, on_progress=on_progress
        ),
        (os.path.abspath(root), *options.keyed()),
        options,
    )


def from_files(
    cls: type[S],
    paths: Sequence[Any],
    labels: Any,
    metadata: Sequence[str] | None,
    classes: Sequence[str] | None,
    options: BuildOptions,
) -> S:
    """``JpegCache.from_files`` (see its docstring)."""
    if any_url(paths):  # object URLs
        return _storage.from_files(cls, paths, labels, metadata, classes, options)
    from ..ingest import _sources

    extra = (labels, metadata, classes, *options.keyed())
    return built_for(
        cls,
        lambda: (paths, extra),
        lambda paths, _, on_progress: _sources.from_files(
            cls, paths, labels, metadata, options, classes=classes, on_progress=on_progress
        ),
        (paths, *extra),
        options,
    )


def from_csv(
    cls: type[S],
    path: str | os.PathLike[str],
    classes: Sequence[str] | None,
    delimiter: str,
    header: bool | None,
    options: BuildOptions,
) -> S:
    """``JpegCache.from_csv`` (see its docstring): the CSV read once, the files it lists built
    (once per node with ``cache_dir`` or several ranks, keyed on those files)."""
    if csv_lists_urls(path):  # a CSV in storage, or one listing object URLs
        return _storage.from_csv(cls, path, classes, delimiter, header, options)
    from ..ingest._build import build
    from ..ingest._sources import read_csv

    def scan() -> Listing:
        files, labels, names, meta = read_csv(
            path, classes=classes, delimiter=delimiter, header=header
        )
        return files, (labels, names, meta, *options.keyed())

    return built_for(
        cls,
        scan,
        lambda files, extra, on_progress: build(
            cls, files, extra[0], extra[1], extra[2], options, on_progress=on_progress
        ),
        (os.path.abspath(path), classes, delimiter, header, *options.keyed()),
        options,
    )


def from_webdataset(
    cls: type[S],
    shards: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    classes: Sequence[str] | None,
    metadata_ext: str | None,
    options: BuildOptions,
) -> S:
    """``JpegCache.from_webdataset`` (see its docstring): built once per node with ``cache_dir``
    or several ranks, keyed on the shard files."""
    if any_url(shards):  # shards in storage, brace patterns expanded
        return _storage.from_webdataset(cls, shards, classes, metadata_ext, options)
    from ..ingest import _sources
    from ..ingest._patterns import expand_local

    listed = expand_local(  # brace patterns and globs, as for URLs
        [os.fspath(shards)]
        if isinstance(shards, (str, os.PathLike))
        else [os.fspath(s) for s in shards]
    )
    extra = (classes, metadata_ext, *options.keyed())
    return built_for(
        cls,
        lambda: (listed, extra),
        lambda listed, _, on_progress: _sources.from_webdataset(
            cls,
            listed,
            options,
            classes=classes,
            metadata_ext=metadata_ext,
            on_progress=on_progress,
        ),
        ([os.path.abspath(s) for s in listed], *extra),
        options,
    )


def from_hf(
    cls: type[S],
    dataset: Any,
    image_column: str,
    label_column: str | None,
    classes: Sequence[str] | None,
    options: BuildOptions,
) -> S:
    """``JpegCache.from_hf`` (see its docstring)."""
    from ..ingest import _sources

    if options.cache_dir is not None:
        raise ValueError(
            "cache_dir= needs files to key the saved store on, and a datasets.Dataset "
            "is an object: build once, cache.save(path), and JpegCache.open(path) "
            "where it is needed."
        )
    store: S = _sources.from_hf(
        cls,
        dataset,
        options,
        image_column=image_column,
        label_column=label_column,
        classes=classes,
    )
    store.max_pixels = options.max_pixels
    return store
