"""One copy per node: the ranks of a node build a store once and all map the same file.

``JpegCache.from_folder(root)`` run in every rank of a node (torchrun, Slurm, Lightning DDP) would
build one in-memory copy per rank. Instead, when this process is one of several ranks (LOCAL_WORLD_SIZE
or WORLD_SIZE > 1, or an initialised process group) or a ``cache_dir`` is given:

- the store file's name is a hash of the source listing (every path with its size and mtime, the
  labels, classes and build options), in ``cache_dir`` or, by default for several ranks,
  ``<tempfile.gettempdir()>/gpucache-<uid>`` (node-local on clusters; set TMPDIR or pass cache_dir);
- a rank that finds the file opens it (milliseconds: nothing is read until decoded);
- otherwise it takes an exclusive ``flock`` on ``<hash>.lock``: the first rank to get it builds,
  saves atomically and opens the file; the others wait for the lock, then find the file and open it.
  The kernel drops a flock when its holder dies, so a crashed builder never blocks anyone: the next
  rank to get the lock removes the crashed builder's temporary file and builds. The holder removes
  the lock file before releasing it; a waiter that then holds a removed file's lock tries again.

A changed folder (a file added, removed, resized or touched) hashes differently and is rebuilt; the
old file stays until removed by hand. A single process with no ``cache_dir`` builds in memory and
writes nothing, as before.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import socket
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from pathlib import Path

from . import _dist
from ._format import CacheFormatError

log = logging.getLogger("gpucache")

LOCK_TIMEOUT_S = 3600.0  # how long a rank waits for another one building the store
_KEY_VERSION = b"gpucache-node-1"


def several_ranks() -> bool:
    """True when this process is one of several ranks (launcher variables or a process group)."""
    launched = _dist._env_int("WORLD_SIZE") or 1
    return _dist.local()[0] > 1 or _dist.world()[0] > 1 or launched > 1


def default_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"gpucache-{os.getuid()}"


def listing_key(paths: Sequence[str], extra: Sequence) -> str:
    """A hash of every path with its size and mtime, plus ``extra`` (labels, classes, options)."""
    h = hashlib.blake2b(_KEY_VERSION, digest_size=16)
    for p in paths:
        st = os.stat(p)
        h.update(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\n".encode("utf-8", "surrogateescape"))
    for item in extra:  # an array's repr elides its middle: hash its bytes
        h.update(item.tobytes() if hasattr(item, "tobytes") else repr(item).encode())
        h.update(b"\1")
    return h.hexdigest()


def built_once(cls, build: Callable[[], object], inputs: Sequence, extra: Sequence, *,
               cache_dir: str | os.PathLike | None, timeout: float = LOCK_TIMEOUT_S):
    """``build()`` once per node (or reuse the saved file of an unchanged listing); else in memory."""
    if cache_dir is None and not several_ranks():
        return build()
    if not all(isinstance(x, (str, os.PathLike)) for x in inputs):
        if cache_dir is not None:
            raise ValueError("cache_dir= needs file paths to key the saved store on (their names, "
                             "sizes and mtimes); bytes or file objects cannot be keyed. Build "
                             "without cache_dir and save it yourself (cache.save(path)).")
        log.warning("gpucache: every rank builds its own copy of a store made from bytes or file "
                    "objects; build it once, cache.save(path), and JpegCache.open(path) in each rank.")
        return build()
    paths = [os.fspath(x) for x in inputs]
    folder = Path(cache_dir) if cache_dir is not None else default_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = listing_key(paths, extra)
    store = folder / f"{key}.gpucache"
    cache = _open(cls, store)
    if cache is not None:
        return cache
    with _locked(folder / f"{key}.lock", timeout, store):
        cache = _open(cls, store)  # built by another rank while this one waited
        if cache is not None:
            return cache
        for tmp in folder.glob(f".{store.name}.tmp*"):  # left by a builder that was killed
            tmp.unlink(missing_ok=True)
        built = build()
        built.save(store)
        cache = cls.open(store)
        cache.report = built.report
        log.info("gpucache: built %s once for the ranks of this node", store)
        return cache


def _open(cls, store: Path):
    if not store.exists():
        return None
    try:
        return cls.open(store)
    except CacheFormatError as err:
        log.warning("gpucache: rebuilding %s, which does not open: %s", store, err)
        return None


@contextmanager
def _locked(path: Path, timeout: float, store: Path):
    """An exclusive flock on ``path``; the lock file is removed before it is released."""
    deadline = time.monotonic() + timeout
    next_note = time.monotonic() + 30
    while True:
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(
                    f"waited {timeout:.0f} s for another process ({holder or 'unknown'}) building "
                    f"{store}; it holds {path}. If that build is stuck, stop it (the lock goes "
                    "with its process), or pass another cache_dir.") from None
            if now > next_note:
                log.info("gpucache: waiting for %s to finish building %s", holder, store)
                next_note = now + 30
            time.sleep(0.1)
            continue
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the holder removed this lock file while we waited: take the new one
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode())
        yield
    finally:
        try:
            os.unlink(path)
        finally:
            os.close(fd)


def _read(fd: int) -> str:
    try:
        return os.pread(fd, 200, 0).decode(errors="replace")
    except OSError:
        return ""
