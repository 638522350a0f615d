"""Out of memory is the machine's problem, never a sample's.

Every place that turns a failed decode, sniff or re-encode into a per-sample reason asks
:func:`is_out_of_memory` first and raises instead: a sample left out because its process ran short
of memory would shrink an epoch (or a store) without saying why, on a machine that is merely too
small for the batch. Allocators say it in several ways, all recognised here:

- ``MemoryError``: Python, PIL, NumPy (``Unable to allocate ... for an array``);
- ``RuntimeError``: torch's ``DefaultCPUAllocator: can't allocate memory`` (TorchCodec and
  torchvision allocate their output through it), ``CUDA out of memory``;
- ``ValueError``: libjpeg's ``Insufficient memory (case N)`` (the compiled decoders' errors);
- ``OSError`` with ``ENOMEM``: a mapping, or a library loaded on first use;

or an error raised ``from`` one of these.
"""

from __future__ import annotations

import errno

from .._errors import OutOfMemory

MORE = (
    "more memory (a higher address-space limit, RLIMIT_AS / ulimit -v, or the container's "
    "memory limit)"
)
#: What to change when a decode runs out of memory (in a worker or in the main process).
FIX = (
    f"use fewer workers (num_workers=), a smaller batch_size or prefetch_factor, or give "
    f"each process {MORE}"
)
#: ... and when a build (sniff, re-encode, restart markers) or a verify does.
BUILD_FIX = f"use fewer threads (num_threads=, --num-threads), or give the process {MORE}"
_SAID = (
    "can't allocate memory",
    "Cannot allocate memory",
    "not enough memory",
    "Insufficient memory",
    "out of memory",
)


def is_out_of_memory(err: BaseException | None) -> bool:
    """True if ``err`` (or what it was raised from) says an allocation failed."""
    for _ in range(8):  # a chain of causes; never a cycle in practice, bounded all the same
        if err is None:
            return False
        if isinstance(err, MemoryError):
            return True
        if isinstance(err, OSError) and err.errno == errno.ENOMEM:
            return True
        if isinstance(err, (RuntimeError, ValueError)) and any(s in str(err) for s in _SAID):
            return True
        err = err.__cause__
    return False


def raise_if_out_of_memory(err: BaseException, what: str, *, fix: str = FIX) -> None:
    """Raise :class:`OutOfMemory` (``what`` ran out) from ``err`` if it says an allocation
    failed: where ``err`` would otherwise become a sample's reason, or pass unexplained."""
    if is_out_of_memory(err):
        raise OutOfMemory(what, err, fix=fix) from err
