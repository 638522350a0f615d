"""An open store file: the descriptor is kept, and other processes attach to exactly that file.

A store is identified by what its first process opened, never by its path: the descriptor stays
open for the store's life, and a worker process attaches through ``/proc/<pid>/fd/<fd>`` (Linux),
which reaches the same inode even after the path was replaced or unlinked. What the child opened is
checked against what the parent recorded at open (device, inode, size, CRC-32 of the header, which
holds the index and data checksums). Without ``/proc`` the child opens the path and the same check
refuses a file that was replaced in between.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import weakref
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .._errors import CacheFormatError


@dataclass(frozen=True)
class Identity:
    dev: int
    ino: int
    size: int
    header_crc: int  # CRC-32 of the first HEAD_BYTES bytes


HEAD_BYTES = 256


def proc_fd_usable() -> bool:
    """True where a process can reopen another's descriptor through /proc/<pid>/fd (Linux)."""
    return os.path.isdir(f"/proc/{os.getpid()}/fd")


def _no_memory(name: str, size: int, err: OSError) -> MemoryError:
    return MemoryError(
        f"{name}: cannot map the {size / 2**20:,.1f} MiB store into this process: "
        f"{err.strerror}. The address-space limit (ulimit -v / RLIMIT_AS) is probably lower than "
        "what the process needs; raise it (ulimit -v unlimited) or use a smaller store."
    )


class Handle:
    """A read-only mapping of an open store file, with the descriptor that names it.

    ``path`` is the file's path when it has one (None for an unlinked shared-memory copy);
    ``name`` is what errors call it."""

    def __init__(self, fd: int, name: str, path: Path | None):
        self.name, self.path, self.pid = name, path, os.getpid()
        self.trusted = False  # True once attached to a file another process validated
        self._close = weakref.finalize(self, os.close, fd)
        self.fd: int | None = fd
        st = os.fstat(fd)
        if st.st_size == 0:
            self.close()
            raise CacheFormatError(
                f"{name}: empty file, not a gpucache store; rebuild it with `gpucache build`."
            )
        try:
            self.buf = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        except OSError as err:
            self.close()
            if err.errno == errno.ENOMEM:
                raise _no_memory(name, st.st_size, err) from err
            raise
        self.identity = Identity(
            st.st_dev, st.st_ino, st.st_size, zlib.crc32(self.buf[:HEAD_BYTES])
        )

    def close(self) -> None:
        """Release the descriptor; the mapping (and every view of it) stays valid."""
        self._close()
        self.fd = None

    def intact(self) -> bool:
        """False once the file was truncated under the mapping (reading past its end is SIGBUS)."""
        return self.fd is None or os.fstat(self.fd).st_size >= self.identity.size

    def __reduce__(self) -> tuple[Callable[..., Handle], tuple[object, ...]]:
        if self.fd is None:
            raise ValueError(
                f"{self.name}: this store was closed, so new processes cannot attach "
                "to it; open the file again (JpegCache.open) or call share() again."
            )
        return (
            attach,
            (
                self.name,
                None if self.path is None else str(self.path),
                self.pid,
                self.fd,
                self.identity,
            ),
        )


_NOT_REGULAR = {
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def _directory_error(path: Path) -> IsADirectoryError:
    try:
        stores = sorted(p.name for p in path.glob("*.gpucache"))[:5]
    except OSError:
        stores = []
    hint = (
        f"it holds {', '.join(stores)}: pass one of those, e.g. {path / stores[0]}"
        if stores
        else "pass the store file itself (e.g. DIR/train.gpucache), or build one with "
        "`gpucache build SRC -o FILE`"
    )
    return IsADirectoryError(
        errno.EISDIR, f"{path} is a directory, not a gpucache store file; {hint}"
    )


def _not_a_file(path: Path, mode: int) -> OSError | CacheFormatError:
    if stat.S_ISDIR(mode):
        return _directory_error(path)
    what = _NOT_REGULAR.get(stat.S_IFMT(mode), "not a regular file")
    return CacheFormatError(
        f"{path} is {what}, not a gpucache store file; a store is a regular "
        "file written by JpegCache.save() or `gpucache build`: pass its path"
    )


def open_path(path: Path) -> Handle:
    """Open a store file read-only. A path that is not a regular file (a directory, FIFO, device,
    socket), a missing, unreadable or empty file is a clear error naming it; nothing but a
    regular file is opened (checked before and after the open: a FIFO never blocks it)."""
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise _not_a_file(path, mode)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError as err:
        raise FileNotFoundError(
            errno.ENOENT,
            f"{path}: no such gpucache store; build one with "
            "`gpucache build SRC -o FILE` or JpegCache.save()",
        ) from err
    except PermissionError as err:
        raise PermissionError(
            err.errno,
            f"{path}: no permission to read this gpucache store "
            f"({err.strerror}); ask its owner to make it readable "
            "(chmod a+r) or copy it",
        ) from err
    except (IsADirectoryError, CacheFormatError):
        raise
    except OSError as err:
        raise OSError(
            err.errno, f"{path}: cannot open this gpucache store: {err.strerror}; check the path"
        ) from err
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):  # replaced between the stat and the open
        os.close(fd)
        raise _not_a_file(path, mode)
    return Handle(fd, str(path), path)


def attach(name: str, path: str | None, pid: int, fd: int, identity: Identity) -> Handle:
    """In another process: open exactly the file that process ``pid`` holds as ``fd``."""
    if proc_fd_usable():
        try:
            new = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            new = None  # the owner exited, or /proc is restricted (hidepid): try the path
        if new is not None:
            h = Handle(new, name, None if path is None else Path(path))
            if h.identity == identity:
                h.trusted = True  # the very file the parent validated
                return h
            h.close()  # the pid or descriptor number was reused by something else
    if path is None:
        raise CacheFormatError(
            f"{name}: cannot attach to the shared-memory store of process {pid}: that process "
            "exited or its descriptors are not reachable through /proc. Keep the process that "
            "shared the store alive while workers start, or save the store to a file "
            "(cache.save(path)) and pass JpegCache.open(path)."
        )
    try:
        h = open_path(Path(path))
    except FileNotFoundError as err:
        raise CacheFormatError(
            f"{path}: the store file was removed after it was opened (by "
            f"process {pid}); do not delete or overwrite a store file while "
            "loaders use it (save to a new name)."
        ) from err
    if h.identity != identity:
        h.close()
        raise CacheFormatError(
            f"{path}: the store file was replaced or changed after it was opened (by process "
            f"{pid}); opening it here would pair the new file's images with the old labels. Do "
            "not overwrite a store file while loaders use it: save to a new name and open that, "
            "or reopen the store (JpegCache.open) and start a new loader."
        )
    h.trusted = True
    return h
