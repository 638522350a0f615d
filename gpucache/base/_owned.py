"""Files of this user only: opened once, never through a link, checked on the descriptor.

Every file gpucache keeps in a folder of its own (node stores, their locks and records, the
spool and journal of objects fetched from storage) is opened with :func:`open_own`: the name is
resolved once (``O_NOFOLLOW``: a symbolic link is refused, not followed; ``O_NONBLOCK``: a FIFO
planted under the name cannot hang the open) and what was opened is checked with ``fstat``: a
regular file of this user that neither group nor others may write. Callers keep the descriptor
and never open the name again, so nothing can be swapped in between the check and the use.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def open_own(path: Path, flags: int = os.O_RDONLY, mode: int = 0o600) -> tuple[int | None, str]:
    """``(fd, "")`` for a regular file of this user at ``path`` that group and others cannot
    write (created with ``mode`` under ``O_CREAT``); ``(None, why)`` when missing or anything
    else (a link, a FIFO, a file of another user, a file others may write)."""
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
        else f"has mode {stat.S_IMODE(st.st_mode):04o}, writable by group or others"
        if st.st_mode & 0o022
        else ""
    )
    if why:
        os.close(fd)
        return None, why
    os.set_blocking(fd, True)
    return fd, ""
