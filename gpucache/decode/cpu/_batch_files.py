"""Batches handed from a CPU worker to the loop's process in a memory file, not through the socket.

A worker decodes a batch straight into the pages of an anonymous memory file (``memfd_create``,
Linux): the uint8 stack, or the float batch that Normalize writes sample by sample. It sends the
file's descriptor (``SCM_RIGHTS``) instead of the bytes; the loop's process maps it and wraps the
pages as the batch tensor. No byte is copied: a float32 batch of 64 x 3 x 224 x 224 (38.5 MB)
costs its receiver a mapping, where through the socket it cost two copies and the receiver's
fresh pages. The file lives as long as the batch tensor does; the worker closes its end as soon
as the descriptor is sent.

A memory file is not a file in ``/dev/shm``: its size is not bounded by that mount (a container's
64 MB ``/dev/shm`` does not limit it), and it is counted as the process's memory, as a malloc'd
buffer would be. Where there is none (not Linux, a sandbox that refuses the call) or a batch is
received into pinned memory (``pin_memory=True``), or a file-size rlimit is below the batch (a
memory file is a file: ``ftruncate`` fails with ``EFBIG``), batches go through the socket.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import os
import sys
from typing import cast

import torch

#: the receiver's page-aligned mapping holds at least one byte, so an empty batch maps too
_MIN_BYTES = 1


def available() -> bool:
    """Whether this platform has memory files whose descriptors can be sent on a socket."""
    return sys.platform.startswith("linux") and hasattr(os, "memfd_create")


class Allocator:
    """A worker's batch buffers in memory files; remembers each one's descriptor by its address
    until :meth:`take` hands it over for sending."""

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}  # start address of a mapping -> its memory file

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor in a fresh memory file (``torch.empty`` where that fails)."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        try:
            fd = os.memfd_create("gpucache-batch", os.MFD_CLOEXEC)
        except OSError:  # refused here (seccomp): the socket carries the batch
            return torch.empty(shape, dtype=dtype)
        try:
            os.ftruncate(fd, max(nbytes, _MIN_BYTES))
            flat = _map(fd, max(nbytes, _MIN_BYTES))
        except OSError:  # a file-size rlimit below the batch (EFBIG), no room to map: the
            os.close(fd)  # socket carries it (and plain memory reports what is short)
            return torch.empty(shape, dtype=dtype)
        except BaseException:
            os.close(fd)
            raise
        self._fds[flat.data_ptr()] = fd
        _populate(flat)
        return flat[:nbytes].view(dtype).view(shape)

    def take(self, t: torch.Tensor) -> int | None:
        """The memory file ``t`` lies in (the caller closes it once sent), or None."""
        return self._fds.pop(t.untyped_storage().data_ptr(), None)

    def release(self) -> None:
        """Close the descriptors of buffers never sent (a batch that failed)."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def attach(fd: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The batch a worker sent as memory file ``fd`` (closed here), as a tensor over its pages."""
    try:
        size = os.fstat(fd).st_size
        if size < max(nbytes, _MIN_BYTES):
            raise ValueError(f"a batch's memory file holds {size} bytes, {nbytes} expected")
        flat = _map(fd, size)
    finally:
        os.close(fd)
    return flat[:nbytes].view(dtype).view(shape)


#: ``madvise`` advice (Linux 5.14): fault in every page of a range, writable, in one call
_MADV_POPULATE_WRITE = 23


def _populate(flat: torch.Tensor) -> None:
    """Fault in every page of a fresh buffer in one call instead of one trap a page as it is
    written (a float32 batch of 64 at 224 x 224 is 9,400 pages); nothing where the kernel has
    no such advice."""
    libc = _libc()
    if libc is not None:
        libc.madvise(flat.data_ptr(), flat.numel(), _MADV_POPULATE_WRITE)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError):
        return None
    return libc


def _map(fd: int, size: int) -> torch.Tensor:
    """The ``size`` bytes of memory file ``fd`` mapped ``MAP_SHARED``, as a uint8 tensor that holds no
    descriptor (``fd`` may be closed at once: a batch kept by the caller costs no open file).
    Through ``/proc/self/fd``; ``mmap``, which keeps a copy of the descriptor, where that fails."""
    try:
        storage = torch.UntypedStorage.from_file(f"/proc/self/fd/{fd}", shared=True, nbytes=size)
    except (OSError, RuntimeError):  # no /proc
        return torch.frombuffer(mmap.mmap(fd, size), dtype=torch.uint8)
    return torch.empty(0, dtype=torch.uint8).set_(cast(torch.UntypedStorage, storage))
