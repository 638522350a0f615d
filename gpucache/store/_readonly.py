"""Read-only memory for in-memory stores, so that they behave like mapped files.

numpy's read-only flag alone does not protect a store: an array that owns writable memory (or a
view of one) can be made writable again (``a.setflags(write=True)``, ``a.base[...] = 0``), and torch
ignores the flag. So an in-memory store keeps its arrays in an anonymous mapping that the kernel
maps read-only (``PROT_READ``) and Python sees as read-only (``mmap.ACCESS_READ``): no writable base
is reachable from any view, and a write that bypasses numpy (``torch.from_numpy(view)``) faults
(SIGSEGV) as it does on a mapped store file, instead of changing the store for every process.

:func:`writable_buffer` hands out memory that :func:`freeze` later turns read-only in place, so a
build that fills it needs no second copy. Other arrays are copied once into a read-only mapping.
Without ``mprotect`` (Windows) arrays are copied and only flagged read-only.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import warnings
import weakref
from collections.abc import Callable, Sequence

import numpy as np
import torch

_RW = mmap.PROT_READ | mmap.PROT_WRITE if hasattr(mmap, "PROT_READ") else 0
_writable: dict[int, mmap.mmap] = {}  # start address -> mapping, while a build fills it


def _mprotect() -> Callable[[int, int, int], int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.mprotect
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


_MPROTECT = _mprotect() if _RW else None


def _address(m: mmap.mmap) -> int:
    return np.frombuffer(m, dtype=np.uint8).ctypes.data


def _protect(addr: int, size: int, prot: int) -> None:
    assert _MPROTECT is not None  # called only where mprotect was found
    if _MPROTECT(addr, size, prot) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mprotect failed: {os.strerror(err)}")


def _mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """A shared anonymous mapping, read-only for Python and the kernel; its address."""
    try:
        m = mmap.mmap(-1, max(nbytes, 1), access=mmap.ACCESS_READ)
    except OSError as err:
        raise MemoryError(
            f"cannot allocate {nbytes / 2**20:,.1f} MiB for the store: {err.strerror}. The "
            "address-space limit (ulimit -v / RLIMIT_AS) is probably too low; raise it "
            "(ulimit -v unlimited)."
        ) from err
    return m, _address(m)


def writable_buffer(nbytes: int) -> np.ndarray:
    """A writable uint8 array to fill, which :func:`freeze` turns read-only without a copy."""
    if _MPROTECT is None or nbytes == 0:
        return np.empty(nbytes, dtype=np.uint8)
    m, addr = _mapping(nbytes)
    _protect(addr, len(m), _RW)
    raw = (ctypes.c_ubyte * nbytes).from_address(addr)
    # the array keeps the mapping alive (ctypes instances take attributes; the stubs declare none)
    raw.mapping = m  # type: ignore[attr-defined]
    _writable[addr] = m
    weakref.finalize(raw, _writable.pop, addr, None)
    return np.ctypeslib.as_array(raw)


def _region(a: np.ndarray) -> tuple[int, mmap.mmap] | None:
    if not a.flags.c_contiguous or a.nbytes == 0:
        return None
    start = a.ctypes.data
    for addr, m in _writable.items():
        if addr <= start and start + a.nbytes <= addr + len(m):
            return addr, m
    return None


def _view(m: mmap.mmap, offset: int, like: np.ndarray) -> np.ndarray:
    return np.frombuffer(m, dtype=like.dtype, count=like.size, offset=offset).reshape(like.shape)


def freeze(arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Read-only equivalents of ``arrays`` from which no writable memory can be reached."""
    if _MPROTECT is None:
        copied = [np.array(a, copy=True) for a in arrays]
        for a in copied:
            a.flags.writeable = False
        return copied
    out: list[np.ndarray | None] = [None] * len(arrays)
    copies, total = [], 0
    for k, a in enumerate(arrays):
        region = _region(a)
        if region is not None:  # filled in place: make it read-only now
            addr, m = region
            _protect(addr, len(m), mmap.PROT_READ)
            _writable.pop(addr, None)
            out[k] = _view(m, a.ctypes.data - addr, a)
        else:
            copies.append((k, total))
            total += -(-a.nbytes // 64) * 64
    if copies:
        m, addr = _mapping(total)
        _protect(addr, len(m), _RW)
        for k, at in copies:
            a = np.ascontiguousarray(arrays[k])
            ctypes.memmove(addr + at, a.ctypes.data, a.nbytes)
        _protect(addr, len(m), mmap.PROT_READ)
        for k, at in copies:
            out[k] = _view(m, at, arrays[k])
    return out  # type: ignore[return-value]  # every entry was filled above


def mapping_of(a: np.ndarray) -> mmap.mmap | None:
    """The anonymous mapping an in-memory store's array lives in (None for other memory)."""
    base: object = a
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    if isinstance(base, np.ndarray):  # a ctypes array's numpy view (a build's buffer)
        return mapping_of(base)
    held = getattr(base, "mapping", base)  # writable_buffer's ctypes array keeps its mapping
    return held if isinstance(held, mmap.mmap) else None


def tensor_over(a: np.ndarray) -> torch.Tensor:
    """``a`` as a tensor sharing its (read-only) memory, for the decoders; never handed to users,
    since torch ignores numpy's read-only flag (users get read-only numpy views). torch warns
    that the buffer is read-only: it is, by design. One filter scoped to that message from this
    module (``catch_warnings`` would swap the process-wide filter list, and this may run in a
    decode thread while the user's code adds filters); adding it again replaces it."""
    warnings.filterwarnings(
        "ignore",
        message="The given NumPy array is not writable",
        category=UserWarning,
        module=r"gpucache\.store\._readonly",
    )
    return torch.from_numpy(a)
