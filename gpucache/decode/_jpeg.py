"""The full JPEG decode on the CPU (TorchCodec when installed, else torchvision's libjpeg-turbo):
RGB uint8 CHW with EXIF orientation applied; and keeping torchvision's deprecation notice away.
Imports nothing of gpucache's, so the decoders above it (``_core``, ``_roi``'s self-check,
``_batched``) use it without importing each other.
"""

from __future__ import annotations

import re
import warnings
from typing import cast

import torch

try:  # TorchCodec supersedes torchvision's image decoding from torchvision 0.29
    from torchcodec.decoders import decode_jpeg as _codec_decode_jpeg
except Exception:  # pragma: no cover - depends on what is installed
    _codec_decode_jpeg = None  # type: ignore[assignment]  # None: TorchCodec is missing

#: torchvision >= 0.29 warns on every image decode call that TorchCodec supersedes it
#: (``warnings.warn(msg, DeprecationWarning)`` in torchvision/io/image.py, on every call).
TV_DEPRECATION = r"The image decoding and encoding capabilities of TorchVision are deprecated"
_TV_MODULE = r"torchvision(\.|$)"
#: The entry ``warnings.filterwarnings`` makes for it (message compiled with re.I, as it does).
_TV_FILTER = (
    "ignore",
    re.compile(TV_DEPRECATION, re.I),
    DeprecationWarning,
    re.compile(_TV_MODULE),
    0,
)


def quiet_torchvision_deprecation() -> None:
    """Keep torchvision's deprecation notice (and nothing else) from reaching the user.

    One process-wide filter, scoped to that message from torchvision, first in the list, so that
    a broader filter of the caller's ("error", "always") cannot turn the notice into an exception
    inside a decode. It is never saved and restored around a call, as ``warnings.catch_warnings``
    does: that swaps the whole process-wide list and, from the nvjpeg backend's threads, would
    drop filters the main thread adds meanwhile. Cheap enough per call (one comparison); the
    filter is put back only when it is missing or no longer first (a ``catch_warnings`` block
    of the caller's ended, or a filter was added in front of it)."""
    filters = warnings.filters
    if not filters or filters[0] != _TV_FILTER:
        warnings.filterwarnings(
            "ignore", message=TV_DEPRECATION, category=DeprecationWarning, module=_TV_MODULE
        )


def jpeg_decoder_name() -> str:
    return "torchcodec" if _codec_decode_jpeg is not None else "torchvision"


def decode_jpeg(data: torch.Tensor, *, use_torchcodec: bool | None = None) -> torch.Tensor:
    """Decode JPEG bytes to RGB uint8 CHW, EXIF orientation applied (gray and CMYK converted)."""
    if _codec_decode_jpeg is not None and use_torchcodec is not False:
        # one tensor in, one out (TorchCodec annotates the list form's result too)
        return cast(torch.Tensor, _codec_decode_jpeg(data, mode="RGB"))
    from torchvision.io import ImageReadMode
    from torchvision.io import decode_jpeg as tv_decode_jpeg

    quiet_torchvision_deprecation()  # thread-safe: no catch_warnings (see there)
    # torchvision has no type information (read as Any): one tensor in, one out
    return cast(
        torch.Tensor, tv_decode_jpeg(data, mode=ImageReadMode.RGB, apply_exif_orientation=True)
    )
