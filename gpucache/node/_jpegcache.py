"""JpegCache, the public store class: the packed buffer (``gpucache.store._store.Store``: access,
save, share, open, pickling) with the builders ``from_folder``, ``from_files``, ``from_csv``,
``from_webdataset`` and ``from_hf``.

The builders orchestrate the layers below the node layer (sources and the build in ``ingest``,
the build once per node in ``_cache``), so the public class is defined here, above them, and
``gpucache/__init__.py`` exports it; the store layer and the layers between (loader, decode)
know only ``Store``, of which every ``JpegCache`` is one, and make stores of the class they are
given (``cls(...)``, ``type(cache)(...)``), so what they make, open or unpickle is a
``JpegCache``. The classmethods list every build option explicitly (the API reference shows
them); they make one ``BuildOptions`` of them and hand it to ``_builders``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np

from ..ingest._options import BuildOptions
from ..store._limits import DEFAULT_MAX_PIXELS
from ..store._store import Store
from . import _builders

__all__ = ["JpegCache"]


class JpegCache(Store):
    """A store: the encoded images of a data set held once, in one packed read-only buffer.

    The class of a store is named ``JpegCache``; ``GpuCachedLoader`` takes one as its first
    argument, ``cache``. Build with :meth:`from_folder` or :meth:`from_files`, or map a saved
    store with :meth:`open`.
    ``cache[i]`` is a zero-copy read-only uint8 view of sample ``i``'s encoded bytes.
    ``cache.report`` is the build's report (what was kept, what was skipped and why); it is saved
    in the store file, so :meth:`open` gives it back (None for a store saved without one).
    """

    #: how a node share was built (builder, its arguments, its options), so that the loader can
    #: have the samples of other shares it plays to finish a resumed epoch (``_holding``)
    _recipe: tuple[Callable[..., JpegCache], tuple[Any, ...], BuildOptions] | None = None

    def _holding(self, ranks: np.ndarray) -> JpegCache | None:
        """This node's share built again with the samples of the other shares' global
        ``ranks`` beside its own: the same builder over the same source, in the node cache
        (once a node); its own samples are taken from this store, so only those are read from
        the source (``node_share.fetched``). None for a store not made by a builder here."""
        share = self.node_share
        if self._recipe is None or share is None:
            return None
        build, args, options = self._recipe
        extra = np.union1d(np.asarray(ranks, dtype=np.int64), options.share_extra)
        more = dataclasses.replace(options, share_extra=tuple(int(r) for r in extra))
        return _made(build, args, more)

    @classmethod
    def from_folder(
        cls,
        root: str | os.PathLike[str],
        *,
        masks: str | os.PathLike[str] | None = None,
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
        shard: Literal["node"] | None = None,
    ) -> JpegCache:
        """Pack an ImageFolder tree (``root/<class>/<image>``); labels as torchvision assigns.
        ``on_error``: a file that cannot be used is left out and listed in ``cache.report``
        (``"skip"``) or stops the build (``"raise"``: ``BuildError``); ``num_threads``: threads
        reading and checking files (None: the usable cores); ``progress``: a progress bar.
        ``max_pixels``: images whose header claims more pixels are refused (None: no bound).
        Several ranks or ``cache_dir``: built once per node and mapped (docs/guides/multi-gpu.md);
        ``cache_max_bytes``: then the least recently used stores there are removed to fit.
        ``restart_markers``: JPEGs transcoded losslessly so crops decode faster
        (docs/guides/backends.md).
        ``max_side``: images with a longer side re-encoded once to it; ``jpeg_quality``: their
        quality, and every other image re-encoded at it where that is smaller (lossy, opt-in;
        docs/guides/stores.md).
        ``root`` may be a URL of a prefix in object storage (``s3://bucket/train/``, ``gs://``,
        ``az://``; the ``s3``/``gcs``/``azure`` extra): fetched once per node into the node cache
        (``cache_dir`` or its default folder), resumed if a build was killed.
        ``storage_options``: passed to the fsspec client (credentials otherwise from the
        environment, config files or instance role); ``requests_in_flight``: requests at once
        (default 32) (docs/guides/object-storage.md).
        ``masks``: the folder of the images' segmentation masks (ISIC, Pascal VOC, ADE20K and
        Cityscapes layouts): ``root`` is then read as a flat or nested folder of images without
        class labels, each paired with the mask of the same relative folder and stem under
        ``masks`` by the rule docs/guides/segmentation.md states; both local folders, or both
        prefixes in object storage (``s3://b/images/`` with ``s3://b/masks/``, fetched together;
        local images with masks in storage, or the reverse, are refused).
        ``shard``: None (default) builds the whole data set on every node; ``"node"`` builds,
        on each node of a multi-node job, only that node's share (about 1/nodes of the
        samples, a random sample by a hash of each name), for data bigger than one node;
        ``GpuCachedLoader`` then plays every sample once per epoch across the job, and resumes
        at another node count, taking what the node's earlier stores hold
        (docs/guides/nodes.md). One node (or one process): the whole data set."""
        return _made(_builders.from_folder, (cls, root, masks), BuildOptions.of(locals()))

    @classmethod
    def from_files(
        cls,
        paths: Sequence[str | os.PathLike[str]],
        labels: Sequence[int] | np.ndarray | None = None,
        metadata: Sequence[str] | None = None,
        *,
        classes: Sequence[str] | None = None,
        masks: Sequence[str | os.PathLike[str] | bytes | Any] | None = None,
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
        shard: Literal["node"] | None = None,
    ) -> JpegCache:
        """Pack a list of files, bytes-like objects or seekable binary file objects (mixed);
        ``labels`` are ints (``-1`` or None for unlabeled); the rest as in from_folder. Object
        URLs (``s3://bucket/a.jpg``, all items) are fetched once per node as in from_folder.
        ``masks``: one segmentation mask per item (paths, bytes or file objects; PNG, 8-bit,
        palette or 16-bit, the image's size after EXIF orientation), stored with the images
        (``cache.masks``); an image whose mask is missing or unusable is a bad input
        (``on_error``; docs/guides/segmentation.md). Object URLs of masks go with object URLs
        of images, fetched with them."""
        return _made(
            _builders.from_files,
            (cls, paths, labels, metadata, classes, masks),
            BuildOptions.of(locals()),
        )

    @classmethod
    def from_csv(
        cls,
        path: str | os.PathLike[str],
        *,
        classes: Sequence[str] | None = None,
        delimiter: str = ",",
        header: bool | None = None,
        mask_column: str | int | None = None,
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
        shard: Literal["node"] | None = None,
    ) -> JpegCache:
        """Pack the files a CSV lists as ``path,label[,metadata]`` (paths relative to the CSV;
        labels ints or class names; ``header=None`` skips a first row labelled ``label``/``class``).
        The build options (``on_error`` to ``jpeg_quality``) as in from_folder; with
        ``cache_dir`` the store is keyed on the listed files. Rows may be object URLs, and the
        CSV itself may be in storage (relative rows then name objects beside it).
        ``mask_column``: a column of segmentation mask paths (named in a header row, or its
        0-based index), taken out before the row is read as above; masks as in from_files
        (URLs in a CSV of URLs, as the images)."""
        return _made(
            _builders.from_csv,
            (cls, path, classes, delimiter, header, mask_column),
            BuildOptions.of(locals()),
        )

    @classmethod
    def from_webdataset(
        cls,
        shards: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        *,
        classes: Sequence[str] | None = None,
        metadata_ext: str | None = None,
        mask_ext: str | None = None,
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
        shard: Literal["node"] | None = None,
    ) -> JpegCache:
        """Pack WebDataset tar shards (images and ``.cls`` labels), read in place from the tars;
        the build options as in from_folder (with ``cache_dir`` keyed on the shard files).
        Paths and URLs take WebDataset's brace patterns (``shards/train-{000..099}.tar``) and
        globs (``shards/train-*.tar``); a pattern that matches nothing is a
        ``FileNotFoundError`` naming it. Shards in storage are fetched once per node.
        ``mask_ext``: the member extension of each sample's segmentation mask (``"png"`` beside
        a ``jpg``, or ``"seg.png"``), read in place like the image; masks as in from_files
        (shards in storage too)."""
        return _made(
            _builders.from_webdataset,
            (cls, shards, classes, metadata_ext, mask_ext),
            BuildOptions.of(locals()),
        )

    @classmethod
    def from_hf(
        cls,
        dataset: Any,  # a datasets.Dataset (datasets ships no types)
        *,
        image_column: str = "image",
        label_column: str | None = "label",
        classes: Sequence[str] | None = None,
        mask_column: str | None = None,
        on_error: Literal["skip", "raise"] = "skip",
        num_threads: int | None = None,
        progress: bool = True,
        max_pixels: int | None = DEFAULT_MAX_PIXELS,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_max_bytes: int | None = None,
        restart_markers: bool = False,
        max_side: int | None = None,
        jpeg_quality: int | None = None,
        shard: Literal["node"] | None = None,
    ) -> JpegCache:
        """Pack a Hugging Face ``datasets.Dataset``'s ``Image`` column, bytes taken as stored;
        the build options as in from_folder (``cache_dir`` is refused: a dataset object has no
        files to key a saved store on; save the store and open it instead).
        ``mask_column``: another ``Image`` column holding each row's segmentation mask,
        taken as stored; masks as in from_files."""
        return _made(
            _builders.from_hf,
            (cls, dataset, image_column, label_column, classes, mask_column),
            BuildOptions.of(locals()),
        )


def _made(
    build: Callable[..., JpegCache], args: tuple[Any, ...], options: BuildOptions
) -> JpegCache:
    """``build(*args, options)``; a node share remembers how it was made (``_holding``)."""
    cache: JpegCache = build(*args, options)
    if options.shard == "node" and isinstance(cache, JpegCache):
        cache._recipe = (build, args, options)
    return cache
