"""What the node cache folder holds, and removing stores by age, by total size, or all of them.

A store counts as in use while any process holds a shared ``flock`` on it (every process that
opened it through the node cache does, for as long as the store lives) or while its build lock is
held; such a store is listed as in use and never removed.
"""

from __future__ import annotations

import fcntl
import os
import time
from dataclasses import dataclass
from pathlib import Path

from ._dir import in_use, open_own, read_json


@dataclass
class Entry:
    key: str
    path: Path
    nbytes: int
    last_used: float  # seconds since the epoch: the store's mtime, set at every open
    in_use: bool
    source: str | None  # what it was built from, if recorded

    @property
    def age_s(self) -> float:
        return max(0.0, time.time() - self.last_used)


def entries(folder: Path) -> list[Entry]:
    """Every store in ``folder``, least recently used first."""
    out = []
    for path in folder.glob("*.gpucache"):
        key = path.name[:-len(".gpucache")]
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        info = read_json(folder / f"{key}.info") or {}
        out.append(Entry(key, path, st.st_size, st.st_mtime,
                         in_use(path) or in_use(folder / f"{key}.lock"), info.get("source")))
    return sorted(out, key=lambda e: e.last_used)


def clean(folder: Path, *, older_than: float | None = None, max_bytes: int | None = None,
          everything: bool = False, dry_run: bool = False) -> list[Entry]:
    """Remove stores not in use: all (``everything``), those unused for ``older_than`` seconds,
    then the least recently used until the rest fit in ``max_bytes``. Returns what was removed."""
    stores = entries(folder)
    total = sum(e.nbytes for e in stores)
    removed = []
    for e in stores:
        doomed = (everything or (older_than is not None and e.age_s > older_than)
                  or (max_bytes is not None and total > max_bytes))
        if not doomed or e.in_use:
            continue
        if dry_run or _remove(folder, e):
            removed.append(e)
            total -= e.nbytes
    if not dry_run:
        _tidy(folder)
    return removed


def _remove(folder: Path, e: Entry) -> bool:
    fd, why = open_own(e.path)
    if fd is None:
        if why == "missing":
            return False
        e.path.unlink(missing_ok=True)  # a link or FIFO left in place of a store
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails if a process opened it since
        e.path.unlink(missing_ok=True)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    (folder / f"{e.key}.info").unlink(missing_ok=True)
    return True


def _tidy(folder: Path) -> None:
    """Drop what no store needs: info files without a store, unheld locks, scan results, temp files
    of writers that died (a live writer holds a flock on its temp file, and a builder its lock)."""
    keys = {p.name[:-len(".gpucache")] for p in folder.glob("*.gpucache")}
    for p in folder.glob("*.info"):
        if p.name[:-len(".info")] not in keys:
            p.unlink(missing_ok=True)
    for p in folder.glob(".*.tmp"):
        key = p.name[1:].split(".", 1)[0]
        if not any(in_use(q) for q in (p, folder / f"{key}.lock", folder / f"{key}.scan.lock")):
            p.unlink(missing_ok=True)
    for p in folder.glob("*.lock"):
        if not in_use(p):  # a waiter that opened it just now notices and takes a new one
            p.unlink(missing_ok=True)
    for p in folder.glob("*.scan"):
        if not in_use(folder / f"{p.name}.lock"):
            p.unlink(missing_ok=True)
