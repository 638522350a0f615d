"""Building the decoded tier: every image decoded once, resized, streamed into its file or memory.

Sizes come from the store's records (the decoded size, EXIF orientation applied), so the whole
layout, and the bytes the tier needs, are known before a pixel is decoded: the budget and the
room on disk are checked first, the file is reserved (``posix_fallocate``) before the first
decode, and the pixels go out chunk by chunk in order, the data's CRC-32 computed on the way.
Memory beyond the tier itself: a few chunks of decoded images (bounded, whatever the store's
size).

Each chunk is decoded by :func:`gpucache.decode._core.decode_batch` with ``exact=True`` (the
full decode, EXIF orientation applied, PIL for other formats) and a plan that resizes the whole
image to its tier size (antialiased bilinear on uint8: the resize the raw path's ``Resize``
runs). A sample that fails, or that libjpeg warned about, is marked to be decoded from the
store at batch time, so it behaves exactly as it does without the tier.

The chunks are decoded on one thread a usable core; while they run, torch's own intra-op
threads are set to 1 and put back after (each decode thread's resize spreading over every core
too made the build 4.8x slower on 2 cores: 139 against 667 images/s on the 397 photos of the
benchmarks). A loader is made before training starts, so nothing else runs torch meanwhile.
"""

from __future__ import annotations

import ctypes
import os
import sys
import zlib
from collections.abc import Callable

import numpy as np
import torch

from ..base._cores import usable_cores
from ..base._plan import Col
from ..base._progress import tqdm
from ..base._threads import ordered_map
from ..decode._core import decode_batch
from ..store import _decoded, _readonly
from ..store._decoded import FROM_STORE, DecodedPixels, Layout
from ..store._store import Store
from ..transforms._geometric import identity_plans
from ._tier_file import Target

CHUNK = 32  # images a decode task
Sink = Callable[[int, memoryview], None]  # write(offset in the file, bytes)


def tier_sizes(
    heights: np.ndarray, widths: np.ndarray, side: int, mode: str
) -> tuple[np.ndarray, np.ndarray]:
    """Each image's size in the tier: its short side (``mode="short"``) or long side
    (``"long"``) made ``side``, aspect kept; an image already within it is kept as it is.

    The short form rounds as ``transforms.Resize(side)`` does and the long form as
    ``transforms.Letterbox(side)``, so those transforms find the tier's images already at their
    size and do not resize them again."""
    h, w = np.asarray(heights, np.int64), np.asarray(widths, np.int64)
    short, long = np.minimum(h, w), np.maximum(h, w)
    if mode == "short":
        new_short = np.full_like(short, side)
        new_long = np.array([int(side * lo / sh) for sh, lo in zip(short.tolist(), long.tolist())])
        shrink = short > side
    else:
        scale = [side / lo for lo in long.tolist()]
        new_long = np.full_like(long, side)
        new_short = np.array(
            [max(1, min(side, round(sh * sc))) for sh, sc in zip(short.tolist(), scale)]
        )
        shrink = long > side
    new_long = new_long.reshape(short.shape).astype(np.int64)
    new_short = new_short.reshape(short.shape).astype(np.int64)
    tall = h > w
    th = np.where(shrink, np.where(tall, new_long, new_short), h)
    tw = np.where(shrink, np.where(tall, new_short, new_long), w)
    return th, tw


def build(
    cache: Store,
    target: Target,
    lay: Layout,
    sink: Sink,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[np.ndarray, int]:
    """Decode every sample of ``cache`` to its size in ``target`` and write its pixels through
    ``sink`` at the data offsets of ``lay``: ``(status, data CRC-32)``."""
    n = len(cache)
    status = np.zeros(n, dtype=np.uint8)
    crc = 0
    base = lay.data[0]
    threads = usable_cores()
    starts = range(0, n, CHUNK)
    shown = tqdm(total=n, desc="gpucache decoded tier", unit="image", disable=None)
    previous = torch.get_num_threads()
    if threads > 1:  # one torch thread a decode thread (see the module's docstring)
        torch.set_num_threads(1)
    try:
        done = 0
        for start, (images, kept, dropped) in zip(
            starts, ordered_map(_chunk_task(cache, target.heights, target.widths), starts, threads)
        ):
            stop = min(n, start + CHUNK)
            lo, hi = int(lay.offsets[start]), int(lay.offsets[stop])
            chunk = np.zeros(hi - lo, dtype=np.uint8)  # failed samples' slots stay zero
            for i, y in zip(kept, images):
                at = int(lay.offsets[i]) - lo
                hwc = torch.from_numpy(chunk[at : at + y.numel()]).view(y.shape[1], y.shape[2], 3)
                hwc.copy_(y.permute(1, 2, 0))
            status[dropped] = FROM_STORE
            view = memoryview(chunk)  # type: ignore[arg-type]  # numpy#26783 (3.12 stubs)
            crc = zlib.crc32(view, crc)
            sink(base + lo, view)
            done = stop
            shown.update(stop - start)
            if progress is not None:
                progress(done, n)
    finally:
        torch.set_num_threads(previous)
        shown.close()
        _trim()
    return status, crc


def _trim() -> None:
    """Give the build's freed decode buffers back to the system (glibc's ``malloc_trim``): the
    training process would otherwise keep them in its heap for the rest of the run."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # another C library (musl has none)
        pass


def _chunk_task(
    cache: Store, heights: np.ndarray, widths: np.ndarray
) -> Callable[[int], tuple[list[torch.Tensor], list[int], list[int]]]:
    n = len(cache)

    def task(start: int) -> tuple[list[torch.Tensor], list[int], list[int]]:
        idx = np.arange(start, min(n, start + CHUNK), dtype=np.int64)
        s = cache.samples[idx]
        plans = identity_plans(s["height"].astype(np.int64), s["width"].astype(np.int64))
        plans[:, Col.RH], plans[:, Col.RW] = heights[idx], widths[idx]
        plans[:, Col.HEIGHT2], plans[:, Col.WIDTH2] = heights[idx], widths[idx]
        out = decode_batch(cache, idx, plans, stack=False)  # skip, exact: the defaults
        warned = {i for i, _ in out.warned}
        pairs = [(i, y) for i, y in zip(out.indices.tolist(), out.images) if i not in warned]
        kept = [i for i, _ in pairs]
        dropped = sorted(set(idx.tolist()) - set(kept))
        return [y for _, y in pairs], kept, dropped

    return task


def file_sink(fd: int) -> Sink:
    def write(offset: int, data: memoryview) -> None:
        while data.nbytes:
            wrote = os.pwrite(fd, data, offset)
            data, offset = data[wrote:], offset + wrote

    return write


def reserve(fd: int, size: int) -> None:
    """Reserve ``size`` bytes of the open file ``fd`` (a full disk or a file-size limit fails
    here, before anything is decoded)."""
    if hasattr(os, "posix_fallocate"):
        os.posix_fallocate(fd, 0, size)
    else:
        os.ftruncate(fd, size)


def write_index(sink: Sink, lay: Layout, target: Target, status: np.ndarray, crc: int) -> None:
    """The tier's index and header through ``sink``, once its pixels are written (``status``:
    each sample's, ``crc``: the data's CRC-32)."""
    index = _decoded.index_bytes(lay, target.heights, target.widths, status)
    sink(lay.index[0], memoryview(index))
    recipe = _decoded.Recipe(target.side, target.mode, target.key, target.decoder)
    head = _decoded.header_bytes(lay, recipe, n=len(status), index=index, data_crc=crc)
    sink(0, memoryview(head))


def into_file(
    fd: int, cache: Store, target: Target, progress: Callable[[int, int], None] | None = None
) -> None:
    """The whole tier into the open file ``fd``, reserved first."""
    lay = _decoded.layout(target.heights, target.widths)
    reserve(fd, lay.size)
    sink = file_sink(fd)
    status, crc = build(cache, target, lay, sink, progress)
    write_index(sink, lay, target, status, crc)


def into_memory(cache: Store, target: Target) -> DecodedPixels:
    """The whole tier in anonymous memory, made read-only once built (fork and inline use)."""
    lay = _decoded.layout(target.heights, target.widths)
    buf = _readonly.writable_buffer(lay.size)

    def write(offset: int, data: memoryview) -> None:
        buf[offset : offset + data.nbytes] = np.frombuffer(data, dtype=np.uint8)

    status, crc = build(cache, target, lay, write)
    write_index(write, lay, target, status, crc)
    return _decoded.in_memory(buf)
