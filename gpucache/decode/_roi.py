"""Region-of-interest JPEG decode on the CPU: decode only the box a plan's first crop keeps.

Two decoders, both libjpeg-turbo underneath with the IDCT (islow) and fancy upsampling of
TorchCodec's ``decode_jpeg``, so the box comes out bit-identical to a full decode cropped to it
(``tests/test_roi.py`` checks it per chroma subsampling, progressive, gray, CMYK and all eight EXIF
orientations, and on real photos):

1. ``libjpeg-turbo``: gpucache's own compiled function (``gpucache/_jpeg_regions.c``, built at install when a C
   compiler and libjpeg-turbo's headers exist), called through ctypes in the calling thread:
   ``jpeg_crop_scanline`` to the box's iMCU columns, ``jpeg_skip_scanlines`` to its first row, and it
   stops after the last. Checked against ``decode_jpeg`` once per process before it is trusted.
2. ``nvimgcodec``: nvImageCodec's CPU-only backend (``pip install nvidia-nvimgcodec-cu12``, the ``roi`` extra; DALI brings it),
   a code stream's sub-stream with a region. Used when (1) is missing, and for CMYK.

Both get a 1-pixel margin around the box (chroma upsampling's context; measured necessary). Without
either, every sample is fully decoded, and a one-time log line says so. The box is given on the
oriented image; it is mapped to the coded image here, and the region is oriented afterwards.
:func:`region_decoder` is the one place the route is chosen (tests and benchmarks patch it, or
:func:`_c_ok`, to take another).
"""

from __future__ import annotations

import ctypes
import io
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from .. import _native
from ..transforms._orientation import coded_box, orient, steps  # the one EXIF table
from ._jpeg import decode_jpeg

try:
    import nvidia.nvimgcodec as _nvimgcodec
except Exception:  # pragma: no cover - depends on what is installed
    _nvimgcodec = None

log = logging.getLogger(__name__)


_state: dict[str, object] = {}  # per process: the compiled library, its self-check, the notice
_lock = threading.Lock()
_local = threading.local()  # per thread (a decoder is not thread-safe): pid, decoder, params
Region = Callable[..., torch.Tensor]


class Oriented(NamedTuple):
    """A stored JPEG's size as displayed (after its EXIF orientation) and that orientation:
    what maps a displayed box to the coded pixels (:func:`coded_box`)."""

    height: int
    width: int
    orientation: int = 1


def clib() -> ctypes.CDLL | None:
    """gpucache's compiled helpers (ctypes), or None when they were not built at install."""
    return _native.lib()


def _check_jpeg() -> bytes:
    """A 53 x 37 4:2:0 JPEG (partial MCUs both ways) of a smooth picture with some texture,
    encoded here by PIL (quality 90): the self-check's input, the same in every process."""
    from PIL import Image

    y, x = np.mgrid[0:37, 0:53].astype(np.float32)
    rng = np.random.default_rng(1)
    rgb = np.stack([x * 4.5, y * 6.5, (x + y) * 2.8], axis=-1) + rng.normal(0, 12, (37, 53, 3))
    buf = io.BytesIO()
    Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8), "RGB").save(
        buf, "JPEG", quality=90, subsampling=2
    )
    return buf.getvalue()


def _c_ok() -> bool:
    """Whether the compiled region decoder is there and gives ``decode_jpeg``'s pixels here."""
    if "c_ok" not in _state:
        lib = clib()
        ok = lib is not None and hasattr(lib, "gc_decode_region")
        if ok:  # once per process: a 4:2:0 JPEG with partial MCUs, an inner box
            data = _check_jpeg()
            full = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            ok = torch.equal(
                _c_region(data, 9, 17, 20, 30, height=37, width=53), full[:, 9:29, 17:47]
            )
            if not ok:
                log.warning(
                    "gpucache: the compiled region decoder's output differs from "
                    "decode_jpeg's here (another libjpeg build?); not using it"
                )
        _state["c_ok"] = ok
    return bool(_state["c_ok"])


def region_decoder(components: int) -> Region | None:
    """The function that decodes a region of a JPEG with ``components`` channels, or None:
    gpucache's compiled decoder when it was built (and passed its check), else nvImageCodec's."""
    if components in (1, 3) and _c_ok():
        return _c_region
    return _nv_region if _nvimgcodec is not None else None


def route() -> str | None:
    """Name of the region decoder used for RGB/gray JPEGs in this process, or None."""
    dec = region_decoder(3)
    return None if dec is None else "libjpeg-turbo" if dec is _c_region else "nvimgcodec"


def notice_once() -> None:
    """Log, once per process, that crops are fully decoded because ROI decode is unavailable."""
    if route() is None and not _state.get("noticed"):
        _state["noticed"] = True
        log.info(
            "gpucache: neither gpucache's compiled region decoder (built at install with a C "
            "compiler and libjpeg-turbo headers) nor nvImageCodec is available, so JPEGs are "
            "decoded at full size before cropping (slower, same output); pip install "
            "nvidia-nvimgcodec-cu12 (a clone's extra: pip install -e '.[roi]') to decode only "
            "the crop"
        )


class ScaleRefused(ValueError):
    """The compiled decoder does not scale JPEGs with these sampling factors (see _jpeg_regions.c)."""


def _c_region(
    data: np.ndarray | bytes,
    top: int,
    left: int,
    h: int,
    w: int,
    *,
    height: int,
    width: int,
    denom: int = 1,
) -> torch.Tensor:
    """Rows ``top:top+h``, columns ``left:left+w`` of the coded image (compiled decoder; the
    margin is taken inside it), decoded at scale 1/``denom`` (1, 2, 4, 8; the box, ``height`` and
    ``width`` are then in scaled pixels). RGB uint8 CHW, a view of HWC like ``decode_jpeg``'s."""
    out = np.empty((h, w, 3), dtype=np.uint8)
    err = ctypes.create_string_buffer(200)
    arr = data if isinstance(data, bytes) else np.ascontiguousarray(data)
    buf = arr if isinstance(arr, bytes) else arr.ctypes.data_as(ctypes.c_char_p)
    warned = ctypes.c_int()
    lib = _native._state["lib"]
    assert lib is not None  # this decoder is chosen only where the library was built
    ret = lib.gc_decode_region(
        buf, len(arr), denom, top, left, h, w, out.ctypes.data, ctypes.byref(warned), err, 200
    )
    if ret == 3:
        raise ScaleRefused(err.value.decode(errors="replace"))
    if ret:
        raise ValueError(f"region decode failed: {err.value.decode(errors='replace')}")
    note_warning(warned.value, err.value)
    return torch.from_numpy(out).permute(2, 0, 1)


def note_warning(count: int, text: bytes) -> None:
    """Keep libjpeg's first warning of the last decode in this thread (see :func:`take_warning`)."""
    _local.warning = text.decode(errors="replace") or "libjpeg warning" if count else None


def take_warning() -> str | None:
    """libjpeg's warning (corrupt data decoded anyway, e.g. "Corrupt JPEG data: premature end of
    data segment") from this thread's last compiled decode, or None; cleared once read. Decodes
    that are not gpucache's compiled ones (nvImageCodec, TorchCodec) report none here."""
    text, _local.warning = getattr(_local, "warning", None), None
    return text


def _nv_decoder() -> tuple[Any, Any]:
    """This thread's nvImageCodec decoder and decode parameters (nvImageCodec has no type
    information: its objects are Any here)."""
    pid = os.getpid()
    if getattr(_local, "pid", None) != pid:  # one decoder per thread, never inherited by fork
        n = _nvimgcodec
        _local.decoder = n.Decoder(
            device_id=n.NVIMGCODEC_DEVICE_CPU_ONLY,
            max_num_cpu_threads=1,
            backends=[n.Backend(n.CPU_ONLY)],
        )
        _local.params = n.DecodeParams(apply_exif_orientation=False, color_spec=n.SRGB)
        _local.pid = pid
    return _local.decoder, _local.params


def _nv_region(
    data: np.ndarray | bytes, top: int, left: int, h: int, w: int, *, height: int, width: int
) -> torch.Tensor:
    """The same through nvImageCodec. The region asked has a 1-pixel margin on each side (within
    the image): without it, a 1-pixel-wide region at column 0 of a 4:2:0 image differs from a
    full decode (measured; tests/test_roi.py keeps it covered)."""
    t0, l0 = max(top - 1, 0), max(left - 1, 0)
    b0, r0 = min(top + h + 1, height), min(left + w + 1, width)
    dec, params = _nv_decoder()
    n = _nvimgcodec
    sub = n.CodeStream(data).get_sub_code_stream(region=n.Region(t0, l0, b0, r0))
    img = np.asarray(dec.decode(sub, params=params).cpu())
    if img.shape != (b0 - t0, r0 - l0, 3):
        raise ValueError(f"region decode returned {img.shape}, expected {(b0 - t0, r0 - l0, 3)}")
    return torch.from_numpy(img).permute(2, 0, 1)[
        :, top - t0 : top - t0 + h, left - l0 : left - l0 + w
    ]


def scaled_box(
    t: int, l: int, h: int, w: int, height: int, width: int, denom: int
) -> tuple[int, int, int, int, int, int]:
    """The box (t, l, h, w) of a ``height`` x ``width`` image in the image decoded at 1/``denom``
    (edges rounded to the nearest scaled pixel), and that image's size (libjpeg's: rounded up)."""
    sh, sw = -(-height // denom), -(-width // denom)
    ts, ls = (2 * t + denom) // (2 * denom), (2 * l + denom) // (2 * denom)
    te = min(sh, max(ts + 1, (2 * (t + h) + denom) // (2 * denom)))
    le = min(sw, max(ls + 1, (2 * (l + w) + denom) // (2 * denom)))
    ts, ls = min(ts, te - 1), min(ls, le - 1)
    return ts, ls, te - ts, le - ls, sh, sw


def decode_crop(
    data: np.ndarray | bytes,
    box: tuple[int, int, int, int],
    image: Oriented,
    *,
    region: Region,
    denom: int = 1,
) -> torch.Tensor:
    """The ``box`` (top, left, h, w) of the oriented ``image``, decoded with ``region`` from the
    JPEG ``data`` alone (``region`` from :func:`region_decoder`); with ``denom`` > 1 (compiled
    decoder only), the box decoded at 1/``denom`` scale (about ``h / denom`` x ``w / denom``;
    raises :class:`ScaleRefused` for sampling factors it does not scale)."""
    height, width, orientation = image
    t, l, hh, ww = coded_box(*box, orientation, height, width)
    ch, cw = (width, height) if steps(orientation)[0] else (height, width)
    if denom > 1:
        t, l, hh, ww, ch, cw = scaled_box(t, l, hh, ww, ch, cw, denom)
        return orient(region(data, t, l, hh, ww, height=ch, width=cw, denom=denom), orientation)
    return orient(region(data, t, l, hh, ww, height=ch, width=cw), orientation)
