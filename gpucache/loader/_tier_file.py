"""The decoded tier's file in the node cache folder: opened when it is there, else built by the
first rank of the node under the node lock while the others wait (``node/_lock.py``, the
store's lock), written atomically (``store/_save.py``), and the reason when it cannot be.

The writer is the caller's (``write(fd, progress)``): the loader's tier
(:func:`gpucache.loader._tier_build.into_file`) and any other tier of the same format
(``gpucache.ultralytics``) share the rest.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, NamedTuple

import numpy as np

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


class Target(NamedTuple):
    """What a tier file holds: each image's size in it (``heights`` x ``widths``), and what its
    header records and opening checks: the tier's ``side`` and ``mode`` (``"short"`` or
    ``"long"``), the store's digest ``key`` and the ``decoder`` that made the pixels."""

    heights: np.ndarray
    widths: np.ndarray
    side: int
    mode: str
    key: bytes
    decoder: str


def once_per_node(
    folder: Path, name: str, target: Target, write: Writer
) -> tuple[DecodedPixels | None, str | None]:
    """The tier ``<name>.pixels`` holding ``target`` in ``folder``, opened, or built there by the
    first rank of the node with ``write`` (the others wait); ``(None, why)`` when it cannot be
    written there."""
    try:
        real = checked_dir(folder)
    except OSError as err:
        return None, f"the cache folder {folder} cannot be used: {err.strerror or err}"
    path = real / f"{name}.pixels"
    found = open_file(path, target)
    if found is not None:
        return found, None
    try:
        with NodeLock(real / f"{name}.pixels.lock", path, STALL_S) as lock:
            found = open_file(path, target)  # built by another rank meanwhile
            if found is not None:
                return found, None
            need = _decoded.layout(target.heights, target.widths).size
            why = no_room(real, need)
            if why is not None:
                return None, why
            lock.phase("decoding", len(target.heights))

            def into(f: BinaryIO) -> None:
                write(f.fileno(), lambda done, total: lock.progress("decoding", done, total))

            write_atomic(path, into, mode=0o600)
            log.info("gpucache: built the decoded tier %s (%.1f MB)", path, need / 1e6)
            found = open_file(path, target)
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


def open_file(path: Path, target: Target) -> DecodedPixels | None:
    """The tier at ``path`` if it is this user's own and holds ``target`` (its store, side and
    mode; held with a shared ``flock`` while mapped, so ``gpucache cache clean`` leaves it)."""
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
    if (pixels.key, pixels.side, pixels.mode) != (target.key, target.side, target.mode):
        log.warning("gpucache: rebuilding %s, which is another store's or side's", path)
        return None
    return pixels
