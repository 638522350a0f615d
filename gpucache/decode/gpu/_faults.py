"""How the nvjpeg backend tells a machine's fault from a bad sample.

A batched decode that fails may have met one corrupt JPEG (the backend then retries the batch
one sample at a time, and the CPU gets the last word), or the machine may be at fault, which no
retry on the CPU should hide:

- **out of device memory**, as torch says it (``torch.OutOfMemoryError``), as torchvision
  rethrows CUDA's (``RuntimeError("Error while decoding JPEG images: CUDA out of memory...")``),
  or as nvJPEG's own allocator says it: nvJPEG allocates its buffers with ``cudaMalloc``,
  outside torch's caching allocator, and reports a failure as status 5,
  ``NVJPEG_STATUS_ALLOCATOR_FAILURE`` (torchvision: "Failed to decode batch: 5", "Failed to
  initialize batch decoding: 5", "Failed to decode jpeg stream: 5"). Memory that torch's
  allocator caches but does not use is what nvJPEG misses most often, so on status 5 the backend
  empties that cache once and retries the batch; a second failure is ``torch.OutOfMemoryError``;
- **a decoder that cannot start** (nvJPEG's handle or hardware backend fails to initialise).
"""

from __future__ import annotations

import re

import torch

from ...store._oom import is_out_of_memory
from .._base import GPU_IN_FLIGHT
from ._fallback import out_of_memory

#: What decoders say when nvJPEG cannot start (torchvision: "Failed to initialize nvjpeg with
#: hardware backend: 5", "nvjpegCreateSimple failed"): never a bad sample.
_BROKEN = ("Failed to initialize nvjpeg", "nvjpegCreate", "Failed to create nvjpeg")
#: nvJPEG's status 5 from a decode call (its status is the number after the colon).
_ALLOCATOR = re.compile(
    r"(Failed to decode batch|Failed to initialize batch decoding|Failed to decode jpeg stream"
    r"|Failed to transfer jpeg to device|Failed to attach (?:device|pinned) buffer): 5\b"
    r"|NVJPEG_STATUS_ALLOCATOR_FAILURE"
)


def allocator_failure(err: BaseException) -> bool:
    """Whether ``err`` is nvJPEG's own allocator failing (status 5) during a decode."""
    return bool(_ALLOCATOR.search(str(err)))


def raise_if_out_of_memory(
    err: BaseException, decoder: str, device: torch.device, what: str, *, retried: bool
) -> None:
    """``torch.OutOfMemoryError`` with advice, from ``err``, if it says an allocation failed
    (torch's, CUDA's or nvJPEG's own). ``what`` the decoder was doing; ``retried``: after
    emptying torch's caching allocator and retrying once."""
    nvjpeg = allocator_failure(err)
    if not (nvjpeg or isinstance(err, torch.OutOfMemoryError) or is_out_of_memory(err)):
        return
    why = (
        "nvJPEG's own allocator failed (status 5, NVJPEG_STATUS_ALLOCATOR_FAILURE: it allocates "
        "outside torch's caching allocator)"
        + (", again after emptying torch's cache and retrying once" if retried else "")
        + "; "
        if nvjpeg
        else ""
    )
    raise out_of_memory(
        err,
        f"the nvjpeg backend ({decoder}'s decoder) {what}",
        device,
        f"{why}at least {GPU_IN_FLIGHT} batches are in flight: lower batch_size or "
        "prefetch_factor, or free memory held elsewhere",
    ) from err


def raise_if_broken(err: BaseException, decoder: str, device: torch.device) -> None:
    """A decoder that cannot start is no bad sample either: decoding every sample on the CPU,
    one warning each, would hide a broken GPU setup behind a slow epoch."""
    text = str(err)
    if any(s in text for s in _BROKEN):
        first = text.splitlines()[0]
        raise RuntimeError(
            f"gpucache: {decoder}'s decoder on {device} failed to start "
            f"({type(err).__name__}: {first}); nvJPEG did not initialise. Check the CUDA "
            "driver and that torchvision/TorchCodec were built with nvJPEG for this CUDA "
            "version, or decode on the CPU with backend='cpu'."
        ) from err
