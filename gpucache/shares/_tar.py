"""This node's share of WebDataset shards in storage (``shard="node"``), a window at a time.

Samples are shared out by their identity (``_partition.py``), never by shard, so every tar
holds samples of every node, and the share is only known once every tar's members are listed.
Rather than spooling every shard (the whole data set on every node), the build fetches the
shards ``WINDOW_BYTES`` at a time into the spool (``ingest.storage._fetch``: parallel ranged
GETs, retries), reads each tar's headers there, copies the members of the samples likely in this node's share
(``Share.likely``: within four standard deviations of the share's bounds in the hash order,
with the number of samples estimated from the bytes seen) into ``<key>.kept``, and drops the
window. Once every tar is read, the exact share is taken (``Share.select``); a sample of the
share that fell outside the margin is read by a ranged GET of its members (rare; all of them
with a single shard, whose names have no common folder to take off before the last tar is read),
unless a store of an earlier layout on this node holds it. The listing is then checked again (a
shard rewritten meanwhile stops the build), and the store is built from ``<key>.kept``.

The node cache holds a window of shards and about the share (``<key>.kept``) while it builds,
then the store (the kept members are removed once the store, built in memory, holds them);
every node still reads every shard once (a tar's members are found by reading it). A build
that is stopped reads its shards again from the first.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ..base._owned import open_own
from ..base._progress import tqdm
from ..ingest._build import _memory
from ..ingest._inputs import FileRangeSource, Refused, size_of
from ..ingest._options import BuildOptions
from ..ingest._sniff import SniffError
from ..ingest._sources import Members, build_samples, shard_label, shard_samples
from ..ingest.storage._calls import retrying
from ..ingest.storage._client import Listing, describe, filesystem
from ..ingest.storage._fetch import _FULL, _free, check_unchanged, fetch
from ..store._store import S
from . import _select
from ._partition import common_cut, identity_hashes

log = logging.getLogger(__name__)

#: Bytes of shards fetched at once (a window; one shard larger than this is a window alone).
WINDOW_BYTES = 1 << 30
COPY_BYTES = 8 << 20  # bytes of one copy of a kept member

__all__ = ["WINDOW_BYTES", "build_tar_share", "kept_file"]


def kept_file(base: Path) -> Path:
    """The members kept for the share of the store named ``base`` (``<key>.kept``)."""
    return base.with_name(base.name + ".kept")


def windows(sizes: np.ndarray, limit: int) -> list[np.ndarray]:
    """Consecutive runs of shard positions, each ``limit`` bytes at most (or one shard)."""
    out: list[np.ndarray] = []
    start, held = 0, 0
    for i, n in enumerate(np.maximum(sizes, 0).tolist()):
        if i > start and held + n > limit:
            out.append(np.arange(start, i))
            start, held = i, 0
        held += n
    if start < len(sizes):
        out.append(np.arange(start, len(sizes)))
    return out


class _Remote:
    """Bytes ``offset:offset + nbytes`` of shard ``shard`` in storage: a member of a sample
    outside the margin, read later if the share holds it."""

    __slots__ = ("name", "shard", "offset", "nbytes")

    def __init__(self, name: str, shard: int, offset: int, nbytes: int) -> None:
        self.name, self.shard, self.offset, self.nbytes = name, shard, offset, nbytes

    def readinto(self, slot: memoryview) -> None:  # a share's are read before the build
        raise OSError(f"{self.name} was not fetched")


class _Kept:
    """``<key>.kept``: members appended as they are copied out of the window's shards."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.unlink(missing_ok=True)  # a stopped build's: never resumed (nothing records it)
        fd, why = open_own(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        if fd is None:
            raise PermissionError(errno.EPERM, f"cannot create {path}: it {why}", str(path))
        self.fd, self.size = fd, 0

    def add(self, name: str, data: bytes | memoryview) -> FileRangeSource:
        at, view = self.size, memoryview(data)
        try:
            while view:
                written = os.pwrite(self.fd, view, self.size)
                view, self.size = view[written:], self.size + written
        except OSError as err:
            raise self._full(err) from err
        return FileRangeSource(name, self.path, at, self.size - at)

    def copy(self, src: FileRangeSource) -> FileRangeSource:
        """``src`` (a range of the spool) appended, file to file (no buffer of its size)."""
        at, done = self.size, 0
        fd = os.open(src.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            while done < src.nbytes:
                n = min(src.nbytes - done, COPY_BYTES)
                try:
                    got = os.copy_file_range(fd, self.fd, n, src.offset + done, at + done)
                except OSError as err:
                    if err.errno in _FULL:
                        raise self._full(err) from err
                    # a file system that cannot: through memory, a part at a time
                    data = os.pread(fd, n, src.offset + done)
                    try:
                        got = os.pwrite(self.fd, data, at + done) if data else 0
                    except OSError as full:
                        raise self._full(full) from full
                if got == 0:
                    raise OSError(f"{src.path} ends {src.nbytes - done:,} bytes early")
                done += got
        finally:
            os.close(fd)
        self.size = at + done
        return FileRangeSource(src.name, self.path, at, done)

    def _full(self, err: OSError) -> OSError:
        """``err`` (a write of a kept member) saying where, how much, and the fix."""
        if err.errno not in _FULL:
            return err
        return OSError(
            err.errno,
            f"cannot write {self.path}, the members of this node's share of the WebDataset "
            f"shards ({self.size:,} bytes so far; {err.strerror}; {_free(self.path)}): free "
            "space there, pass cache_dir= a folder on a larger node-local disk, or run on more "
            "nodes (a node keeps about 1/nodes of the data)",
        )

    def close(self) -> None:
        os.close(self.fd)


def build_tar_share(
    cls: type[S],
    listing: Listing,
    options: BuildOptions,
    members: Members,
    *,
    base: Path,
    on_progress: Callable[..., None] | None,
) -> S:
    """``build_shards`` with ``options.share``: the share's samples of the shards of
    ``listing``, the shards fetched a window at a time."""
    metadata_ext, mask_ext = members.metadata_ext, members.mask_ext
    share = options.share
    assert share is not None
    sizes = np.maximum(listing.sizes, 0)
    whole = int(sizes.sum())
    part = -(-whole // share.nodes)
    limit = max(WINDOW_BYTES, int(sizes.max(initial=0)))
    # on disk at once: a window of shards beside the members kept (about the share), then the
    # store alone (the kept members are removed first)
    _select.check_budget(
        part, share, options, memory=_memory(), spool=True, spooled=min(whole, limit)
    )
    # a sample's identity drops the folder all names share: with two or more shards, the
    # shards' own (with one, the names may share more: then the margin misses, and the share
    # is read by ranged GETs)
    cut = common_cut(listing.urls) if len(listing) > 1 else 0
    kept = _Kept(kept_file(base))
    inputs: list[Any] = []
    masks: list[Any] = []
    labels: list[int] = []
    meta: list[str] = []
    missing: list[str] = []
    seen_samples = seen_bytes = copied = 0
    try:
        for window in windows(sizes, limit):
            spool = fetch(listing.take(window), base, options, _whole(on_progress, window, sizes))
            try:
                for j, k in enumerate(window.tolist()):
                    shard = listing.urls[k]
                    at = spool.source(j)
                    if isinstance(at, Refused):
                        inputs.append(Refused(shard, at.reason))
                        masks.append(Refused(shard, at.reason))
                        labels.append(-1)
                        meta.append("")
                        continue
                    rows = list(
                        shard_samples(
                            shard, metadata_ext, (at.path, at.offset, at.nbytes), mask_ext
                        )
                    )
                    found = [r for r in rows if r[0] is not None]
                    missing += [f"{shard}/{r[3]}" for r in rows if r[0] is None]
                    seen_samples += len(found)
                    seen_bytes += at.nbytes
                    total = max(
                        len(inputs) + len(found), whole * seen_samples // max(seen_bytes, 1)
                    )
                    names = [r[0].name for r in found if r[0] is not None]  # all of them
                    likely = share.likely(identity_hashes(names, cut), max(total // 2, 1))
                    for (item, cls_text, meta_text, key, mask), mine in zip(found, likely):
                        labels.append(shard_label(shard, key, cls_text))
                        meta.append(meta_text or "")
                        for out, x in ((inputs, item), (masks, mask)):
                            if x is not None and not isinstance(x, Refused):
                                x = _sized(x, options.max_pixels)  # a header's size may lie
                            if x is None or isinstance(x, Refused):
                                out.append(x)
                            elif mine:
                                out.append(kept.copy(x))
                                copied += x.nbytes
                            else:
                                out.append(_Remote(x.name, k, x.offset - at.offset, x.nbytes))
            finally:
                spool.remove()
        masks_or_none: list[Any] | None = None
        if mask_ext is not None:
            masks_or_none = [
                m if m is not None else Refused(x.name, "no mask") for x, m in zip(inputs, masks)
            ]
        read = _read_missed(listing, options, kept, inputs, masks_or_none, share)
        check_unchanged(listing)
        log.info(
            "gpucache: node %d of %d read %d shards (%.1f MB), kept %.1f MB of members and "
            "read %d more by ranged GETs (%.1f MB)",
            share.node,
            share.nodes,
            len(listing),
            whole / 1e6,
            copied / 1e6,
            read[0],
            read[1] / 1e6,
        )
        samples = members.samples(labels, meta, masks_or_none)
        return build_samples(cls, inputs, samples, missing, options, on_progress=on_progress)
    finally:  # the store (in memory) holds the share now: the kept members go before its save
        kept.close()
        kept.path.unlink(missing_ok=True)


def _sized(x: FileRangeSource, max_pixels: int | None) -> FileRangeSource | Refused:
    """A member the build would take (``size_of``: capped under ``max_pixels``, large ones
    sniffed), or refused with the reason before a byte of it is copied or fetched."""
    source: Any = x  # a frozen dataclass: a Source whose fields are read only
    try:
        size_of(source, max_pixels)
    except SniffError as err:
        return Refused(x.name, str(err))
    return x


def _whole(
    on_progress: Callable[..., None] | None, window: np.ndarray, sizes: np.ndarray
) -> Callable[..., None] | None:
    """The spool's progress of one window as progress over every shard."""
    if on_progress is None:
        return None
    shards, nbytes = int(window[0]), int(sizes[: window[0]].sum())

    def report(stage: str, done: int, total: int, done_bytes: int) -> None:
        on_progress(stage, shards + done, len(sizes), nbytes + done_bytes)

    return report


def _read_missed(
    listing: Listing,
    options: BuildOptions,
    kept: _Kept,
    inputs: list[Any],
    masks: list[Any] | None,
    share: Any,
) -> tuple[int, int]:
    """Read the members of the share's samples the scan did not keep (outside the margin) by
    ranged GETs into ``kept``, in place in ``inputs`` and ``masks``, unless an earlier store
    holds the sample (and the build does not re-encode): ``(members, bytes)`` read."""
    selected = _select.chosen(share, _select.Names(inputs))
    keep = selected.keep
    held = _select.held_earlier(selected, options, masks is not None).held
    todo = [
        (seq, int(i))
        for i in keep[~held].tolist()
        for seq in ((inputs,) if masks is None else (inputs, masks))
        if isinstance(seq[i], _Remote)
    ]
    if not todo:
        return 0, 0
    fs = listing.fs or filesystem(listing.protocol + "://", options.storage_options)

    def get(job: tuple[list[Any], int]) -> tuple[list[Any], int, bytes | Refused]:
        seq, i = job
        x: _Remote = seq[i]
        a, b = x.offset, x.offset + x.nbytes
        try:
            data = retrying(lambda: fs.cat_file(listing.path(x.shard), start=a, end=b))
        except Exception as err:  # this sample's failure, reported by the build
            return seq, i, Refused(x.name, f"cannot fetch bytes {a:,}-{b:,}: {describe(err)}")
        if len(data) != x.nbytes:
            return seq, i, Refused(x.name, f"the server sent {len(data):,} of {x.nbytes:,} bytes")
        return seq, i, data

    nbytes = 0
    with (
        ThreadPoolExecutor(max(1, min(len(todo), options.requests_in_flight or 16))) as pool,
        tqdm(
            total=len(todo),
            desc="gpucache fetch members",
            unit="member",
            disable=not options.progress or None,
            leave=False,
        ) as bar,
    ):
        for seq, i, got in pool.map(get, todo):
            if isinstance(got, Refused):
                seq[i] = got
            else:
                seq[i] = kept.add(seq[i].name, got)
                nbytes += len(got)
            bar.update(1)
    return len(todo), nbytes
