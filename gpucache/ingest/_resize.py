"""Build-time re-encoding, opt-in: the size cap (``max_side=``) and the quality (``jpeg_quality=``).

``max_side``: an image whose long side (as decoded, after EXIF orientation) is larger is decoded
with PIL, resized so that its long side is ``max_side`` (Lanczos, after a box reduction to no
less than 3x the target: libjpeg's DCT scaling for JPEG, PIL's ``reduce`` for the rest, as
``Image.thumbnail`` does), turned upright, and encoded as a baseline JPEG at ``jpeg_quality``
(:data:`QUALITY` by default; 4:2:0, grayscale kept grayscale, everything else RGB, 16-bit
samples scaled to 8 bits, as the CPU decoder would give it; no EXIF written).

``jpeg_quality``: every other image is decoded, turned upright and encoded the same way at its own
size, and the result kept only where it is smaller than the image's bytes (FFCV's ``jpg`` mode,
less its growth: an image already stored at a lower quality keeps its bytes). Without
``jpeg_quality``, images under the cap keep their bytes exactly. It stays JPEG, so every backend
(GPU decoders included) decodes the store.

Upright means the orientation the build recorded for the sample (``_sniff``: for JPEG, the rule
of libjpeg-turbo's decoders, which TorchCodec applies; PIL's EXIF reader would also honour an
Exif segment after an XMP one, or a LONG-typed tag), so a re-encoded sample has the size and the
orientation the plain store gives it, and the size its ``resized`` record states.

Memory: the build's threads re-encode at once only as many images as :class:`Budget` admits
(:data:`MEMORY_BUDGET`, the decoded pixels and the copies made of them, estimated before any
pixel is decoded), so a folder of huge images costs about the budget, not threads x image. An
image larger than the whole budget runs alone.

The store records what was changed, in two optional sections:

- ``resized``: uint32 ``(N, 3)``: each sample's original height, width (as decoded) and byte
  size when it was re-encoded, zeros when its bytes are the original ones;
- ``resized.args``: int64 ``[max_side, quality]`` (``max_side`` 0: no cap).
"""

from __future__ import annotations

import ctypes
import functools
import io
import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import numpy as np

from ..store._oom import BUILD_FIX, raise_if_out_of_memory
from ..store._store import Store
from ._pipeline import Encoded
from ._pixels import STRIP, WIDE, bytes_per_pixel, eight_bit, upright
from ._sniff import Info, sniff

if TYPE_CHECKING:
    from PIL import Image

SECTION = "resized"
ARGS = "resized.args"
QUALITY = 90  # PIL's scale 1-95; what FFCV's jpg mode writes too
#: Bytes of pixels the re-encodes of one build may hold at once: this, or a quarter of the
#: memory available when the build starts if that is less (but 64 MiB at least).
MEMORY_BUDGET = 1 << 30
_GAP = 3  # reduce (DCT scale or box) to no less than this many times the target
_TRIM_FROM = 16 << 20  # a re-encode that held this much gives its freed memory back


def resized(cache: Store) -> np.ndarray | None:
    """Boolean mask of the samples re-encoded under the store's ``max_side``, or None if the
    store was built without one."""
    rec = cache.extra.get(SECTION)
    return None if rec is None else rec[:, 0] > 0


def max_side_of(cache: Store) -> tuple[int | None, int] | None:
    """``(max_side, quality)`` the store was built with (``max_side`` None when it was built
    with ``jpeg_quality`` alone), or None when nothing was re-encoded at build."""
    args = cache.extra.get(ARGS)
    return None if args is None else (int(args[0]) or None, int(args[1]))


class Budget:
    """Bytes the build's threads may hold at once; :meth:`hold` waits until its share fits (or
    until nothing is held: one request larger than the whole budget runs alone)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes, self.used, self._cv = int(nbytes), 0, threading.Condition()

    @classmethod
    def default(cls) -> Budget:
        import psutil

        return cls(min(MEMORY_BUDGET, max(64 << 20, psutil.virtual_memory().available // 4)))

    @contextmanager
    def hold(self, nbytes: int) -> Iterator[None]:
        with self._cv:  # every holder releases in ``finally``: the wait ends
            self._cv.wait_for(lambda: self.used == 0 or self.used + nbytes <= self.nbytes)
            self.used += nbytes
        try:
            yield
        finally:
            with self._cv:
                self.used -= nbytes
                self._cv.notify_all()


def cost(
    im: Image.Image, stored: tuple[int, int], size: tuple[int, int] | None, orientation: int
) -> int:
    """The most bytes :func:`reencode` holds at once for ``im`` (opened, drafted, not loaded;
    ``stored``: its size before the draft) on its way to ``size`` (None: its own size), an upper
    bound over its steps: the decode (with libjpeg's coefficients of a progressive JPEG), the
    8-bit or RGB copy, the reduce and resize, the turn, the encoded bytes."""
    (w, h), mode = im.size, im.mode
    px = w * h
    src = px * bytes_per_pixel(mode)
    gray = mode in WIDE or mode in ("1", "L", "F")  # becomes L, else RGB (4 bytes a pixel)
    cb = 1 if gray else 4
    steps = [src]
    if im.format == "JPEG" and im.info.get("progressive"):
        steps.append(src + stored[0] * stored[1] * len(im.getbands()) * 2)
    if mode in WIDE:  # the image, the 8-bit one, a strip's copies (crop, bytes, shifted)
        steps.append(src + px + 5 * min(px, STRIP) * bytes_per_pixel(mode))
    elif mode not in ("L", "RGB"):
        steps.append(src + px * cb)
    out = px if size is None else size[0] * size[1]
    if size is not None:  # PIL's reduce, then its two resampling passes
        reduced = px // ((w // size[0] // _GAP or 1) * (h // size[1] // _GAP or 1))
        steps.append(px * cb + cb * (2 * reduced + out))
    if orientation in range(2, 9):
        steps.append(2 * out * cb)
    steps.append(out * cb + 2 * out * (1 if gray else 3))  # the encoded bytes and their copy
    return max(steps) + (1 << 20)  # and the decoder's own buffers


def reencode(
    data: Encoded,
    max_side: int | None,
    quality: int = QUALITY,
    *,
    orientation: int = 1,
    budget: Budget | None = None,
) -> bytes:
    """``data`` (encoded image bytes) decoded, its long side scaled to ``max_side`` (None:
    kept), turned as EXIF ``orientation`` says (the store's record, see ``_pixels.upright``),
    encoded as JPEG with no EXIF. The pixels are decoded once ``budget`` admits them. Raises
    what PIL raises for bytes it cannot decode."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        w, h = stored = im.size  # the scale is the same after the turn
        size = None
        if max_side is not None:
            s = max_side / max(w, h)
            size = (max(1, round(w * s)), max(1, round(h * s)))
            im.draft(None, (math.ceil(w * s * _GAP), math.ceil(h * s * _GAP)))  # JPEG only
        held_bytes = cost(im, stored, size, orientation)
        held = nullcontext() if budget is None else budget.hold(held_bytes)
        with held:
            out = _encode(im, size, orientation, quality)
            if budget is not None and held_bytes >= _TRIM_FROM:
                _give_back()  # before the next image is admitted
            return out


def _encode(im: Image.Image, size: tuple[int, int] | None, orientation: int, quality: int) -> bytes:
    """The steps of :func:`reencode`, each copy released as soon as the next one exists."""
    from PIL import Image

    def step(old: Image.Image, new: Image.Image) -> Image.Image:
        if new is not old:
            old.close()  # frees its pixels now, not when the caller's ``with`` ends
        return new

    im = step(im, eight_bit(im))
    if im.mode not in ("L", "RGB"):
        im = step(im, im.convert("L" if im.mode in ("1", "F") else "RGB"))
    if size is not None and size != im.size:
        im = step(im, im.resize(size, Image.Resampling.LANCZOS, reducing_gap=_GAP))
    im = step(im, upright(im, orientation))
    out = io.BytesIO()
    im.save(out, "JPEG", quality=quality)
    im.close()
    return out.getvalue()


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc
    except (OSError, AttributeError):
        return None


def _give_back() -> None:
    """Return freed heap memory to the system. glibc keeps what a thread freed in that thread's
    arena, so without this each build thread would keep the largest image it decoded, and the
    budget would bound the pixels in use but not the memory held."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _check(name: str, value: object, low: int, high: int | None, example: str) -> None:
    if value is None:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, np.integer))
        or value < low
        or (high is not None and value > high)
    ):
        span = f"an integer from {low} to {high}" if high is not None else "a positive integer"
        raise ValueError(f"{name} must be {span} ({example}) or None, got {value!r}.")


class Reencode:
    """A build rewriter (see ``_pipeline.read_chunk``): images over ``max_side`` resized and
    re-encoded; with ``jpeg_quality``, every other image re-encoded where that saves bytes.
    The build's threads share one :class:`Budget` (``budget``; default :meth:`Budget.default`)."""

    columns = {SECTION: ("<u4", 3)}

    def __init__(
        self, max_side: int | None, jpeg_quality: int | None = None, *, budget: Budget | None = None
    ) -> None:
        _check("max_side", max_side, 1, None, "pixels of the long side to cap images at, e.g. 512")
        _check("jpeg_quality", jpeg_quality, 1, 100, "PIL's JPEG quality, e.g. 90")
        self.max_side = None if max_side is None else int(max_side)
        self.all = jpeg_quality is not None  # every image, not only those over the cap
        self.quality = QUALITY if jpeg_quality is None else int(jpeg_quality)
        self.budget = budget or Budget.default()

    def __call__(self, data: Encoded, info: Info) -> tuple[Encoded, Info, dict[str, Any]]:
        over = self.max_side is not None and max(info.height, info.width) > self.max_side
        if not over and not self.all:
            return data, info, {SECTION: (0, 0, 0)}
        try:
            out = reencode(
                data,
                self.max_side if over else None,
                self.quality,
                orientation=info.orientation,
                budget=self.budget,
            )
            new = sniff(memoryview(out))
        except Exception as err:  # undecodable pixels: kept as they are; decode reports it
            # not the image's fault: never left as it was, unasked
            raise_if_out_of_memory(
                err, f"re-encoding a {info.width}x{info.height} image at build", fix=BUILD_FIX
            )
            return data, info, {SECTION: (0, 0, 0)}
        if not over and len(out) >= len(data):  # no smaller at this quality: the bytes stay
            return data, info, {SECTION: (0, 0, 0)}
        return out, new, {SECTION: (info.height, info.width, len(data))}

    def sections(self, columns: dict[str, np.ndarray], k: int) -> dict[str, np.ndarray]:
        return {ARGS: np.array([self.max_side or 0, self.quality], dtype="<i8")}
