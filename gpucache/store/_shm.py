"""Place a store in shared memory once, after checking there is room for it.

The shared copy is an ordinary store file in ``/dev/shm`` (a tmpfs): the room is checked with
``statvfs`` and then reserved with ``posix_fallocate`` before a byte is written, so a short tmpfs is a
clear error here instead of a SIGBUS in a worker later.

It cannot outlive its owner: on Linux the name is unlinked as soon as the file is written, and only
the owner's descriptor keeps it; workers attach through ``/proc/<owner pid>/fd/<fd>`` (see
``_mapped``). The memory goes back to the system when the last process holding it exits, however it
exits (SIGKILL included). Where ``/proc`` is missing (macOS) the name has to stay until the owner
removes it on ``close()``, garbage collection or interpreter exit; a killed owner leaves it behind.
"""

from __future__ import annotations

import errno
import os
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from .._errors import SharedMemoryError
from ._mapped import proc_fd_usable

MARGIN_BYTES = 8 << 20  # room left for others (NCCL, torch) beside the store
MARGIN_FRACTION = 0.01
_FIXES = (
    "Fixes: save the store to a file and use that (cache.save('train.gpucache'); "
    "JpegCache.open('train.gpucache')), which workers map read-only; or use "
    "multiprocessing_context='fork' or num_workers=0, which need no shared memory"
)


def shm_dir() -> Path:
    return Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _short(need: int, free: int, where: Path, detail: str = "") -> SharedMemoryError:
    return SharedMemoryError(
        f"not enough shared memory for the store: it needs {_mib(need)} (store plus margin) in "
        f"{where}, which has {_mib(free)} free{detail}. Spawn/forkserver workers can only attach "
        f"to shared pages. {_FIXES}; or give the container more shared memory "
        "(docker run --shm-size=8g, or --ipc=host)."
    )


def _explain(err: OSError, nbytes: int, need: int, free: int, where: Path) -> SharedMemoryError:
    """A clear SharedMemoryError for what placing ``nbytes`` in ``where`` ran into."""
    if err.errno == errno.EFBIG:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        limit = "unlimited" if soft == resource.RLIM_INFINITY else _mib(soft)
        return SharedMemoryError(
            f"cannot place the {_mib(nbytes)} store in shared memory ({where}): the file-size "
            f"limit of this process (ulimit -f / RLIMIT_FSIZE) is {limit}. Raise it "
            f"(ulimit -f unlimited). {_FIXES}."
        )
    if err.errno == errno.ENOSPC:
        return _short(need, free, where, f" (reserving it failed: {err.strerror})")
    if err.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return SharedMemoryError(
            f"cannot create the shared-memory copy of the store in {where}: {err.strerror}. "
            f"Make {where} writable for this user (docker: drop a read-only /dev/shm mount). "
            f"{_FIXES}."
        )
    if err.errno == errno.ENOMEM:
        return no_address_space(nbytes, err)
    return SharedMemoryError(
        f"cannot place the {_mib(nbytes)} store in shared memory ({where}): "
        f"{err.strerror}. {_FIXES}."
    )


def no_address_space(nbytes: int, err: BaseException) -> SharedMemoryError:
    return SharedMemoryError(
        f"cannot map the {_mib(nbytes)} shared-memory copy of the store ({err}); the "
        "address-space limit (ulimit -v / RLIMIT_AS) is probably too low. Raise it "
        f"(ulimit -v unlimited), or use multiprocessing_context='fork' or num_workers=0."
    )


def create(
    nbytes: int, write: Callable[[BinaryIO], object], *, directory: Path | None = None
) -> tuple[int, Path | None]:
    """Create a shared file of ``nbytes`` filled by ``write(fileobj)``.

    Returns its open read-write descriptor and its path; the path is None when the name is already
    unlinked (Linux), otherwise the caller removes it with :func:`unlink`."""
    where = directory or shm_dir()
    need = nbytes + MARGIN_BYTES + int(MARGIN_FRACTION * nbytes)
    st = os.statvfs(where)
    free = st.f_bavail * st.f_frsize
    if free < need:
        raise _short(need, free, where)
    path = where / f"gpucache-{os.getpid()}-{uuid.uuid4().hex[:12]}.store"
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError as err:
        raise _explain(err, nbytes, need, free, where) from err
    keep_name = not proc_fd_usable()
    try:
        if not keep_name:
            os.unlink(path)  # from here on nothing but our descriptor holds the memory
        try:
            os.posix_fallocate(fd, 0, nbytes)  # reserve every page now: ENOSPC, never SIGBUS
        except OSError as err:
            if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
        with os.fdopen(os.dup(fd), "r+b") as f:
            write(f)
    except BaseException as err:
        os.close(fd)
        if keep_name:
            unlink(path)
        if isinstance(err, OSError):
            raise _explain(err, nbytes, need, free, where) from err
        raise
    return fd, path if keep_name else None


def unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
