"""The node cache folder and the files in it, treated as a place other local users may attack.

The default folder ``<tempfile.gettempdir()>/gpucache-<uid>`` has a predictable name in a shared,
world-writable directory. As tmux, ssh-agent and ``XDG_RUNTIME_DIR`` users do, it is created 0700
and, if it already exists, checked with ``lstat``: a symbolic link, another owner or any
group/other permission bit is refused (another user could plant a store under your key, point
your lock file at one of your files, or read your stores). A ``cache_dir=`` you name is followed
if it is a link, and refused if someone else owns it or group/others may write to it. Inside,
every file is opened with ``O_NOFOLLOW`` (and stores with ``O_NONBLOCK``, so a FIFO planted under
a store's name cannot hang the open) and must be a regular file of this user; stores are 0600.

A store in use is held with a shared ``flock`` by every process that mapped it, so ``gpucache
cache clean`` and the size cap can tell (a non-blocking exclusive lock fails) and leave it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
FIX = (
    "pass cache_dir= a folder of your own on a node-local disk "
    "(e.g. cache_dir='/local/$USER/gpucache')"
)


def default_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"gpucache-{os.getuid()}"


def checked_dir(cache_dir: str | os.PathLike[str] | None, *, create: bool = True) -> Path:
    """The cache folder, created 0700 if missing; PermissionError if another user could use it."""
    default = cache_dir is None
    folder = default_dir() if cache_dir is None else Path(cache_dir)
    if create:
        try:
            if default:
                os.mkdir(folder, 0o700)
            else:
                folder.mkdir(mode=0o700, parents=True)
        except FileExistsError:
            pass
        except OSError as err:
            raise not_writable(err, folder, f"cannot create the cache folder {folder}") from err
    st = os.lstat(folder) if default else os.stat(folder)
    problems = []
    if stat.S_ISLNK(st.st_mode):
        problems.append("is a symbolic link")
    elif not stat.S_ISDIR(st.st_mode):
        problems.append("is not a directory")
    if st.st_uid != os.geteuid():
        problems.append(f"belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})")
    mode = stat.S_IMODE(st.st_mode)
    if default and mode & 0o077:
        problems.append(f"has mode {mode:04o}, open to group or others (it must be 0700)")
    elif not default and mode & 0o022:
        problems.append(f"has mode {mode:04o}, writable by group or others")
    if problems:
        raise PermissionError(
            errno.EPERM,
            f"refusing the gpucache cache folder {folder}: it {' and '.join(problems)}"
            ", so another user could plant a store under your key or read yours. Remove it if it "
            f"is yours and stale, or {FIX}.",
        )
    return folder


def not_writable(err: OSError, folder: Path, what: str) -> OSError:
    """A clear PermissionError for a read-only or forbidden cache folder (else ``err`` itself)."""
    if err.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
        return err
    why = "the file system is read-only" if err.errno == errno.EROFS else "no permission to write"
    return PermissionError(
        err.errno,
        f"{what}: {why} ({err.strerror}). A store already built "
        "there opens without writing; building one needs a writable folder: " + FIX + ".",
    )


def open_own(path: Path, flags: int = os.O_RDONLY, mode: int = 0o600) -> tuple[int | None, str]:
    """``(fd, "")`` for a regular file of this user at ``path`` (never through a link, never
    blocking on a FIFO); ``(None, why)`` when missing or anything else."""
    try:
        fd = os.open(path, flags | NOFOLLOW | os.O_NONBLOCK, mode)
    except FileNotFoundError:
        return None, "missing"
    except OSError as err:
        if err.errno == errno.ELOOP:
            return None, "is a symbolic link"
        if err.errno in (errno.ENXIO, errno.EWOULDBLOCK):  # a FIFO opened for writing, or a socket
            return None, "is not a regular file"
        raise
    st = os.fstat(fd)
    why = (
        "is not a regular file"
        if not stat.S_ISREG(st.st_mode)
        else f"belongs to uid {st.st_uid}"
        if st.st_uid != os.geteuid()
        else ""
    )
    if why:
        os.close(fd)
        return None, why
    os.set_blocking(fd, True)
    return fd, ""


def write_private(path: Path, data: bytes) -> None:
    """``data`` to ``path`` atomically, mode 0600 (a temp name from mkstemp, then rename)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with open(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_json(path: Path) -> dict[str, Any] | None:
    fd, _ = open_own(path)
    if fd is None:
        return None
    try:
        with open(fd, "rb") as f:
            value = json.loads(f.read(1 << 20))
        return value if isinstance(value, dict) else None
    except (OSError, ValueError):
        return None


def hold_shared(fd: int) -> bool:
    """A shared flock on an open store (kept as long as ``fd``); False if it was removed."""
    fcntl.flock(fd, fcntl.LOCK_SH)  # a cleaner holds LOCK_EX only while it unlinks the file
    return os.fstat(fd).st_nlink > 0


def in_use(path: Path) -> bool:
    """True when some process holds ``path`` (a store mapped, or a lock file held)."""
    fd, _ = open_own(path)
    if fd is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
