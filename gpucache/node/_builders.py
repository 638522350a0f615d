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

import dataclasses
import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from ..base import _dist
from ..ingest._inputs import Samples
from ..shares._partition import Share
from ..store._store import Store
from . import _storage
from ._cache import built_for, several_ranks
from ._dir import default_dir
from ._storage import any_url, csv_lists_urls

if TYPE_CHECKING:
    from ..ingest._options import BuildOptions
    from ._cache import Listing

S = TypeVar("S", bound=Store)


def placed(options: BuildOptions, *, remote: bool = False) -> BuildOptions:
    """``options`` with the node's share when ``shard="node"``: the job's node layout from the
    launcher (``_dist.nodes``; one process is node 0 of 1) and the folder its store will live in
    (for the budget check; none for a store built in memory: one process, no ``cache_dir``, not
    ``remote`` objects in storage, which are always built in the node cache)."""
    if options.shard is None:
        return options
    nodes, node = _dist.nodes()
    folder: str | None = None
    if options.cache_dir is not None:
        folder = os.fspath(options.cache_dir)
    elif remote or several_ranks():
        folder = os.fspath(default_dir())
    share = Share(nodes, node, folder=folder, extra=options.share_extra)
    return dataclasses.replace(options, share=share)


def from_folder(
    cls: type[S],
    root: str | os.PathLike[str],
    masks: str | os.PathLike[str] | None,
    options: BuildOptions,
) -> S:
    """``JpegCache.from_folder`` (see its docstring)."""
    options = placed(options, remote=any_url(root))
    if masks is not None:
        if any_url(root) and any_url(masks):  # both prefixes in storage
            return _storage.from_folder(cls, os.fspath(root), options, masks=os.fspath(masks))
        return _folder_with_masks(cls, root, masks, options)
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
            cls, paths, Samples(extra[0], extra[1]), options, on_progress=on_progress
        ),
        (os.path.abspath(root), *options.keyed()),
        options,
    )


def _folder_with_masks(
    cls: type[S],
    root: str | os.PathLike[str],
    masks: str | os.PathLike[str],
    options: BuildOptions,
) -> S:
    """``from_folder(root, masks=MASK_ROOT)``: every image under ``root``, unlabeled, with its
    mask under ``masks`` (``ingest._pairs``)."""
    _no_urls_with_masks(root, masks)
    from ..ingest._build import build, check_labels
    from ..ingest._pairs import pair_folder

    def scan() -> Listing:
        images, found = pair_folder(Path(root), Path(masks))
        return images, (MaskKey(found), *options.keyed())

    def make(images: Sequence[str], extra: Sequence[Any], on_progress: Any) -> S:
        labels, classes = check_labels(len(images), None, None)
        samples = Samples(labels, classes, masks=extra[0].masks)
        store: S = build(cls, images, samples, options, on_progress=on_progress)
        return store

    request = (os.path.abspath(root), "masks", os.path.abspath(masks), *options.keyed())
    return built_for(cls, scan, make, request, options)


def _no_urls_with_masks(*where: Any) -> None:
    """A ``ValueError`` if local images have masks in object storage, or images in storage
    local masks (not supported: both local, or both in storage, are)."""
    if any(any_url(w) for w in where if w is not None):
        raise ValueError(
            "masks in object storage go with images in object storage: URLs (from_files, "
            "from_csv), shards (from_webdataset) or a prefix of each (from_folder); local "
            "images with masks in storage, and images in storage with local masks, are not "
            "supported: put both in storage, or fetch both to a local folder."
        )


class MaskKey:
    """The masks' identity in a node cache key (``_cache._hash`` takes ``tobytes()``): each mask
    file's resolved path, size and mtime (or that it is missing), bytes by their content; its
    ``repr`` names the masks alone, for the request key, which touches no file."""

    def __init__(self, masks: Sequence[Any], *, files: bool = True) -> None:
        self.masks, self._files = masks, files

    def tobytes(self) -> bytes:
        """The key's bytes (``files=False``: of the mask names alone, no file touched)."""
        from ..ingest._inputs import Refused

        if not self._files:
            return repr(self).encode("utf-8", "surrogateescape")
        h = hashlib.blake2b(b"masks", digest_size=16)
        real: dict[str, str] = {}
        for m in self.masks:
            if isinstance(m, (str, os.PathLike)):
                head, tail = os.path.split(os.fspath(m))
                if head not in real:
                    real[head] = os.path.realpath(head or ".")
                try:
                    st = os.stat(m)
                    line = f"{os.path.join(real[head], tail)}\0{st.st_size}\0{st.st_mtime_ns}"
                except OSError:
                    line = f"{os.path.join(real[head], tail)}\0missing"
                h.update(line.encode("utf-8", "surrogateescape") + b"\n")
            elif isinstance(m, Refused):
                h.update(f"{m.name}\0missing\n".encode("utf-8", "surrogateescape"))
            elif isinstance(m, (bytes, bytearray, memoryview, np.ndarray)):
                h.update(b"bytes\0")
                h.update(np.frombuffer(m, np.uint8).tobytes())  # a copy, for the key only
                h.update(b"\n")
            else:
                raise ValueError(
                    f"cache_dir= keys the saved store on the masks too, and a "
                    f"{type(m).__name__} mask cannot be keyed: give mask paths or bytes, or "
                    "build without cache_dir and save the store yourself (cache.save(path))."
                )
        return h.digest()

    def __repr__(self) -> str:
        names = [
            os.fspath(m) if isinstance(m, (str, os.PathLike)) else type(m).__name__
            for m in self.masks
        ]
        return f"MaskKey({names!r})"


def from_files(
    cls: type[S],
    paths: Sequence[Any],
    labels: Any,
    metadata: Sequence[str] | None,
    classes: Sequence[str] | None,
    masks: Sequence[Any] | None,
    options: BuildOptions,
) -> S:
    """``JpegCache.from_files`` (see its docstring)."""
    options = placed(options, remote=any_url(paths))
    if any_url(paths):  # object URLs (and their masks': all URLs, checked there)
        return _storage.from_files(cls, paths, labels, metadata, classes, options, masks)
    if masks is not None:
        _no_urls_with_masks(masks)
    from ..ingest import _sources

    extra = (labels, metadata, classes, *options.keyed())
    request = (paths, *extra)
    if masks is not None:  # after the options: a store without masks keeps its key
        extra, request = (*extra, MaskKey(masks)), (*request, MaskKey(masks, files=False))
    return built_for(
        cls,
        lambda: (paths, extra),
        lambda paths, _, on_progress: _sources.from_files(
            cls,
            paths,
            _sources.given(len(paths), labels, classes, metadata, masks),
            options,
            on_progress=on_progress,
        ),
        request,
        options,
    )


def from_csv(
    cls: type[S],
    path: str | os.PathLike[str],
    classes: Sequence[str] | None,
    delimiter: str,
    header: bool | None,
    mask_column: str | int | None,
    options: BuildOptions,
) -> S:
    """``JpegCache.from_csv`` (see its docstring): the CSV read once, the files it lists built
    (once per node with ``cache_dir`` or several ranks, keyed on those files and masks)."""
    options = placed(options, remote=csv_lists_urls(path))
    if csv_lists_urls(path):  # a CSV in storage, or one listing object URLs
        return _storage.from_csv(cls, path, classes, delimiter, header, options, mask_column)
    from ..ingest._build import build
    from ..ingest._sources import read_csv

    def scan() -> Listing:
        files, labels, names, meta, masks = read_csv(
            path, classes=classes, delimiter=delimiter, header=header, mask_column=mask_column
        )
        if masks is None:
            return files, (labels, names, meta, *options.keyed())
        _no_urls_with_masks(*masks)
        return files, (labels, names, meta, *options.keyed(), MaskKey(masks))

    def make(files: Sequence[str], extra: Sequence[Any], on_progress: Any) -> S:
        masks = extra[-1].masks if isinstance(extra[-1], MaskKey) else None
        samples = Samples(extra[0], extra[1], extra[2], masks)
        store: S = build(cls, files, samples, options, on_progress=on_progress)
        return store

    request: tuple[Any, ...] = (os.path.abspath(path), classes, delimiter, header, *options.keyed())
    if mask_column is not None:  # after the options: a store without masks keeps its key
        request = (*request, "masks", mask_column)
    return built_for(cls, scan, make, request, options)


def from_webdataset(
    cls: type[S],
    shards: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    classes: Sequence[str] | None,
    metadata_ext: str | None,
    mask_ext: str | None,
    options: BuildOptions,
) -> S:
    """``JpegCache.from_webdataset`` (see its docstring): built once per node with ``cache_dir``
    or several ranks, keyed on the shard files (the masks are members of them)."""
    options = placed(options, remote=any_url(shards))
    if any_url(shards):  # shards in storage, brace patterns expanded
        return _storage.from_webdataset(cls, shards, classes, metadata_ext, options, mask_ext)
    from ..ingest import _sources
    from ..ingest._patterns import expand_local

    listed = expand_local(  # brace patterns and globs, as for URLs
        [os.fspath(shards)]
        if isinstance(shards, (str, os.PathLike))
        else [os.fspath(s) for s in shards]
    )
    extra = (classes, metadata_ext, *options.keyed())
    if mask_ext is not None:  # after the options: a store without masks keeps its key
        extra = (*extra, "masks", mask_ext)
    return built_for(
        cls,
        lambda: (listed, extra),
        lambda listed, _, on_progress: _sources.from_webdataset(
            cls,
            listed,
            options,
            _sources.Members(classes, metadata_ext, mask_ext),
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
    mask_column: str | None,
    options: BuildOptions,
) -> S:
    """``JpegCache.from_hf`` (see its docstring)."""
    options = placed(options)
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
        mask_column=mask_column,
    )
    store.max_pixels = options.max_pixels
    return store
