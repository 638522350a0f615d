"""Place a store in shared memory once, after checking there is room for it.

The shared copy is an ordinary store file in ``/dev/shm`` (a tmpfs): the room is checked with
``statvfs`` and then reserved with ``posix_fallocate`` before a byte is written, so a short tmpfs is a
clear error here instead of a SIGBUS in a worker later. The owner unlinks the file on ``close()``,
garbage collection or interpreter exit.
"""

from __future__ import annotations

import errno
import os
import tempfile
import uuid
from pathlib import Path

MARGIN_BYTES = 8 << 20  # room left for others (NCCL, torch) beside the store
MARGIN_FRACTION = 0.01


class SharedMemoryError(RuntimeError):
    """Not enough room (or no permission) to place a store in shared memory."""


def shm_dir() -> Path:
    return Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _short(need: int, free: int, where: Path, detail: str = "") -> SharedMemoryError:
    return SharedMemoryError(
        f"not enough shared memory for the cache: it needs {_mib(need)} (store plus margin) in "
        f"{where}, which has {_mib(free)} free{detail}. Spawn/forkserver workers can only attach "
        "to shared pages. Fixes: save the cache to a file and use that "
        "(cache.save('train.gpucache'); JpegCache.open('train.gpucache')), which workers map "
        "read-only; or give the container more shared memory (docker run --shm-size=8g, or "
        "--ipc=host); or use multiprocessing_context='fork' or num_workers=0, which need none."
    )


def create(nbytes: int, write, *, directory: Path | None = None) -> Path:
    """Create a shared file of ``nbytes``, fill it with ``write(fileobj)`` and return its path."""
    where = directory or shm_dir()
    need = nbytes + MARGIN_BYTES + int(MARGIN_FRACTION * nbytes)
    st = os.statvfs(where)
    free = st.f_bavail * st.f_frsize
    if free < need:
        raise _short(need, free, where)
    path = where / f"gpucache-{os.getpid()}-{uuid.uuid4().hex[:12]}.store"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, nbytes)  # reserve every page now: ENOSPC, never SIGBUS
        except OSError as err:
            if err.errno in (errno.ENOSPC, errno.EFBIG):
                raise _short(need, free, where, f" (reserving failed: {err.strerror})") from err
            if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
        with os.fdopen(os.dup(fd), "r+b") as f:
            write(f)
    except OSError as err:
        path.unlink(missing_ok=True)
        if err.errno in (errno.ENOSPC, errno.EFBIG):
            raise _short(need, free, where, f" (writing failed: {err.strerror})") from err
        raise
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    return path


def unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
