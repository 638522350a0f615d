"""Saving a store atomically, into a folder that another user may be able to write.

``save_atomic`` opens the destination folder once and names every file relative to that
descriptor, so the folder cannot be swapped for another (a link repointed, a parent renamed)
half-way. The temporary file is created ``O_CREAT | O_EXCL | O_NOFOLLOW`` mode 0600 and from
then on reached only through its descriptor: written, ``fsync``'ed and given its final mode with
``fchmod``. A user who can write to the folder may still rename the temporary name or put a link
under it; that changes nothing of yours (no call follows the name), and before the rename the
save checks that the name holds the very file that was written: if not, it fails with a
``PermissionError`` saying so, instead of publishing their file under your name. (After the
rename, whoever can write the folder can replace the store's name like any other; a concurrent
save of this user does so too, and the last rename wins.)
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from ..base._owned import NOFOLLOW
from . import _format

log = logging.getLogger(__name__)

_LIVE: set[str] = set()  # this process's temporary files being written (NFS locks are per process)
_UMASK_LOCK = threading.Lock()


def save_atomic(
    path: Path, columns: _format.Columns, *, mode: int | None = None, threads: int | None = None
) -> None:
    """Write to a unique temporary name beside ``path``, fsync, rename, fsync the folder.

    Concurrent saves to one path (threads or processes) never share a temporary name: the last
    rename wins and every result is a complete store. The writer holds an exclusive ``flock``
    on its temporary file until the rename, so the temporary files that a killed writer left
    (``.<name>.<random>.tmp``) are told apart from a live writer's and removed by the next save
    (:func:`remove_stale_temps`)."""
    write_atomic(
        path,
        lambda f: _format.write(f, columns, checksums=True, threads=threads),
        mode=mode,
    )


def write_atomic(path: Path, write: Callable[[BinaryIO], object], *, mode: int | None) -> None:
    """:func:`save_atomic` for any file: ``write(f)`` fills the temporary file ``f`` (opened
    ``wb``), which is then fsync'ed and renamed to ``path`` (the decoded tier's file too)."""
    try:
        folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError) as err:
        raise FileNotFoundError(
            errno.ENOENT, "No such file or directory", str(path.parent)
        ) from err
    try:
        remove_stale_temps(path, folder)
        fd, name = _locked_temp(path.name, folder)
        ours = os.fstat(fd)
        tmp = str(path.parent / name)
        _LIVE.add(tmp)
        try:
            with open(fd, "wb") as f:
                write(f)
                f.flush()
                os.fchmod(fd, 0o666 & ~_umask() if mode is None else mode)
                os.fsync(fd)
                # still locked: nothing takes it for a dead writer's file
                if not _holds(folder, name, ours):
                    raise _replaced(tmp, path, folder)
                # no check after it: a concurrent save's rename may replace it at once, and
                # the last rename wins (who can write the folder can replace any name in it)
                os.rename(name, path.name, src_dir_fd=folder, dst_dir_fd=folder)
        except BaseException:
            if _holds(folder, name, ours):  # never another user's file put under the name
                try:
                    os.unlink(name, dir_fd=folder)
                except OSError:
                    pass
            raise
        finally:
            _LIVE.discard(tmp)
        os.fsync(folder)
    finally:
        os.close(folder)


def _holds(folder: int, name: str, st: os.stat_result) -> bool:
    """Whether ``name`` in ``folder`` is the file ``st`` describes (never following a link)."""
    try:
        return os.path.samestat(st, os.stat(name, dir_fd=folder, follow_symlinks=False))
    except OSError:
        return False


def _replaced(tmp: str, path: Path, folder: int) -> PermissionError:
    st = os.fstat(folder)
    who = f"owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}"
    return PermissionError(
        errno.EPERM,
        f"the temporary file {tmp} was renamed or replaced while the store was saved, so the "
        f"store was not saved to {path}: another user can change the names in {path.parent} "
        f"({who})",
        str(path),
    )


def _locked_temp(name: str, folder: int) -> tuple[int, str]:
    """A new temporary file beside ``name`` in ``folder``, 0600, exclusively flocked, still under
    its name: ``(fd, temporary name)``."""
    for _ in range(100):
        tmp = f".{name}.{secrets.token_hex(4)}.tmp"
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o600, dir_fd=folder)
        except FileExistsError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if _holds(folder, tmp, os.fstat(fd)):
                return fd, tmp
        except OSError as err:  # removed in between by a clean-up: take another name
            if err.errno != errno.EWOULDBLOCK:
                os.close(fd)
                raise
        os.close(fd)
    raise FileExistsError(f"could not create a temporary file beside {name}")


def remove_stale_temps(path: Path, folder: int | None = None) -> list[Path]:
    """Remove the temporary files of writers to ``path`` that died before their rename.

    A file counts as stale only when it is a regular file of this user whose ``flock`` can be
    taken (a live writer holds its own until the rename); it is removed while locked, after
    checking that the name still holds the file that was locked. ``folder``: ``path``'s folder,
    already open. Returns what was removed."""
    own = folder is None
    if folder is None:
        folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    removed = []
    prefix = f".{path.name}."
    try:
        for name in os.listdir(folder):
            if not name.startswith(prefix) or not name.endswith(".tmp"):
                continue  # what the pattern .<name>.*.tmp matches
            if len(name) < len(prefix) + 4:
                continue
            tmp = path.parent / name
            if str(tmp) in _LIVE:
                continue
            try:
                fd = os.open(name, os.O_RDONLY | NOFOLLOW | os.O_NONBLOCK, dir_fd=folder)
            except OSError:
                continue  # a link, gone already, or not ours to read
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                    continue
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if _holds(folder, name, st):
                    os.unlink(name, dir_fd=folder)
                    removed.append(tmp)
                    log.info(
                        "gpucache: removed %s, left by a writer that was killed (%d bytes)",
                        tmp,
                        st.st_size,
                    )
            except OSError:
                pass  # held by a live writer (EWOULDBLOCK), renamed or removed meanwhile
            finally:
                os.close(fd)
    finally:
        if own:
            os.close(folder)
    return removed


def _umask() -> int:
    with _UMASK_LOCK:  # os.umask can only be read by setting it: set it back at once
        mask = os.umask(0o022)
        os.umask(mask)
    return mask
