"""Restart-marker stores: decode only the entropy-coded segments that cover a crop.

At build (``restart_markers=True``) each baseline/progressive 8-bit JPEG is transcoded losslessly
(same DCT coefficients, so the same pixels from any decoder) to baseline with a restart marker every
``k`` <= 4 MCUs, ``k`` dividing the MCUs per row (the C function in ``gpucache/_jpeg_regions.c``, through ctypes).
Every MCU row is then a whole number of segments, each decodable on its own (a restart resets the DC
predictors). At decode, the segments covering the crop box plus a 1-pixel margin (the context of
chroma upsampling) are copied, renumbered, under the original headers with the SOF size patched,
into a smaller valid JPEG, which is ROI-decoded (:mod:`._roi`): in one C call (``gc_decode_segments``)
with the compiled region decoder, else here in numpy (:class:`Layout`, :func:`segment_jpeg`) for
nvImageCodec. Nothing outside the box's segments is entropy-decoded.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from .. import _native
from .._native import MISSING, transcode, transcoder_available  # noqa: F401 - the build's names
from ..ingest._restart import (
    SECTION,
)  # the store's optional section: int32 restart interval per sample
from ..store._store import Store
from ..transforms._orientation import coded_box, orient, steps
from . import _roi


def _load() -> ctypes.CDLL | None:
    return _native.lib()


class IntervalMismatch(ValueError):
    """A sample's bytes are not a restart-marker JPEG of the interval the store records for it
    (section ``rst``): its crops are decoded without the restart markers instead."""


def mismatch_reason(k: int, err: Exception) -> str:
    """What the loader (once per sample, after the sample's index and path) and ``gpucache
    verify`` say of a sample whose bytes do not match its restart interval ``k``."""
    return (
        f"its bytes do not match the restart interval of {k} MCUs the store records for it "
        f"(section 'rst'): {err}; its crops are decoded without restart markers (whole rows "
        "up to the box: same pixels, slower). The section is wrong or the data was altered: "
        "rebuild the store (`gpucache verify` lists every such sample)"
    )


def check_interval(data: np.ndarray, k: int) -> None:
    """Raise :class:`IntervalMismatch` if ``data`` is not a restart-marker JPEG of interval ``k``
    (one pass over its bytes for the markers)."""
    try:
        Layout(data, k)
    except ValueError as err:
        raise IntervalMismatch(str(err)) from err


class Layout:
    """Where a restart-marker JPEG's parts are: headers, SOF, MCU geometry, segment byte ranges."""

    def __init__(self, data: np.ndarray, k: int):
        pos, sof, sos_end, dri, ns = 2, -1, -1, 0, 0
        # numpy's stubs give ndarray the buffer protocol only from Python 3.12 on (numpy#26783)
        view = memoryview(data)  # type: ignore[arg-type]
        while pos + 4 <= len(view):
            if view[pos] != 0xFF:
                raise ValueError("bad JPEG marker layout")
            marker = view[pos + 1]
            length = (view[pos + 2] << 8) | view[pos + 3]
            if marker in (0xC0, 0xC1):
                sof = pos
            elif 0xC2 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
                raise ValueError("not a baseline JPEG")
            elif marker == 0xDD:
                dri = (view[pos + 4] << 8) | view[pos + 5]
            elif marker == 0xDA:
                sos_end = pos + 2 + length
                ns = view[pos + 4]
                break
            pos += 2 + length
        if sof < 0 or sos_end < 0 or dri != k or k <= 0:
            raise ValueError("not a restart-marker JPEG of this store")
        self.height = (view[sof + 5] << 8) | view[sof + 6]
        self.width = (view[sof + 7] << 8) | view[sof + 8]
        nf = view[sof + 9]
        if ns != nf:
            raise ValueError("not a single interleaved scan")
        hs = [view[sof + 11 + 3 * c] >> 4 for c in range(nf)]
        vs = [view[sof + 11 + 3 * c] & 15 for c in range(nf)]
        # narrowest sub-image (px) whose every component keeps > 2 samples across, the least
        # libjpeg upsamples as in the full image (the C decoder's gc_min_width)
        self.min_w = 1 if nf == 1 else 2 * max(hs) // max(min(hs), 1) + 1
        self.mcu_w = 8 if nf == 1 else 8 * max(hs)
        self.mcu_h = 8 if nf == 1 else 8 * max(vs)
        self.sof, self.sos_end, self.k = sof, sos_end, k
        per_row = -(-self.width // self.mcu_w)
        rows = -(-self.height // self.mcu_h)
        if per_row % k:
            raise ValueError("restart interval does not divide the MCU row")
        self.segs_per_row, self.seg_w = per_row // k, k * self.mcu_w
        self.rst, end = _restarts(data, sos_end, rows * self.segs_per_row - 1)
        if len(self.rst) + 1 != rows * self.segs_per_row:
            raise ValueError(
                f"{len(self.rst) + 1} restart segments, expected {rows * self.segs_per_row}"
            )
        self.starts = np.concatenate(([sos_end], self.rst + 2))
        self.ends = np.concatenate((self.rst, [end]))


def _restarts(data: np.ndarray, start: int, expected: int) -> tuple[np.ndarray, int]:
    """Offsets of the FF of each RSTn marker after ``start``, and of the EOI marker."""
    lib = _load()
    if lib is not None:  # one memchr pass in C
        pos = np.empty(max(expected, 0) + 1, dtype=np.int64)
        eoi = ctypes.c_longlong()
        arr = np.ascontiguousarray(data)
        count = lib.gc_find_restarts(
            arr.ctypes.data, len(arr), start, pos.ctypes.data, len(pos), ctypes.byref(eoi)
        )
        if count >= 0:
            return pos[:count], eoi.value
    ent = data[start:]
    ff = np.flatnonzero(ent[:-1] == 0xFF)
    nxt = ent[ff + 1]
    eoi = ff[nxt == 0xD9]
    end = int(eoi[0]) + start if len(eoi) else len(data)
    rst = ff[(nxt >= 0xD0) & (nxt <= 0xD7)] + start
    return rst[rst < end], end


def segment_jpeg(
    data: np.ndarray, lay: Layout, top: int, left: int, h: int, w: int
) -> tuple[np.ndarray, int, int, int, int]:
    """A valid JPEG of the segments covering rows top:top+h, columns left:left+w (1-px margin).

    Returns (jpeg bytes, its top and left in the coded image, its height and width)."""
    t0, b0 = max(top - 1, 0), min(top + h + 1, lay.height)
    l0, r0 = max(left - 1, 0), min(left + w + 1, lay.width)
    ra, rb = t0 // lay.mcu_h, (b0 - 1) // lay.mcu_h
    ca, cb = l0 // lay.seg_w, (r0 - 1) // lay.seg_w
    while min(lay.width, (cb + 1) * lay.seg_w) - ca * lay.seg_w < lay.min_w:
        if ca > 0:  # too narrow a sub-image: the previous segment column too (else the next)
            ca -= 1
        elif cb < lay.segs_per_row - 1:
            cb += 1
        else:
            break
    y0, x0 = ra * lay.mcu_h, ca * lay.seg_w
    sub_h = min(lay.height, (rb + 1) * lay.mcu_h) - y0
    sub_w = min(lay.width, (cb + 1) * lay.seg_w) - x0
    first = np.arange(ra, rb + 1) * lay.segs_per_row + ca  # first segment of each row's span
    starts, ends = lay.starts[first], lay.ends[first + (cb - ca)]
    lens = ends - starts
    head = bytearray(data[: lay.sos_end])
    head[lay.sof + 5 : lay.sof + 9] = bytes((sub_h >> 8, sub_h & 255, sub_w >> 8, sub_w & 255))
    mv = memoryview(data)  # type: ignore[arg-type]  # numpy#26783, as in Layout
    pieces: list[bytes | bytearray | memoryview] = [head]
    for s, e in zip(starts.tolist(), ends.tolist()):  # one contiguous span per MCU row
        pieces += (mv[s:e], b"\xff\xd0")
    pieces[-1] = b"\xff\xd9"
    out = np.frombuffer(bytearray(b"".join(pieces)), dtype=np.uint8)
    # renumber every restart marker in stream order: those inside each span, then the row's end
    at = lay.sos_end + np.concatenate(([0], np.cumsum(lens + 2)[:-1]))  # span starts in out
    inner = lay.rst[first[:, None] + np.arange(cb - ca)] - starts[:, None] + at[:, None] + 1
    every = np.concatenate((inner, (at + lens + 1)[:, None]), axis=1).ravel()[:-1]
    out[every] = 0xD0 + (np.arange(len(every)) % 8)
    return out, y0, x0, sub_h, sub_w


def decode_crop(
    data: np.ndarray,
    k: int,
    box: tuple[int, int, int, int],
    image: _roi.Oriented,
    *,
    region: _roi.Region,
    denom: int = 1,
) -> torch.Tensor:
    """The ``box`` (top, left, h, w) of the oriented ``image``, from a restart-marker JPEG's
    segments (restart interval ``k``; decoded with ``region``, from
    :func:`._roi.region_decoder`); ``denom`` > 1 (compiled decoder only) as in
    :func:`._roi.decode_crop`."""
    height, width, orientation = image
    t, l, hh, ww = coded_box(*box, orientation, height, width)
    if denom > 1:
        transpose = steps(orientation)[0]
        ch, cw = (width, height) if transpose else (height, width)
        t, l, hh, ww = _roi.scaled_box(t, l, hh, ww, ch, cw, denom)[:4]
    if region is _roi._c_region:  # all of it in one C call: no Python per segment or row
        out = np.empty((hh, ww, 3), dtype=np.uint8)
        err = ctypes.create_string_buffer(200)
        arr = np.ascontiguousarray(data)
        warned = ctypes.c_int()
        lib = _load()
        assert lib is not None  # the compiled region decoder is chosen only where it was built
        ret = lib.gc_decode_segments(
            arr.ctypes.data,
            len(arr),
            k,
            denom,
            t,
            l,
            hh,
            ww,
            out.ctypes.data,
            ctypes.byref(warned),
            err,
            len(err),
        )
        if ret == 0:
            _roi.note_warning(warned.value, err.value)
            return orient(torch.from_numpy(out).permute(2, 0, 1), orientation)
        if ret == 1:
            raise ValueError(f"segment decode failed: {err.value.decode(errors='replace')}")
        if ret == 3:
            raise _roi.ScaleRefused(err.value.decode(errors="replace"))
    check_interval(data, k)  # what is wrong, if the C decoder said "not such a JPEG" (ret 2)
    lay = Layout(data, k)  # for the Python segment cut (any region decoder)
    if denom > 1:  # the plain region decoder scales it
        return _roi.decode_crop(data, box, image, region=region, denom=denom)
    sub, y0, x0, sub_h, sub_w = segment_jpeg(data, lay, t, l, hh, ww)
    part = region(sub, t - y0, l - x0, hh, ww, height=sub_h, width=sub_w)
    return orient(part, orientation)


def intervals(cache: Store) -> np.ndarray | None:
    """The store's restart interval per sample (int32, MCUs; 0 = none), or None (a plain store).

    Kept in the store file's optional section ``rst`` (docs/reference/format.md)."""
    extra = getattr(cache, "extra", None)
    return None if extra is None else extra.get(SECTION)
