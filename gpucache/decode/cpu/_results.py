"""A decoded batch as a worker sends it: a header (:class:`._messages.Message`), then its images
as one raw buffer, or the memory file they were decoded into (:mod:`._batch_files`), then its
masks as one raw buffer."""

from __future__ import annotations

import time

import numpy as np
import torch

from .._outcome import Decoded
from . import _batch_files
from ._messages import MaskLayout, frame


def packed(
    task: int, out: Decoded, alloc: _batch_files.Allocator | None
) -> tuple[bytes, memoryview | None, int | None]:
    """The header of a decoded batch and its one raw buffer, or the memory file that holds it
    (a stacked batch is sent as it is, uint8 or the dtype its steps made, its bytes as they
    lie: in the memory file it was decoded into, or copied once into one when the steps after
    the decode made a new tensor; a list is copied once into one buffer, image after image,
    each CHW). The copy counts as collate time, and as time the worker was busy."""
    started = time.perf_counter()
    imgs = out.images
    dtype, fd = "uint8", None
    if isinstance(imgs, torch.Tensor):
        dtype = str(imgs.dtype).removeprefix("torch.")
        if alloc is not None:
            imgs = imgs.contiguous()
            fd = alloc.take(imgs)
            if fd is None:  # made by a step after the decode: one copy into a memory file
                imgs = alloc.empty(tuple(imgs.shape), imgs.dtype).copy_(imgs)
                fd = alloc.take(imgs)
        shapes, flat = [tuple(imgs.shape)], imgs.contiguous().reshape(-1).view(torch.uint8)
    else:
        shapes = [tuple(t.shape) for t in imgs]
        flat = torch.empty(sum(t.numel() for t in imgs), dtype=torch.uint8)
        at = 0
        for t in imgs:
            flat[at : at + t.numel()].view(t.shape).copy_(t)
            at += t.numel()
    took = time.perf_counter() - started
    times = dict(out.times, collate=out.times.get("collate", 0.0) + took)
    head = frame(
        {
            "kind": "result",
            "task": task,
            "stacked": isinstance(imgs, torch.Tensor),
            "shapes": shapes,
            "indices": out.indices,
            "failed": out.failed,
            "warned": out.warned,
            "mismatched": out.mismatched,
            "times": times,
            "routes": out.routes,
            "busy": out.busy + took,
            "nbytes": flat.numel(),
            "dtype": dtype,
            "rng_state": out.rng_state,
            "fd": fd is not None,  # the bytes follow as a memory file's descriptor
            # the masks' bytes follow everything else, as one buffer (None: no masks)
            "masks": None if out.masks is None else mask_layout(out.masks),
        }
    )
    if fd is not None:
        return head, None, fd
    # numpy's stubs give ndarray the buffer protocol only from Python 3.12 on (numpy#26783)
    return head, memoryview(flat.numpy()), None  # type: ignore[arg-type]


def mask_layout(masks: torch.Tensor | list[torch.Tensor]) -> MaskLayout:
    """How the masks' one buffer is laid out: stacked or not, shapes, dtype, bytes."""
    if isinstance(masks, torch.Tensor):
        shapes, dtype = [tuple(masks.shape)], masks.dtype
    else:
        shapes = [tuple(m.shape) for m in masks]
        dtype = masks[0].dtype if masks else torch.uint8
    size = torch.empty((), dtype=dtype).element_size()
    return {
        "stacked": isinstance(masks, torch.Tensor),
        "shapes": shapes,
        "dtype": str(dtype).removeprefix("torch."),
        "nbytes": sum(int(np.prod(s)) for s in shapes) * size,
    }


def mask_bytes(out: Decoded) -> memoryview | None:
    """A batch's masks as one raw buffer (a stacked batch's own bytes; a list joined once)."""
    if out.masks is None:
        return None
    m = out.masks
    flat = (
        m.contiguous().reshape(-1)
        if isinstance(m, torch.Tensor)
        else torch.cat([t.reshape(-1) for t in m])
        if m
        else torch.empty(0, dtype=torch.uint8)
    )
    # numpy's stubs give ndarray the buffer protocol only from Python 3.12 on (numpy#26783)
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]
