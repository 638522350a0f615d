"""One copy per node: the ranks of a node scan once, build a store once and all map the same file.

``JpegCache.from_folder(root)`` run in every rank of a node (torchrun, Slurm, Lightning DDP) would
build one in-memory copy per rank. Instead, when this process is one of several ranks (LOCAL_WORLD_SIZE
or WORLD_SIZE > 1, or an initialised process group) or a ``cache_dir`` is given:

- the store file's name (its key) is a hash of the source listing (every path with its size and
  mtime, the labels, classes and build options), in a private folder (see ``_nodedir``);
- scanning once per node: the first rank to take ``<request>.scan.lock`` (request: the root or
  file names and the options, no file system access) lists and stats the files and writes the key
  to ``<request>.scan``; the other ranks wait for that lock and take the key from the file. A rank
  takes a key only if it was written after that rank's process started, less than
  ``SCAN_FRESH_S`` ago, and not made or taken by this process before; so a later job, or a later
  call in the same process, scans again (a changed folder is never missed);
- a rank that finds the store opens it (milliseconds: nothing is read until decoded);
- otherwise it takes ``<key>.lock`` (``_nodelock``): the first rank to get it builds, saves
  atomically (0600) and opens the file, publishing its progress; the others wait while progress
  moves, then open it. A crashed builder's lock goes with its process: the next rank builds.

A changed folder hashes differently and is rebuilt; old stores stay until ``gpucache cache clean``
or the ``cache_max_bytes`` cap removes them (least recently opened first, never one in use). A
single process with no ``cache_dir`` builds in memory and writes nothing.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from .._errors import CacheFormatError
from ..base import _dist
from ..ingest.storage._client import Listing as ObjectListing
from ..ingest.storage._fetch import spool_full
from ..ingest.storage._objects import spool_files
from ..shares._partition import Share
from ..shares._select import reusing
from ..store._store import Store
from ._clean import clean, entries
from ._dir import checked_dir, default_dir, hold_shared, open_own, read_json, write_private
from ._lock import NodeLock

if TYPE_CHECKING:
    from ..ingest._options import BuildOptions

S = TypeVar("S", bound=Store)  # the store class built and opened (the public JpegCache)

log = logging.getLogger(__name__)

STALL_TIMEOUT_S = 900.0  # waiters give up when the builder reports no progress for this long
SCAN_FRESH_S = 120.0  # a rank takes another rank's scan result only this soon after it was made
_used: set[str | None] = set()  # scan results this process made or took: it scans again next time
_KEY_VERSION = b"gpucache-node-1"
__all__ = ["built_once", "default_dir", "listing_key", "several_ranks"]

Listing = tuple[Sequence[Any], Sequence[Any]]  # (inputs, extra: labels, classes, options)


def several_ranks() -> bool:
    """True when this process is one of several ranks (launcher variables or a process group)."""
    launched = _dist._env_int("WORLD_SIZE") or 1
    return _dist.local()[0] > 1 or _dist.world()[0] > 1 or launched > 1


def _hash(h: hashlib.blake2b, extra: Sequence[object]) -> None:
    for item in extra:  # an array's repr elides its middle: hash its bytes
        h.update(item.tobytes() if hasattr(item, "tobytes") else repr(item).encode())
        h.update(b"\1")


def listing_key(
    paths: Sequence[str], extra: Sequence[object], on_progress: Callable[..., None] | None = None
) -> str:
    """A hash of every path (its folder resolved: symlinks, ``..``, relative to absolute) with its
    size and mtime, plus ``extra`` (labels, classes, options)."""
    return listing_keys(paths, extra, on_progress)[0]


def listing_keys(
    paths: Sequence[str], extra: Sequence[object], on_progress: Callable[..., None] | None = None
) -> tuple[str, str]:
    """:func:`listing_key`, and the same without the node's share (``Share`` items of
    ``extra``): the key every node layout of one source and options shares, so a node finds its
    stores of earlier layouts (``source`` in their ``.info``)."""
    h = hashlib.blake2b(_KEY_VERSION, digest_size=16)
    whole = [e for e in extra if not isinstance(e, Share)]
    if isinstance(paths, ObjectListing):  # objects in storage: every URL with its size and ETag
        paths.fingerprint(h)
    else:
        _stat_paths(h, paths, on_progress)
    g = h.copy()
    _hash(h, extra)
    _hash(g, whole)
    return h.hexdigest(), g.hexdigest()


def _stat_paths(
    h: hashlib.blake2b, paths: Sequence[str], on_progress: Callable[..., None] | None
) -> None:
    real: dict[str, str] = {}  # folder as named -> resolved (one realpath a folder, not a file)
    for i, p in enumerate(paths):
        st = os.stat(p)
        head, tail = os.path.split(os.fspath(p))
        if head not in real:
            real[head] = os.path.realpath(head or ".")
        # resolved folders: one folder reached through a symlink or a relative path is one store
        q = os.path.join(real[head], tail)
        h.update(f"{q}\0{st.st_size}\0{st.st_mtime_ns}\n".encode("utf-8", "surrogateescape"))
        if on_progress is not None and i % 4096 == 4095:
            on_progress("stat", i + 1, len(paths))


def built_once(
    cls: type[S],
    scan: Callable[[], Listing],
    build: Callable[..., S],
    request: Sequence[Any],
    options: BuildOptions,
    *,
    remote: bool = False,
    stall_timeout: float | None = None,
) -> S:
    """``build(inputs, extra, on_progress)`` once per node, or open the saved store of an unchanged
    listing; in memory for one process without ``options.cache_dir``. ``request`` names what
    ``scan()`` lists without touching the file system (a root, or the paths, plus the options).
    ``remote``: objects in storage, always built in the node cache (default folder without
    ``cache_dir``), and ``build(inputs, extra, on_progress, base)`` fetches them into a spool
    named after ``base`` (``<folder>/<key>``), removed once the store is saved. The folder is
    cleaned down to ``options.cache_max_bytes`` after.
    ``options.share``: the node's share (``shard="node"``); its build takes what this node's
    stores of earlier layouts of the same source hold (``shares._select.reusing``) instead of
    reading it."""
    cache_dir, max_bytes, share = options.cache_dir, options.cache_max_bytes, options.share
    stall = STALL_TIMEOUT_S if stall_timeout is None else stall_timeout
    if cache_dir is None and not several_ranks() and not remote:
        return build(*scan(), None)
    named = request[0]
    if not isinstance(named, (str, os.PathLike)) and not all(
        isinstance(x, (str, os.PathLike)) for x in named
    ):
        if cache_dir is not None:
            raise ValueError(
                "cache_dir= needs file paths to key the saved store on (their names, "
                "sizes and mtimes); bytes or file objects cannot be keyed. Build "
                "without cache_dir and save it yourself (cache.save(path))."
            )
        log.warning(
            "gpucache: every rank builds its own copy of a store made from bytes or file "
            "objects; build it once, cache.save(path), and JpegCache.open(path) in each rank."
        )
        return build(*scan(), None)
    folder = checked_dir(cache_dir)
    # the key of the listing, and the one every node layout of it shares (for node shares)
    key: str | None = None
    source: str | None = None
    listing: Listing | None = None
    try:
        if several_ranks():
            key, listing, source = _scan_once(folder, scan, request, stall)
    except PermissionError:  # a read-only folder: each rank scans; a store built there still opens
        key = None
    if key is None:
        listing = scan()
        key, source = listing_keys(*listing)
    while True:
        store = folder / f"{key}.gpucache"
        cache = _open(cls, store)
        if cache is not None:
            return cache
        with NodeLock(folder / f"{key}.lock", store, stall) as lock:
            cache = _open(cls, store)  # built by another rank while this one waited
            if cache is not None:
                return cache
            if listing is None:  # the key came from another rank, which did not build: scan
                listing = scan()
                new, source = listing_keys(*listing)
                if new != key:
                    key = new
                    continue
            lock.phase("building", len(listing[0]))
            if share is not None and source is None:
                source = listing_keys(*listing)[1]
            earlier = [] if share is None or source is None else _earlier(cls, folder, source, key)
            with reusing(earlier):
                built = build(*listing, lock.progress, *((folder / key,) if remote else ()))
            del earlier
            lock.phase("saving", len(built))
            try:
                built.save(store, mode=0o600)
            except OSError as err:  # a full disk: the spool holds the data's other copy
                full = None
                if remote and err.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                    full = spool_full(err, spool_files(folder / key)[0])
                if full is None:
                    raise
                raise full from err
            shown = _source(request)
            if share is not None:  # `gpucache cache list` tells the layouts of one source apart
                shown += f" (node {share.node} of {share.nodes})"
            info: dict[str, Any] = {
                "source": shown,
                "samples": len(built),
                "created": time.time(),
            }
            if share is not None and source is not None:  # every layout's key: see _earlier
                info["layouts"] = source
            write_private(folder / f"{key}.info", json.dumps(info).encode())
            if remote:  # the store is saved: the fetched objects are no longer needed
                for spool in spool_files(folder / key):
                    spool.unlink(missing_ok=True)
            cache = _open(cls, store)
            if cache is None:
                raise CacheFormatError(f"{store}: the store just saved does not open again")
            cache.report = built.report
            clean_cmd = "gpucache cache clean --all" + (
                "" if cache_dir is None else f" --dir {os.fspath(cache_dir)}"
            )
            log.warning(
                "gpucache: built the node store %s (%s samples, %.1f MB) once for the ranks "
                "of this node; it stays for later runs, remove it with `%s`",
                store,
                len(built),
                store.stat().st_size / 1e6,
                clean_cmd,
            )
        if max_bytes is not None:
            clean(folder, max_bytes=max_bytes)
        return cache


def _earlier(cls: type[S], folder: Path, source: str, key: str) -> list[S]:
    """This node's stores of other layouts of ``source`` (held open while they are read)."""
    out = []
    for e in entries(folder):
        if e.key == key or e.layouts != source:
            continue
        cache = _open(cls, e.path)
        if cache is not None:
            out.append(cache)
    return out


def built_for(
    cls: type[S],
    scan: Callable[[], Listing],
    build: Callable[..., S],
    request: Sequence[Any],
    options: BuildOptions,
    *,
    remote: bool = False,
) -> S:
    """:func:`built_once` in the cache folder ``options`` name (with its size cap), the store
    held to their ``max_pixels``."""
    cache = built_once(cls, scan, build, request, options, remote=remote)
    cache.max_pixels = options.max_pixels
    return cache


def _source(request: Sequence[Any]) -> str:
    first = request[0]
    if isinstance(first, (str, os.PathLike)):
        return os.fspath(first)
    n = len(first)
    return f"{n} file{'' if n == 1 else 's'}" + (f", first {os.fspath(first[0])}" if n else "")


def _scan_once(
    folder: Path, scan: Callable[[], Listing], request: Sequence[Any], stall: float
) -> tuple[str, Listing | None, str | None]:
    """The listing key, scanned by the first rank of the node (then ``(key, listing, source)``)
    or taken from the file it wrote (then ``(key, None, source)``); ``source``: the key every node
    layout of the listing shares (:func:`listing_keys`)."""
    h = hashlib.blake2b(_KEY_VERSION + b"-request", digest_size=16)
    first = request[0]
    h.update(
        os.fsencode(first)
        if isinstance(first, (str, os.PathLike))
        else b"\0".join(os.fsencode(p) for p in first)
    )
    _hash(h, request[1:])
    name = h.hexdigest()
    result = folder / f"{name}.scan"
    with NodeLock(folder / f"{name}.scan.lock", result, stall) as lock:
        r = read_json(result) or {}
        written, nonce = r.get("written", 0), r.get("nonce")
        if (
            isinstance(r.get("key"), str)
            and nonce not in _used
            and written >= _started()
            and time.time() - written < SCAN_FRESH_S
        ):
            _used.add(nonce)
            source = r.get("source")
            return r["key"], None, source if isinstance(source, str) else None
        lock.phase("scanning")
        listing = scan()
        key, source = listing_keys(*listing, on_progress=lock.progress)
        nonce = os.urandom(8).hex()
        _used.add(nonce)
        found = {"key": key, "source": source, "written": time.time(), "nonce": nonce}
        write_private(result, json.dumps(found).encode())
        return key, listing, source


def _started() -> float:
    """When this process started (seconds since the epoch, to the kernel's clock tick)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
        boot = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        import psutil

        created: float = psutil.Process().create_time()  # psutil ships no types
        return created


def _open(cls: type[S], store: Path) -> S | None:
    """The saved store mapped and held (shared flock, so it counts as in use), or None."""
    fd, why = open_own(store)
    if fd is None:
        if why != "missing":
            log.warning("gpucache: rebuilding %s, which %s", store, why)
        return None
    try:
        if not hold_shared(fd):
            os.close(fd)
            return None
        try:
            os.utime(fd)  # the last use, for `gpucache cache list` and the size cap
        except OSError:  # a read-only file system: the store opens all the same
            pass
        cache = cls.open(store)
    except CacheFormatError as err:
        os.close(fd)
        log.warning("gpucache: rebuilding %s, which does not open: %s", store, err)
        return None
    except BaseException:
        os.close(fd)
        raise
    weakref.finalize(cache, os.close, fd)
    return cache
