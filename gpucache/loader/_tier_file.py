"""The decoded tier's file in the node cache folder: opened when it is there, else built by the
first rank of the node under the node lock while the others wait (``node/_lock.py``, the
store's lock), written atomically (``store/_save.py``), and the reason when it cannot be.

The writer is the caller's (``write(fd, progress)``): the loader's tier
(:func:`gpucache.loader._tier_build.into_file`) and any other tier of the same format share the
rest.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from .._errors import CacheFormatError
from ..node._dir import checked_dir, hold_shared, open_own
from ..node._lock import NodeLock
from ..store import _decoded
from ..store._decoded import DecodedPixels
from ..store._save import write_atomic

log = logging.getLogger(__name__)

STALL_S = 900.0  # ranks waiting for the node's build give up when it reports nothing this long
#: what a write that cannot be done here raises (the tier then falls back), not a bug
WRITE_ERRORS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)
#: ``write(fd, progress)``: fill the open file ``fd``, calling ``progress(done, total)``
Writer = Callable[[int, Callable[[int, int], None]], None]


def once_per_node(
    folder: Path,
    key: str,
    *,
    digest: bytes,
    side: int,
    mode: str,
    need: int,
    samples: int,
    write: Writer,
) -> tuple[DecodedPixels | None, str | None]:
    """The tier ``<key>.pixels`` of the store ``digest`` in ``folder``, opened, or built there by
    the first rank of the node with ``write`` (the others wait); ``(None, why)`` when it cannot
    be written there (``need`` bytes for ``samples`` images)."""
    try:
        real = checked_dir(folder)
    except OSError as err:
        return None, f"the cache folder {folder} cannot be used: {err.strerror or err}"
    path = real / f"{key}.pixels"
    found = open_file(path, digest, side, mode)
    if found is not None:
        return found, None
    try:
        with NodeLock(real / f"{key}.pixels.lock", path, STALL_S) as lock:
            found = open_file(path, digest, side, mode)  # built by another rank meanwhile
            if found is not None:
                return found, None
            why = no_room(real, need)
            if why is not None:
                return None, why
            lock.phase("decoding", samples)

            def into(f: BinaryIO) -> None:
                write(f.fileno(), lambda done, total: lock.progress("decoding", done, total))

            write_atomic(path, into, mode=0o600)
            log.info("gpucache: built the decoded tier %s (%.1f MB)", path, need / 1e6)
            found = open_file(path, digest, side, mode)
    except OSError as err:
        if err.errno not in WRITE_ERRORS:
            raise
        return None, f"writing it in {real} failed: {err.strerror} (errno {err.errno})"
    if found is None:
        raise CacheFormatError(f"{path}: the decoded tier just written does not open again")
    return found, None


def no_room(folder: Path, need: int) -> str | None:
    """Why a ``need``-byte file cannot be written in ``folder`` (free space, RLIMIT_FSIZE)."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if soft != resource.RLIM_INFINITY and need > soft:
            return (
                f"the file-size limit (ulimit -f / RLIMIT_FSIZE) is {soft:,} bytes, less than "
                "the file's"
            )
    except ImportError:  # not on Windows
        pass
    st = os.statvfs(folder)
    free = st.f_bavail * st.f_frsize
    if need + (8 << 20) > free:
        return f"{folder} has {free:,} bytes free, less than the file's and 8 MiB to spare"
    return None


def open_file(path: Path, digest: bytes, side: int, mode: str) -> DecodedPixels | None:
    """The tier at ``path`` if it is this user's own and of this store, side and mode (held
    with a shared ``flock`` while mapped, so ``gpucache cache clean`` leaves it)."""
    fd, why = open_own(path)
    if fd is None:
        if why != "missing":
            log.warning("gpucache: rebuilding %s, which %s", path, why)
        return None
    try:
        if not hold_shared(fd):  # removed meanwhile
            os.close(fd)
            return None
        try:
            os.utime(fd)  # the last use, for `gpucache cache list` and the size cap
        except OSError:  # a read-only file system: the tier opens all the same
            pass
        pixels = _decoded.open_tier(path, fd)
    except CacheFormatError as err:
        log.warning("gpucache: rebuilding %s: %s", path, err)
        return None
    if (pixels.key, pixels.side, pixels.mode) != (digest, side, mode):
        log.warning("gpucache: rebuilding %s, which is another store's or side's", path)
        return None
    return pixels
