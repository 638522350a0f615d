"""Images for Ultralytics' datasets: a store's sample as ``BaseDataset.load_image`` returns it.

Ultralytics reads a file with ``cv2.imread`` (BGR, EXIF orientation applied) and resizes it so
its long side is ``imgsz`` (``ceil`` of each side times ``imgsz / max(h0, w0)``, at most
``imgsz``; smaller images are enlarged too) with ``cv2.resize(..., INTER_LINEAR)``. Here the
image comes from the store's bytes (the exact decode: libjpeg-turbo, EXIF applied; PIL for other
formats) and the very same ``cv2.resize``, so the pixels differ from Ultralytics' only by the two
JPEG decoders' rounding.

Two tiers, as the loader's (``gpucache.loader._tier``):

- ``decoded``: every image decoded and resized once, at Ultralytics' size, into one file of the
  decoded-tier format (``docs/reference/format.md``) beside the store in the node cache, built
  by one rank of the node under the node lock and mapped read-only by every rank and worker (no
  ``/dev/shm``, no copy a process); reused by later runs while the store, ``imgsz`` and the
  decoder are the same. Its resize is Ultralytics' (not the loader tier's antialiased one), so
  its files are named apart from the loader's.
- ``raw``: the JPEG decoded from the store at every ``load_image``.

The decoded tier falls back to the raw one (one warning naming the bytes and the fix) when it
needs more than its budget or its file cannot be written.
"""

from __future__ import annotations

import hashlib
import logging
import math
import warnings
import zlib
from collections.abc import Callable

import cv2
import numpy as np
import torch

from ..base._cores import usable_cores
from ..base._threads import ordered_map
from ..decode._sample import decode_sample
from ..loader._tier import default_budget
from ..loader._tier_build import _trim, file_sink, reserve, write_index
from ..loader._tier_file import Target, once_per_node
from ..loader._tier_key import decoder_version, store_digest
from ..store import _decoded
from ..store._decoded import FROM_STORE, IN_TIER, DecodedPixels
from ..store._store import Store

log = logging.getLogger(__name__)

CHUNK = 16  # images a build task
_TAG = b"gpucache-ultralytics-1"  # the resize rule and cv2's INTER_LINEAR: not the loader's tier


def resized_size(h0: int, w0: int, imgsz: int) -> tuple[int, int]:
    """``(h, w)`` as Ultralytics' ``load_image`` makes it (``rect_mode``, long side to imgsz)."""
    r = imgsz / max(h0, w0)
    if r == 1:
        return h0, w0
    return min(math.ceil(h0 * r), imgsz), min(math.ceil(w0 * r), imgsz)


def _hwc(rgb: torch.Tensor) -> np.ndarray:
    """A (3, H, W) uint8 tensor as an (H, W, 3) array (a view where its memory is HWC)."""
    hwc = rgb.permute(1, 2, 0).numpy()
    return hwc if hwc.flags.c_contiguous else np.ascontiguousarray(hwc)


def resized_rgb(rgb: torch.Tensor, imgsz: int) -> np.ndarray:
    """An RGB (3, H, W) uint8 image at Ultralytics' size, RGB HWC (``cv2.resize`` works on each
    channel alone, so resizing before Ultralytics' BGR swap gives the same pixels)."""
    hwc = _hwc(rgb)
    h0, w0 = hwc.shape[:2]
    h, w = resized_size(h0, w0, imgsz)
    if (h, w) != (h0, w0):
        hwc = cv2.resize(hwc, (w, h), interpolation=cv2.INTER_LINEAR)
    return hwc


def to_bgr_resized(rgb: torch.Tensor, imgsz: int) -> np.ndarray:
    """An RGB (3, H, W) uint8 image as Ultralytics' ``load_image`` returns it: BGR HWC, resized,
    a new array."""
    return cv2.cvtColor(resized_rgb(rgb, imgsz), cv2.COLOR_RGB2BGR)


def decode_bgr(cache: Store, j: int, imgsz: int) -> np.ndarray:
    """Store sample ``j`` decoded from its bytes, as Ultralytics' ``load_image`` returns it."""
    return to_bgr_resized(decode_sample(cache, j), imgsz)


class Pixels:
    """Where a dataset's images come from: ``tier`` is ``"decoded"`` or ``"raw"``."""

    def __init__(self, cache: Store, imgsz: int, pixels: DecodedPixels | None, reason: str | None):
        self.cache, self.imgsz, self.pixels, self.reason = cache, imgsz, pixels, reason
        self.tier = "raw" if pixels is None else "decoded"

    def load(self, j: int) -> np.ndarray:
        """Store sample ``j``, BGR HWC at Ultralytics' size (a private, writable array)."""
        p = self.pixels
        if p is not None and p.status[j] == IN_TIER:
            if p.handle is not None and not p.handle.intact():
                p.image(j)  # raises the tier's error: its file was truncated while in use
            h, w, at = int(p.heights[j]), int(p.widths[j]), int(p.offsets[j])
            hwc = p.data[at : at + h * w * 3].reshape(h, w, 3)  # the tier's read-only memory
            return cv2.cvtColor(hwc, cv2.COLOR_RGB2BGR)  # the caller's own copy
        return decode_bgr(self.cache, j, self.imgsz)


def tier_sizes(cache: Store, imgsz: int) -> tuple[np.ndarray, np.ndarray]:
    s = cache.samples
    hw = [resized_size(int(h), int(w), imgsz) for h, w in zip(s["height"], s["width"])]
    arr = np.asarray(hw, dtype=np.int64).reshape(-1, 2)
    return arr[:, 0], arr[:, 1]


def choose(cache: Store, imgsz: int, *, decoded: bool, budget: int | None) -> Pixels:
    """The tier for ``cache`` at ``imgsz``: the decoded tier's file next to the store when
    ``decoded`` and it fits, else the raw tier (with a warning saying why)."""
    if not decoded:
        return Pixels(cache, imgsz, None, None)
    th, tw = tier_sizes(cache, imgsz)
    lay = _decoded.layout(th, tw)
    need = lay.size
    room = default_budget() if budget is None else budget
    if need > room:
        return _fall(
            cache,
            imgsz,
            f"the decoded tier at imgsz={imgsz} needs {need:,} bytes ({need / 2**20:,.1f} MiB) "
            f"for {len(cache):,} images, more than its budget ({room:,} bytes); images are "
            "decoded from the store instead. Fix: free memory or lower imgsz",
        )
    if cache.path is None:
        return _fall(cache, imgsz, "the store is not a file in the node cache")
    digest = store_digest(cache)
    h = hashlib.blake2b(_TAG, digest_size=16)
    h.update(digest)
    h.update(f"long {imgsz}; cv2 {cv2.__version__}; {decoder_version()}".encode())
    target = Target(th, tw, imgsz, "long", digest, decoder_version(short=True))
    pixels, why = once_per_node(
        cache.path.parent,
        h.hexdigest(),
        target,
        lambda fd, progress: _into_file(fd, cache, target, progress),
    )
    if pixels is None:
        return _fall(
            cache,
            imgsz,
            f"the decoded tier needs a {need:,}-byte file that every process maps, and {why}; "
            "images are decoded from the store instead. Fix: a cache folder with room on a "
            "local disk, or a higher file-size limit (ulimit -f)",
        )
    return Pixels(cache, imgsz, pixels, None)


def _fall(cache: Store, imgsz: int, reason: str) -> Pixels:
    warnings.warn(f"gpucache: {reason}.", RuntimeWarning, stacklevel=3)
    return Pixels(cache, imgsz, None, reason)


def _into_file(fd: int, cache: Store, target: Target, progress: Callable[[int, int], None]) -> None:
    """Every image of ``cache`` at Ultralytics' size (``target``), into the open file ``fd``."""
    th, tw = target.heights, target.widths
    lay = _decoded.layout(th, tw)
    reserve(fd, lay.size)
    sink = file_sink(fd)
    n = len(cache)
    status = np.zeros(n, dtype=np.uint8)
    crc = 0
    imgsz = target.side

    def task(start: int) -> tuple[int, np.ndarray, list[int]]:
        stop = min(n, start + CHUNK)
        lo = int(lay.offsets[start])
        chunk = np.zeros(int(lay.offsets[stop]) - lo, dtype=np.uint8)
        failed = []
        for j in range(start, stop):
            try:
                rgb = resized_rgb(decode_sample(cache, j), imgsz)
            except Exception:  # decoded from the store at load time, as without the tier
                failed.append(j)
                continue
            if rgb.shape[:2] != (th[j], tw[j]):  # the store's record disagrees with the pixels
                failed.append(j)
                continue
            at = int(lay.offsets[j]) - lo
            chunk[at : at + rgb.size].reshape(rgb.shape)[...] = rgb  # RGB, as the format says
        return start, chunk, failed

    threads = max(1, usable_cores())
    done = 0
    for start, chunk, failed in ordered_map(task, range(0, n, CHUNK), threads):
        status[failed] = FROM_STORE
        view = memoryview(chunk)  # type: ignore[arg-type]  # numpy#26783 (3.12 stubs)
        crc = zlib.crc32(view, crc)
        sink(lay.data[0] + int(lay.offsets[start]), view)
        done = min(n, start + CHUNK)
        progress(done, n)
    _trim()  # the decode buffers freed, given back (the training process keeps running)
    write_index(sink, lay, target, status, crc)
