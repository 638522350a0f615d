"""The build's inputs: a path, or a :class:`Source` (a name, a size known before reading, and
``readinto``). Sizing and reading work on the input list as it is: no object per path is made.

A path is sized by ``stat`` and refused unless it is a regular file; it is read with a few system
calls (open with ``O_NONBLOCK``, so a path swapped for a FIFO cannot block; ``fstat``; ``readv``
of the first bytes, whose signature is sniffed before the rest is read; one more ``readv`` that
also catches a file that grew; close). Sizes are not trusted: :func:`size_of` caps them (and
sniffs the first bytes of a large input before its size is counted, so a sparse file of zeros
reserves nothing), and a file whose size changed between sizing and reading is refused.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from ..store._limits import too_big
from ._sniff import SniffError, check_signature

HEAD = 64  # bytes read and sniffed before the rest of an input is read
HEAD_FIRST = 64 << 10  # files larger than this are read head first (smaller: in one call)
SNIFF_BEFORE_RESERVING = 16 << 20  # larger inputs have their first bytes sniffed when sized


@runtime_checkable
class Source(Protocol):
    """One encoded image that is not a file of its own (bytes, a file-like, a tar member...).

    ``name`` is what reports and ``cache.paths`` show; ``nbytes`` is its size, known before
    reading; ``readinto(slot)`` fills exactly ``len(slot) == nbytes`` bytes or raises ``OSError``
    (or :class:`SniffError`). It is called once, from a build thread."""

    @property
    def name(self) -> str: ...

    @property
    def nbytes(self) -> int: ...

    def readinto(self, slot: memoryview) -> None: ...


class SeekableFile(Protocol):
    """What :class:`FileObjSource` reads: a seekable binary file (``open(path, "rb")``,
    ``io.BytesIO``, a file object of a tar or zip member...)."""

    def seek(self, offset: int, whence: int = ..., /) -> int: ...

    def tell(self) -> int: ...

    def read(self, size: int = ..., /) -> bytes: ...

    def readinto(self, buffer: memoryview, /) -> int | None: ...


@dataclass(frozen=True)
class BytesSource:
    """Bytes in memory (bytes, bytearray, memoryview, uint8 array): copied once, into the slot."""

    name: str
    data: bytes | bytearray | memoryview | np.ndarray

    # numpy's stubs give ndarray the buffer protocol only from Python 3.12 on (numpy#26783)
    @property
    def nbytes(self) -> int:
        return memoryview(self.data).nbytes  # type: ignore[arg-type]

    def readinto(self, slot: memoryview) -> None:
        slot[:] = memoryview(self.data).cast("B")  # type: ignore[arg-type]


class FileObjSource:
    """A seekable binary file-like object, from its current position to its end (or ``nbytes``).

    Sources that share one file object must share one ``lock`` (reads seek, then read)."""

    def __init__(
        self,
        name: str,
        file: SeekableFile,
        *,
        nbytes: int | None = None,
        lock: threading.Lock | None = None,
    ) -> None:
        self.name, self.file, self._lock = name, file, lock or threading.Lock()
        self._start = file.tell()
        if nbytes is None:
            nbytes = file.seek(0, os.SEEK_END) - self._start
            file.seek(self._start)
        self.nbytes = int(nbytes)

    def readinto(self, slot: memoryview) -> None:
        with self._lock:
            self.file.seek(self._start)
            done = 0
            while done < len(slot):
                got = self.file.readinto(slot[done:])
                if not got:
                    break
                done += got
            if done != len(slot) or self.file.read(1):
                raise SniffError(
                    "the input changed size while it was being read; rebuild the store"
                )


@dataclass(frozen=True)
class FileRangeSource:
    """``nbytes`` bytes at ``offset`` of the file at ``path`` (a tar member, a packed shard...).

    Read with ``os.preadv``, so many ranges of one file are read in parallel without a lock; the
    first bytes are sniffed before the rest is read."""

    name: str
    path: str | os.PathLike[str]
    offset: int
    nbytes: int

    def readinto(self, slot: memoryview) -> None:
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            n = len(slot)
            head = min(n, HEAD)
            self._pread(fd, slot[:head], 0)
            if n > head:  # a non-image is refused before the rest is read
                check_signature(bytes(slot[:head]), n)
                self._pread(fd, slot[head:], head)
        finally:
            os.close(fd)

    def _pread(self, fd: int, part: memoryview, start: int) -> None:
        done = 0
        while done < len(part):
            got = os.preadv(fd, [part[done:]], self.offset + start + done)
            if got == 0:
                raise SniffError(
                    f"file ends {len(part) - done} bytes before the end of the "
                    f"range [{self.offset}, {self.offset + self.nbytes})"
                )
            done += got


@dataclass(frozen=True)
class Refused:
    """An input known to be unusable before it is read (a shard that is not a tar or ends early,
    a tar member whose header claims more bytes than the shard holds): reported like any bad
    input, with ``reason``, and never read."""

    name: str
    reason: str


Input = str | os.PathLike[str] | Source | Refused


@dataclass(frozen=True)
class Samples:
    """What a build keeps of each input besides its bytes, the values that travel together from
    a source's reader to the store: ``labels`` (int64, one per input, -1 for none), the
    ``classes`` they index, ``metadata`` (one string per input, or None) and ``masks`` (one mask
    input per input, or None). The inputs go beside it: a build from storage knows these from
    its listing, and has its inputs once they are fetched."""

    labels: np.ndarray
    classes: list[str]
    metadata: Sequence[str] | None = None
    masks: Sequence[Input | None] | None = None


_SOURCE_TYPES: set[type] = set()  # types seen to satisfy Source (the protocol check is slow)
_GREW = bytearray(1)  # the byte past a file's listed size (never read: shared by the threads)


def file_type(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a folder"),
    ):
        if test(mode):
            return name
    return "not a plain file"


def name_of(x: object) -> str:
    if isinstance(x, (str, os.PathLike)):
        return os.fspath(x)
    return str(getattr(x, "name", f"<{type(x).__name__}>"))


def size_of(x: Input, max_pixels: int | None) -> int:
    """The input's size in bytes, capped under ``max_pixels`` (see :func:`._limits.too_big`);
    raises :class:`SniffError` (with the reason) for one that cannot
    be used, ``OSError`` when it cannot be stat'ed, ``TypeError`` for an input of the wrong type."""
    if isinstance(x, (str, os.PathLike)):
        st = os.stat(x)
        if not stat.S_ISREG(st.st_mode):
            raise SniffError(f"not a regular file ({file_type(st.st_mode)}), left unopened")
        size = st.st_size
    elif isinstance(x, Refused):
        raise SniffError(x.reason)
    elif type(x) in _SOURCE_TYPES or isinstance(x, Source):
        _SOURCE_TYPES.add(type(x))
        size = int(x.nbytes)
        if size < 0:
            raise SniffError(f"the source reports a negative size ({size} bytes)")
    else:
        raise TypeError(
            f"expected a path (str or os.PathLike) or a source with name, nbytes and "
            f"readinto (e.g. gpucache.ingest._build.BytesSource), got {type(x).__name__}"
        )
    why = too_big(size, max_pixels)
    if why is not None:
        raise SniffError(why)
    if size > SNIFF_BEFORE_RESERVING:
        _check_head(x, size)
    return size


def _check_head(x: Input, size: int) -> None:
    """Sniff the first bytes of a large file or file range before room is reserved for it."""
    if isinstance(x, (str, os.PathLike)):
        path, offset = x, 0
    elif isinstance(x, FileRangeSource):
        path, offset = x.path, x.offset
    else:  # bytes in memory, file objects: nothing is gained by looking first
        return
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        check_signature(os.pread(fd, HEAD, offset), size)
    finally:
        os.close(fd)


def read_into(x: str | os.PathLike[str] | Source, slot: memoryview) -> None:
    """Fill ``slot`` (exactly the size :func:`size_of` gave) with the input's bytes (an input
    :func:`size_of` accepted: never a :class:`Refused` one)."""
    if not isinstance(x, (str, os.PathLike)):
        x.readinto(slot)
        return
    fd = os.open(x, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SniffError(f"not a regular file ({file_type(st.st_mode)})")
        n = len(slot)
        if st.st_size != n:
            raise SniffError(
                f"the file changed size since it was listed ({n:,} -> "
                f"{st.st_size:,} bytes); rebuild the store"
            )
        done = 0
        if n > HEAD_FIRST:  # the first bytes: a non-image is refused before the rest is read
            while done < HEAD:
                got = os.readv(fd, [slot[done:HEAD]])
                if not got:
                    break
                done += got
            check_signature(bytes(slot[:done]), n)
        while done < n:  # _GREW is filled only if the file grew
            got = os.readv(fd, [slot[done:], _GREW])
            if not got:
                break
            done += got
        if done != n:
            raise SniffError("the file changed size while it was being read; rebuild the store")
    finally:
        os.close(fd)
