"""The node cache folder and the files in it, treated as a place other local users may attack.

The default folder ``<tempfile.gettempdir()>/gpucache-<uid>`` has a predictable name in a shared,
world-writable directory. As tmux, ssh-agent and ``XDG_RUNTIME_DIR`` users do, it is created 0700
and, if it already exists, checked with ``lstat``: a symbolic link, another owner or any
group/other permission bit is refused (another user could plant a store under your key, point
your lock file at one of your files, or read your stores). A ``cache_dir=`` you name may be a
link, and is refused if someone else owns it or group/others may write to it.

A folder is only as safe as the path to it, so, as ssh does for ``authorized_keys``, every
directory on the way is checked too, from ``/`` down, and every symbolic link on the way is
followed by hand: each directory must belong to root or this user and be writable by no one else
unless it is sticky (``/tmp``), and each link must belong to root or this user (it lies in a
directory already checked, so no one else can change it). Otherwise another user could swap a
folder of the path, or repoint a link, once it was checked, and plant a store or a spool under
your key. Missing folders are created (0755, the last 0700) only inside directories already
checked. Inside, every file is opened with :func:`~gpucache.base._owned.open_own`.

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

from ..base._owned import NOFOLLOW, open_own

__all__ = ["NOFOLLOW", "open_own", "checked_dir", "default_dir", "not_writable", "write_private"]
__all__ += ["read_json", "hold_shared", "in_use"]

FIX = (
    "pass cache_dir= a folder of your own on a node-local disk "
    "(e.g. cache_dir='/local/$USER/gpucache')"
)
_MAX_LINKS = 40  # as the kernel's ELOOP limit


def default_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"gpucache-{os.getuid()}"


def checked_dir(cache_dir: str | os.PathLike[str] | None, *, create: bool = True) -> Path:
    """The cache folder's real path, created if missing; PermissionError if another user could
    use it or change any directory or link on the way to it."""
    default = cache_dir is None
    folder = default_dir() if cache_dir is None else Path(cache_dir)
    try:
        real, where, st = _walk(folder, create=create, default=default)
    except OSError as err:
        clear = not_writable(err, folder, f"cannot reach or create the cache folder {folder}")
        if clear is err:
            raise
        raise clear from err
    if where is not None:  # a directory or link on the way
        owner = st.st_uid
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "a directory"
        why = (
            f"belongs to uid {owner}, not to root or this user (uid {os.geteuid()})"
            if owner not in (0, os.geteuid())
            else f"has mode {stat.S_IMODE(st.st_mode):04o}: group or others may write to it "
            "and it is not sticky"
        )
        raise PermissionError(
            errno.EPERM,
            f"refusing the gpucache cache folder {folder}: {where}, {kind} on the way to it, "
            f"{why}, so another user could swap what lies under it for a folder of their own once "
            "it was checked, and plant a store or a spool of fetched objects under your key. "
            f"Use a path that only you and root can change, or {FIX}.",
        )
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
    return real


def _walk(folder: Path, *, create: bool, default: bool) -> tuple[Path, str | None, os.stat_result]:
    """Resolve ``folder`` one name at a time from ``/``, following links by hand:
    ``(real path, None, lstat of the folder)``, or ``(_, the first untrusted directory or link on
    the way, its lstat)``. The default folder itself is not followed if it is a link."""
    uid = os.geteuid()
    text = os.fspath(folder)
    todo = (text if text.startswith("/") else f"{os.getcwd()}/{text}").split("/")[::-1]
    cur, links = "/", 0
    st = os.lstat(cur)
    while True:
        if not (st.st_uid in (0, uid) and (st.st_mode & 0o022 == 0 or st.st_mode & stat.S_ISVTX)):
            return Path(cur), cur, st
        while todo and todo[-1] in ("", "."):
            todo.pop()
        if not todo:
            return Path(cur), None, st  # the path ends here (at / or after a "..")
        name = todo.pop()
        if name == "..":
            cur = os.path.dirname(cur)
            st = os.lstat(cur)
            continue
        last = all(n in ("", ".") for n in todo)
        path = os.path.join(cur, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            if not create or (default and not last):
                raise
            try:
                os.mkdir(path, 0o700 if last else 0o755)
            except FileExistsError:
                pass
            st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode) and not (last and default):
            if st.st_uid not in (0, uid):
                return Path(path), path, st
            links += 1
            if links > _MAX_LINKS:
                raise OSError(errno.ELOOP, f"too many symbolic links on the way to {folder}")
            target = os.readlink(path)
            todo += target.split("/")[::-1]
            if target.startswith("/"):
                cur = "/"
            st = os.lstat(cur)  # the directory the target is resolved from (checked again)
            continue
        if last:
            return Path(path), None, st
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, f"{path} is not a directory", path)
        cur = path


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
