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
from typing import TYPE_CHECKING, Literal

from ..store import _store
from ..store._limits import DEFAULT_MAX_PIXELS

if TYPE_CHECKING:
    from ..store._store import JpegCache


def from_folder(cls, root: str | os.PathLike, *, on_error: Literal["skip", "raise"] = "skip",
                num_threads: int | None = None, progress: bool = True,
                max_pixels: int | None = DEFAULT_MAX_PIXELS,
                cache_dir: str | os.PathLike | None = None,
                cache_max_bytes: int | None = None,
                restart_markers: bool = False, max_side: int | None = None,
                jpeg_quality: int | None = None) -> JpegCache:
    """``JpegCache.from_folder`` (see its docstring)."""
    from ..ingest._build import build, scan_folder
    from ._cache import built_once

    def scan():
        paths, labels, classes = scan_folder(Path(root))
        return paths, (labels, classes, on_error, max_pixels, restart_markers, max_side,
                       jpeg_quality)

    cache = built_once(cls, scan, lambda paths, extra, on_progress: build(
        cls, paths, extra[0], extra[1], None, on_error=on_error, num_threads=num_threads,
        progress=progress, max_pixels=max_pixels, on_progress=on_progress,
        restart_markers=restart_markers, max_side=max_side, jpeg_quality=jpeg_quality),
        (os.path.abspath(root), on_error, max_pixels, restart_markers, max_side, jpeg_quality),
        cache_dir=cache_dir,
        max_bytes=cache_max_bytes)
    cache.max_pixels = max_pixels
    return cache


def from_files(cls, paths: Sequence[str | os.PathLike], labels: Sequence[int] | None = None,
               metadata: Sequence[str] | None = None, *, classes: Sequence[str] | None = None,
               on_error: Literal["skip", "raise"] = "skip", num_threads: int | None = None,
               progress: bool = True, max_pixels: int | None = DEFAULT_MAX_PIXELS,
               cache_dir: str | os.PathLike | None = None,
               cache_max_bytes: int | None = None,
               restart_markers: bool = False, max_side: int | None = None,
               jpeg_quality: int | None = None) -> JpegCache:
    """``JpegCache.from_files`` (see its docstring)."""
    from ..ingest import _sources
    from ._cache import built_once

    extra = (labels, metadata, classes, on_error, max_pixels, restart_markers, max_side,
             jpeg_quality)
    cache = built_once(cls, lambda: (paths, extra), lambda paths, _, on_progress:
        _sources.from_files(cls, paths, labels, metadata, classes=classes, on_error=on_error,
                            num_threads=num_threads, progress=progress, max_pixels=max_pixels,
                            on_progress=on_progress, restart_markers=restart_markers,
                            max_side=max_side, jpeg_quality=jpeg_quality), (paths, *extra),
        cache_dir=cache_dir,
        max_bytes=cache_max_bytes)
    cache.max_pixels = max_pixels
    return cache


def from_csv(cls, path: str | os.PathLike, *, classes: Sequence[str] | None = None,
             delimiter: str = ",", header: bool | None = None,
             on_error: Literal["skip", "raise"] = "skip", num_threads: int | None = None,
             progress: bool = True, **build_options) -> JpegCache:
    """``JpegCache.from_csv`` (see its docstring)."""
    from ..ingest import _sources

    return _sources.from_csv(cls, path, classes=classes, delimiter=delimiter, header=header,
                             on_error=on_error, num_threads=num_threads, progress=progress,
                             **build_options)


def from_webdataset(cls, shards: str | os.PathLike | Sequence[str | os.PathLike], *,
                    classes: Sequence[str] | None = None, metadata_ext: str | None = None,
                    on_error: Literal["skip", "raise"] = "skip",
                    num_threads: int | None = None, progress: bool = True,
                    **build_options) -> JpegCache:
    """``JpegCache.from_webdataset`` (see its docstring)."""
    from ..ingest import _sources

    return _sources.from_webdataset(cls, shards, classes=classes, metadata_ext=metadata_ext,
                                    on_error=on_error, num_threads=num_threads,
                                    progress=progress, **build_options)


def from_hf(cls, dataset, *, image_column: str = "image", label_column: str | None = "label",
            classes: Sequence[str] | None = None, on_error: Literal["skip", "raise"] = "skip",
            num_threads: int | None = None, progress: bool = True,
            **build_options) -> JpegCache:
    """``JpegCache.from_hf`` (see its docstring)."""
    from ..ingest import _sources

    return _sources.from_hf(cls, dataset, image_column=image_column,
                            label_column=label_column, classes=classes, on_error=on_error,
                            num_threads=num_threads, progress=progress, **build_options)


_store.BUILDERS.update(from_folder=from_folder, from_files=from_files, from_csv=from_csv,
                       from_webdataset=from_webdataset, from_hf=from_hf)
