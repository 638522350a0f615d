"""Device-agnostic helpers of both GPU backends: split a batch, decode the rest on the CPU, join.

A GPU decoder takes only what :meth:`JpegCache.gpu_decodable` allows (8-bit Huffman JPEG with 1 or 3
components); PNG, GIF, WebP, CMYK and arithmetic JPEG go to the CPU path. A sample over the store's
pixel budget (:func:`gpucache.store._limits.check_pixels`) goes to neither: it fails like any bad sample,
before any decoder (GPU, or the CPU fallback after a GPU refusal) sees it. Each path yields one
result per batch position, an image or the reason it failed, and :func:`join` puts them back in
batch order. Nothing here touches CUDA, so CI runs it on CPU tensors.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable, Sequence
from typing import cast

import numpy as np
import torch

from ...store._limits import check_pixels
from ...store._store import Store
from ...transforms._device import to_device
from .._core import decode_batch
from .._options import DecodeOptions
from .._outcome import Decoded, failure

#: One sample's outcome: its image (uint8 CHW), or why it failed (see :func:`.cpu.describe`).
Result = torch.Tensor | str
#: Positions within the batch, their results (a list, or one stacked tensor), and whether they
#: took the CPU path (counted in ``Decoded.cpu_decoded``).
Part = tuple[np.ndarray, Sequence[Result] | torch.Tensor, bool]


def split(
    cache: Store, indices: np.ndarray, *, on_error: str
) -> tuple[np.ndarray, np.ndarray, Part]:
    """Positions the GPU decoder may take, those that must go to the CPU, and the refused part.

    A sample over the pixel budget is refused before any decoder sees it (``SampleError`` when
    ``on_error="raise"``); the refused part holds those positions and their reasons."""
    indices = np.asarray(indices, dtype=np.int64)
    refused, reasons = [], []
    for p, i in enumerate(indices.tolist()):
        try:
            check_pixels(cache, i)
        except ValueError as err:
            reasons.append(failure(cache, i, err, on_error))
            refused.append(p)
    ok = np.ones(len(indices), dtype=bool)
    ok[refused] = False
    gpu = cache.gpu_decodable()[indices]
    return (
        np.flatnonzero(ok & gpu),
        np.flatnonzero(ok & ~gpu),
        (np.asarray(refused, dtype=np.int64), reasons, False),
    )


def decode_on_cpu(
    cache: Store,
    indices: np.ndarray,
    plans: np.ndarray,
    positions: Iterable[int],
    options: DecodeOptions,
) -> list[Result]:
    """Decode and transform ``indices[positions]`` on the CPU, one result per position, as
    the cpu backend would: ``options.fill`` where a plan pads, ``options.exact`` (False: a
    reduced DCT scale where the plan shrinks enough). Masks are not decoded here: the GPU
    backends' mask stage (:mod:`._mask_stage`) decodes every sample's, these included.

    Raises :class:`~gpucache.SampleError` for a bad sample when ``options.on_error="raise"``.
    ``decode_batch`` checks the pixel budget itself, so no path into this fallback decodes a
    sample it refuses."""
    images_only = dataclasses.replace(options, masks=False) if options.masks else options
    out: list[Result] = []
    for p in positions:
        d = decode_batch(cache, indices[p : p + 1], plans[p : p + 1], images_only, stack=False)
        for _, reason in d.mismatched:  # decoded without its restart interval (see ._core)
            warnings.warn(f"gpucache: {reason}", RuntimeWarning, stacklevel=2)
        out.append(d.images[0] if d.images else d.failed[0][1])
    return out


def stage_times(took: dict[str, float]) -> dict[str, float]:
    """A GPU backend's stage seconds (``Decoded.times``) from what its stages measured: the
    batched decode (route ``full``), the CPU path (``fallback``), ``read``, ``resize`` and
    ``collate``."""
    full, fallback = took.get("full", 0.0), took.get("fallback", 0.0)
    return {
        "read": took.get("read", 0.0),
        "decode": full + fallback,
        "full": full,
        "fallback": fallback,
        "resize": took.get("resize", 0.0),
        "collate": took.get("collate", 0.0),
    }


def out_of_memory(
    err: BaseException, what: str, device: torch.device, advice: str
) -> torch.OutOfMemoryError:
    """Out-of-memory is no bad sample: an error that says where and what to change (the caller
    raises it ``from err``), never a per-sample retry or a CPU fallback that hides it."""
    first = str(err).splitlines()[0] if str(err) else type(err).__name__
    return torch.OutOfMemoryError(
        f"gpucache: {what} ran out of memory on {device}; {advice}. The allocator said: {first}"
    )


def join(
    n: int,
    parts: Iterable[Part],
    *,
    indices: np.ndarray,
    stack: bool,
    device: torch.device,
    out_hw: tuple[int, int] = (0, 0),
) -> Decoded:
    """Reassemble the parts of an ``n``-sample batch into one :class:`Decoded`, in batch order.

    Failed positions are left out and reported as ``(store index, reason)``; ``out_hw`` is the
    image size of an empty stacked batch (every sample failed). A stacked batch costs a constant
    number of ops whatever its size: each part's images are stacked where they are (CPU results
    on the CPU), moved in one copy (:func:`to_device`), and the parts are put in batch order by
    one ``index_select`` (none when they already are).
    """
    parts = [part for part in parts if len(part[0])]
    slots: list[Result | None] = [None] * n
    cpu_decoded = 0
    for positions, results, on_cpu in parts:
        if isinstance(results, torch.Tensor):
            results = list(results.unbind(0)) if len(results) == len(positions) else results
        for p, r in zip(positions.tolist(), results, strict=True):
            slots[p] = r
            cpu_decoded += bool(on_cpu and isinstance(r, torch.Tensor))
    if any(r is None for r in slots):
        raise ValueError(
            f"join: positions {[p for p, r in enumerate(slots) if r is None]} of a "
            f"{n}-sample batch have no result; every position needs one part."
        )
    filled = cast(list[Result], slots)  # every position has its result (checked above)
    kept = [p for p, r in enumerate(filled) if isinstance(r, torch.Tensor)]
    failed = [(int(indices[p]), r) for p, r in enumerate(filled) if not isinstance(r, torch.Tensor)]
    kept_indices = np.asarray(indices, dtype=np.int64)[kept]
    if not stack:
        images = [to_device(r, device) for r in filled if isinstance(r, torch.Tensor)]
        return Decoded(images, kept_indices, failed, cpu_decoded)
    if not kept:
        return Decoded(
            torch.empty((0, 3, *out_hw), dtype=torch.uint8, device=device),
            kept_indices,
            failed,
            cpu_decoded,
        )
    blocks, order = [], []
    for positions, results, _ in parts:
        pos = [p for p in positions.tolist() if isinstance(slots[p], torch.Tensor)]
        if not pos:
            continue
        if isinstance(results, torch.Tensor) and len(pos) == len(results):
            blocks.append(to_device(results, device))
        else:
            blocks.append(to_device(torch.stack([slots[p] for p in pos]), device))
        order += pos
    out = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
    if order != kept:  # kept is sorted: put the parts' rows in batch order
        perm = np.argsort(np.asarray(order, dtype=np.int64), kind="stable")
        out = out.index_select(0, to_device(torch.from_numpy(perm), device))
    return Decoded(out, kept_indices, failed, cpu_decoded)
