"""Region-of-interest JPEG decode on the CPU: decode only the box a plan's first crop keeps.

The decoder is nvImageCodec's CPU-only backend (libjpeg-turbo 3 underneath, the same IDCT and fancy
upsampling as TorchCodec's ``decode_jpeg``), asked for a code stream's sub-stream with a region: it
skips the rows below the box, skips the iMCU columns outside it (with the context the chroma
upsampling needs), and its output is bit-identical to the full decode cropped to the box
(``tests/test_roi.py`` checks it per chroma subsampling, progressive, gray, CMYK and all eight EXIF
orientations). The box is given on the oriented image; it is mapped to the coded image here, and the
decoded region is oriented afterwards.

nvImageCodec is optional (``pip install gpucache[roi]``; DALI brings it too). Without it every sample
is fully decoded, and a one-time log line says so. ``ENABLED`` is the switch (tests turn it off).
"""

from __future__ import annotations

import logging
import os
import threading

import numpy as np
import torch

try:
    from nvidia import nvimgcodec as _nvimgcodec
except Exception:  # pragma: no cover - depends on what is installed
    _nvimgcodec = None

log = logging.getLogger("gpucache")

#: ROI decode is used when True and nvImageCodec imports; set False to force full decodes.
ENABLED = True

# orientation -> (transpose, flip width, flip height), applied in that order to the coded image
_OPS = {1: (False, False, False), 2: (False, True, False), 3: (False, True, True),
        4: (False, False, True), 5: (True, False, False), 6: (True, True, False),
        7: (True, True, True), 8: (True, False, True)}

_state: dict[str, object] = {}  # per process: the one-time notice
_local = threading.local()  # per thread (a decoder is not thread-safe): pid, decoder, params


def available() -> bool:
    """Whether ROI decode runs in this process (switched on and nvImageCodec importable)."""
    return ENABLED and _nvimgcodec is not None


def unavailable_reason() -> str | None:
    if not ENABLED:
        return "ROI decode is switched off (gpucache.decode._roi.ENABLED = False)"
    if _nvimgcodec is None:
        return ("nvImageCodec is not installed, so JPEGs are decoded at full size before cropping "
                "(slower, same output); pip install 'gpucache[roi]' to decode only the crop")
    return None


def notice_once() -> None:
    """Log, once per process, that crops are fully decoded because ROI decode is unavailable."""
    why = unavailable_reason()
    if why is not None and not _state.get("noticed"):
        _state["noticed"] = True
        log.info("gpucache: %s", why)


def _decoder():
    pid = os.getpid()
    if getattr(_local, "pid", None) != pid:  # one decoder per thread, never inherited by fork
        n = _nvimgcodec
        _local.decoder = n.Decoder(device_id=n.NVIMGCODEC_DEVICE_CPU_ONLY,
                                   max_num_cpu_threads=1, backends=[n.Backend(n.CPU_ONLY)])
        _local.params = n.DecodeParams(apply_exif_orientation=False, color_spec=n.SRGB)
        _local.pid = pid
    return _local.decoder, _local.params


def coded_box(top: int, left: int, h: int, w: int, orientation: int, height: int,
              width: int) -> tuple[int, int, int, int]:
    """Map a box on the oriented ``height`` x ``width`` image to the coded (stored) image."""
    transpose, flip_w, flip_h = _OPS.get(orientation, _OPS[1])
    if flip_h:
        top = height - top - h
    if flip_w:
        left = width - left - w
    return (left, top, w, h) if transpose else (top, left, h, w)


def orient(x: torch.Tensor, orientation: int) -> torch.Tensor:
    """Apply EXIF ``orientation`` to a coded CHW image (as the full decoders do)."""
    transpose, flip_w, flip_h = _OPS.get(orientation, _OPS[1])
    if transpose:
        x = x.transpose(-1, -2)
    if flip_w:
        x = x.flip(-1)
    if flip_h:
        x = x.flip(-2)
    return x


def decode_region(data: np.ndarray | bytes, top: int, left: int, h: int, w: int, *,
                  height: int, width: int) -> torch.Tensor:
    """Rows ``top:top+h``, columns ``left:left+w`` of a ``height`` x ``width`` coded JPEG image.

    The region asked of the decoder has a 1-pixel margin on each side (within the image): without
    it, a 1-pixel-wide region at column 0 of a 4:2:0 image comes out different from a full decode
    (measured; tests/test_roi.py keeps it covered). Returns RGB uint8 CHW (a view of HWC)."""
    t0, l0 = max(top - 1, 0), max(left - 1, 0)
    b0, r0 = min(top + h + 1, height), min(left + w + 1, width)
    dec, params = _decoder()
    n = _nvimgcodec
    sub = n.CodeStream(data).get_sub_code_stream(region=n.Region(t0, l0, b0, r0))
    img = np.asarray(dec.decode(sub, params=params).cpu())
    if img.shape != (b0 - t0, r0 - l0, 3):
        raise ValueError(f"region decode returned {img.shape}, expected {(b0 - t0, r0 - l0, 3)}")
    return torch.from_numpy(img).permute(2, 0, 1)[:, top - t0:top - t0 + h, left - l0:left - l0 + w]


def decode_crop(data: np.ndarray | bytes, top: int, left: int, h: int, w: int, *,
                orientation: int, height: int, width: int) -> torch.Tensor:
    """The box (top, left, h, w) of the oriented image, decoded from the JPEG ``data`` alone."""
    t, l, hh, ww = coded_box(top, left, h, w, orientation, height, width)
    ch, cw = (width, height) if _OPS.get(orientation, _OPS[1])[0] else (height, width)
    return orient(decode_region(data, t, l, hh, ww, height=ch, width=cw), orientation)
