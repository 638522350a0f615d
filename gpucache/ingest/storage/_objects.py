"""Stores from objects in storage: fetch a listing into the spool (``_fetch``), check that the
objects did not change meanwhile, then run the one build over the spool's byte ranges.

The listing is taken twice, before and after the fetch; if an object was added, removed or
rewritten in between (a new ETag or size), the build stops with an :class:`ObjectStoreError`
naming them, and nothing is published: a store always holds one version of its data set.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ...shares import _select
from ...shares._select import Picked
from ...shares._tar import build_tar_share, kept_file
from ...store._store import S
from .._build import _memory, build
from .._inputs import Refused, Samples
from .._lazy import OnAccess
from .._options import BuildOptions
from .._sources import Members, from_webdataset
from ._client import Listing
from ._fetch import fetch

__all__ = ["build_objects", "build_shards", "spool_files"]


def spool_files(base: Path) -> list[Path]:
    """The spool's files for the store named ``base`` (``<key>``): data, journal, and the
    members a node share of WebDataset shards kept (``shares/_tar.py``)."""
    return [
        base.with_name(base.name + ".fetch"),
        base.with_name(base.name + ".fetched"),
        kept_file(base),
    ]


def build_objects(
    cls: type[S],
    listing: Listing,
    samples: Samples,
    options: BuildOptions,
    *,
    base: Path,
    on_progress: Callable[..., None] | None,
    masks_at: int | None = None,
) -> S:
    """A store of one sample an object (``from_folder``, ``from_files``, ``from_csv``), with
    the labels and metadata of ``samples`` (its ``masks`` unused: they are objects of the
    listing); ``masks_at``: the listing's objects from there on are the masks of the ones before
    it, in order (one fetch, one check that nothing changed, for both).
    ``options.share`` (``shard="node"``): only this node's share is fetched (with its masks), once
    its size has been checked against the node cache (``_select.check_budget``)."""
    if options.share is not None:
        return _build_share(cls, listing, samples, options, base, on_progress, masks_at)
    spool = fetch(listing, base, options, on_progress)
    inputs: Sequence[Any] = spool.inputs()
    if masks_at is None:
        return build(cls, inputs, samples, options, on_progress=on_progress)
    masks = _Part(inputs, masks_at, len(inputs) - masks_at)
    return build(
        cls,
        _Part(inputs, 0, masks_at),
        dataclasses.replace(samples, masks=masks),
        options,
        on_progress=on_progress,
    )


def _build_share(
    cls: type[S],
    listing: Listing,
    samples: Samples,
    options: BuildOptions,
    base: Path,
    on_progress: Callable[..., None] | None,
    masks_at: int | None,
) -> S:
    """``build_objects`` of this node's share (``shard="node"``): its objects are picked from
    the listing, those the node's stores of earlier layouts hold are taken from them, the size
    is checked against the node cache (``_select.check_budget``), and only the rest is fetched."""
    share = options.share
    assert share is not None
    images = listing if masks_at is None else _Part(listing, 0, masks_at)
    selected = _select.chosen(share, images)
    keep = selected.keep
    hits = _select.held_earlier(selected, options, masks_at is not None)
    need = keep[~hits.held]
    taken = need if masks_at is None else np.concatenate([need, need + masks_at])
    urls = listing.urls
    listing = listing.take(taken)
    sizes = listing.sizes
    nbytes = int(sizes[sizes > 0].sum()) + hits.nbytes()
    _select.check_budget(nbytes, share, options, memory=_memory(), spool=True)
    spool = fetch(listing, base, options, on_progress)
    fetched = spool.inputs()
    metadata = samples.metadata
    mine = Samples(
        np.asarray(samples.labels)[keep],
        samples.classes,
        None if metadata is None else Picked(metadata, keep),
        None
        if masks_at is None
        else _select.Merged(
            fetched, hits, Picked(urls, keep + masks_at), offset=len(need), masks=True
        ),
    )
    return build(
        cls,
        _select.Merged(fetched, hits, Picked(urls, keep)),
        mine,
        options,
        on_progress=on_progress,
        taken=_select.Taken(selected, hits.held),
    )


class _Part(OnAccess[Any]):
    """``count`` items of ``seq`` from ``start``, made on access (no list of the inputs)."""

    def __init__(self, seq: Sequence[Any], start: int, count: int) -> None:
        self._seq, self._start, self._count = seq, start, count

    def __len__(self) -> int:
        return self._count

    def item(self, i: int) -> Any:
        return self._seq[self._start + i]


def build_shards(
    cls: type[S],
    listing: Listing,
    options: BuildOptions,
    members: Members,
    *,
    base: Path,
    on_progress: Callable[..., None] | None,
) -> S:
    """A store of the samples of WebDataset shards in storage, read out of the spool.
    ``options.share``: samples are shared out by member, so every node reads every shard, a
    window at a time, and keeps its share (``shares/_tar.py``)."""
    if options.share is not None:
        return build_tar_share(cls, listing, options, members, base=base, on_progress=on_progress)
    spool = fetch(listing, base, options, on_progress)

    def locate(k: int) -> tuple[str | os.PathLike[str], int, int] | Refused:
        src = spool.source(k)
        return src if isinstance(src, Refused) else (src.path, src.offset, src.nbytes)

    return from_webdataset(
        cls, list(listing.urls), options, members, locate=locate, on_progress=on_progress
    )
