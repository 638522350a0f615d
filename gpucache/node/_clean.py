"""What the node cache folder holds, and removing stores by age, by total size, or all of them.

A store counts as in use while any process holds a shared ``flock`` on it (every process that
opened it through the node cache does, for as long as the store lives) or while its build lock is
held; such a store is listed as in use and never removed.

The folder may also hold files that gpucache never wrote (a ``cache_dir=`` shared with a project,
a store saved there by hand). Only files that are provably the node cache's own are listed or
removed: a regular file of this user whose name is exactly one that the cache writes, built on a
32-hex-digit key (``<key>.gpucache``, ``<key>.info``, ``<key>.lock``, ``<key>.scan``,
``<key>.scan.lock``, the loader's decoded tiers ``<key>.pixels`` and their ``<key>.pixels.lock``,
and the ``.<name>.<8 characters>.tmp`` temporary names of its atomic writes),
and whose content is what the cache puts there (a store's magic, the JSON fields of its records).
Anything else is left alone, whatever its extension. The objects a build fetched from storage
(``<key>.fetch``, ``<key>.fetched``) stay after a killed build, so the next one resumes, as do
the members a node share of WebDataset shards kept (``<key>.kept``, made anew by the next
build); ``--all`` and ``--older-than`` remove them when their build is not running.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..store._decoded import MAGIC as PIXELS_MAGIC
from ..store._format import MAGIC
from ._dir import in_use, open_own, read_json

log = logging.getLogger(__name__)

_KEY = "[0-9a-f]{32}"
_STORE = re.compile(rf"({_KEY})\.(gpucache|pixels)")  # a store, or a decoded tier of one
_RECORD = re.compile(rf"({_KEY})\.(info|lock|scan|scan\.lock|pixels\.lock)")
_SPOOL = re.compile(
    rf"({_KEY})\.(fetch|fetched|kept)"
)  # objects fetched for a build (ingest.storage._fetch)
_TEMP = re.compile(
    rf"\.({_KEY})\.(gpucache|info|scan|pixels)\.[a-z0-9_]{{8}}\.tmp"
)  # mkstemp's names
# the JSON fields each record holds (node/_cache.py writes .info and .scan, node/_lock.py locks)
_FIELDS = {
    "info": {"source", "samples", "created"},
    "scan": {"key", "written", "nonce"},
    "lock": {"pid", "host", "phase"},
    "scan.lock": {"pid", "host", "phase"},
    "pixels.lock": {"pid", "host", "phase"},
}


@dataclass
class Entry:
    key: str
    path: Path
    nbytes: int
    last_used: float  # seconds since the epoch: the store's mtime, set at every open
    in_use: bool
    source: str | None  # what it was built from, if recorded
    layouts: str | None = None  # a node share's: the key every node layout of its source shares

    @property
    def age_s(self) -> float:
        return max(0.0, time.time() - self.last_used)


@dataclass
class Removed:
    """What a clean removed: stores, and leftovers (records and temporary files no store needs)."""

    stores: list[Entry] = field(default_factory=list)
    leftovers: list[Path] = field(default_factory=list)


def _own_file(path: Path, magic: bytes = b"") -> os.stat_result | None:
    """The ``stat`` of a regular file of this user at ``path`` that starts with ``magic``."""
    fd, _ = open_own(path)
    if fd is None:
        return None
    try:
        if magic and os.pread(fd, len(magic), 0) != magic:
            return None
        return os.fstat(fd)
    finally:
        os.close(fd)


def _is_record(path: Path, kind: str) -> bool:
    record = read_json(path)  # None unless a regular JSON file of this user
    return record is not None and _FIELDS[kind] <= record.keys()


def entries(folder: Path) -> list[Entry]:
    """Every store of the node cache in ``folder``, and every decoded tier (``<key>.pixels``, the
    loader's), least recently used first."""
    out = []
    for path in [*folder.glob("*.gpucache"), *folder.glob("*.pixels")]:
        m = _STORE.fullmatch(path.name)
        st = _own_file(path, MAGIC if path.suffix == ".gpucache" else PIXELS_MAGIC) if m else None
        if m is None or st is None:
            continue
        key = m[1]
        if m[2] == "pixels":  # a decoded tier: in use while mapped or being built
            busy = in_use(path) or in_use(folder / f"{key}.pixels.lock")
            out.append(Entry(key, path, st.st_size, st.st_mtime, busy, "decoded tier"))
            continue
        info = read_json(folder / f"{key}.info") or {}
        source, layouts = info.get("source"), info.get("layouts")
        out.append(
            Entry(
                key,
                path,
                st.st_size,
                st.st_mtime,
                in_use(path) or in_use(folder / f"{key}.lock"),
                source if isinstance(source, str) else None,
                layouts if isinstance(layouts, str) else None,
            )
        )
    return sorted(out, key=lambda e: e.last_used)


def clean(
    folder: Path,
    *,
    older_than: float | None = None,
    max_bytes: int | None = None,
    everything: bool = False,
    dry_run: bool = False,
) -> Removed:
    """Remove stores not in use: all (``everything``), those unused for ``older_than`` seconds,
    then the least recently used until the rest fit in ``max_bytes``; then the cache's own
    leftovers. Returns what was removed (with ``dry_run``, what would be)."""
    stores = entries(folder)
    total = sum(e.nbytes for e in stores)
    removed = Removed()
    for e in stores:
        doomed = (
            everything
            or (older_than is not None and e.age_s > older_than)
            or (max_bytes is not None and total > max_bytes)
        )
        if not doomed or e.in_use:
            continue
        if dry_run or _remove(folder, e):
            removed.stores.append(e)
            total -= e.nbytes
    if not dry_run:
        removed.leftovers = _tidy(folder)
        if everything or older_than is not None:
            removed.leftovers += _spools(folder, 0.0 if everything else older_than)
    for e in removed.stores:
        log.info(
            "gpucache: %s %s (%d bytes, unused for %.0f s)",
            "would remove" if dry_run else "removed",
            e.path,
            e.nbytes,
            e.age_s,
        )
    for p in removed.leftovers:
        log.info("gpucache: removed %s, which no store of the node cache needs", p)
    return removed


def _remove(folder: Path, e: Entry) -> bool:
    fd, _ = open_own(e.path)
    if fd is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails if a process opened it since
        if not os.path.samestat(os.fstat(fd), os.lstat(e.path)):
            return False  # replaced since it was listed
        e.path.unlink()
    except (BlockingIOError, FileNotFoundError):
        return False
    finally:
        os.close(fd)
    info = folder / f"{e.key}.info"
    if _is_record(info, "info"):
        info.unlink(missing_ok=True)
    return True


def _spools(folder: Path, older_than: float | None) -> list[Path]:
    """Remove the objects a build fetched from storage and left (killed; kept so the next build
    resumes) once unused for ``older_than`` seconds, unless their build is running now."""
    removed = []
    for p in sorted(folder.iterdir()):
        m = _SPOOL.fullmatch(p.name)
        st = _own_file(p) if m else None
        if m is None or st is None or in_use(folder / f"{m[1]}.lock"):
            continue
        if older_than is not None and time.time() - st.st_mtime >= older_than:
            p.unlink(missing_ok=True)
            removed.append(p)
    return removed


def _tidy(folder: Path) -> list[Path]:
    """Remove the cache's own files that no store needs: info records without a store, unheld
    locks, scan results nobody is writing, temporary files of writers that died (a live writer
    holds a flock on its temporary file, or its builder holds the key's lock). Returns them."""
    removed = []
    for p in sorted(folder.iterdir()):
        name = p.name
        if m := _RECORD.fullmatch(name):
            key, kind = m[1], m[2]
            if not _is_record(p, kind):
                continue
            if kind == "info":
                doomed = _own_file(folder / f"{key}.gpucache", MAGIC) is None
            elif kind == "scan":
                doomed = not in_use(folder / f"{key}.scan.lock")
            else:  # a waiter that opened it just now notices and takes a new one
                doomed = not in_use(p)
        elif m := _TEMP.fullmatch(name):
            key, kind = m[1], m[2]
            lock = folder / {"scan": f"{key}.scan.lock", "pixels": f"{key}.pixels.lock"}.get(
                kind, f"{key}.lock"
            )
            doomed = _own_file(p) is not None and not in_use(p) and not in_use(lock)
        else:
            continue
        if doomed:
            p.unlink(missing_ok=True)
            removed.append(p)
    return removed
