"""Batched JPEG decoders for the nvjpeg backend, and the EXIF orientation some of them skip.

A :class:`BatchDecoder` turns a list of CPU byte tensors into RGB uint8 CHW tensors on its device.
Whether it applies the EXIF Orientation tag is known for torchvision's decoder, which never does
(its CUDA ``decode_jpeg`` has no EXIF support, and gpucache passes ``apply_exif_orientation=False``
on the CPU too, so both run the same code). For any other decoder (TorchCodec's applies the tag on
the CPU and on CUDA, a custom one may or may not) it is *measured* once by decoding a tiny JPEG
tagged "rotate 90" (:func:`applies_exif`); the nvjpeg backend runs that probe under its own
allocation stream, never on the caller's current stream. For a decoder that does not apply it,
:func:`gpucache.transforms._orientation.orient` applies the tag afterwards, the same transform (and
table) the CPU decode and the DALI graph apply.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, cast

import numpy as np
import torch

from .._device import normalize_device


@dataclass(frozen=True)
class BatchDecoder:
    """``decode(list of 1-D uint8 CPU tensors) -> list of RGB uint8 CHW tensors on device``.

    ``applies_exif`` is None when unknown: the backend measures it (:func:`applies_exif`)."""

    name: str
    device: torch.device
    decode: Callable[[list[torch.Tensor]], list[torch.Tensor]]
    applies_exif: bool | None = None


#: Fewest images a sub-batch of a concurrent decode gets: each decoder call costs its own header
#: pass and host synchronisations, which a smaller sub-batch would not repay by overlapping.
MIN_SUB_BATCH = 8


def sub_batches(pixels: np.ndarray, n: int, *, least: int = MIN_SUB_BATCH) -> list[slice]:
    """A batch of ``len(pixels)`` images cut, in order, into at most ``n`` contiguous runs of
    about equal pixel counts (what a decoder's work grows with), each of at least ``least``
    images: the sub-batches that concurrent decoder calls take. One run when the batch holds
    fewer than two such runs."""
    m = len(pixels)
    k = max(1, min(n, m // max(1, least)))
    if k == 1:
        return [slice(0, m)]
    cum = np.cumsum(np.asarray(pixels, dtype=np.float64))
    want = np.searchsorted(cum, cum[-1] * np.arange(1, k) / k) + 1  # end after the target
    bounds = [0]
    for j, end in enumerate(want.tolist(), 1):  # each run keeps ``least``, so do the rest
        bounds.append(min(max(int(end), bounds[-1] + least), m - least * (k - j)))
    bounds.append(m)
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def _probe_jpeg() -> torch.Tensor:
    """A 16 x 8 (W x H) JPEG tagged EXIF Orientation 6: displayed, it is 8 wide and 16 high."""
    from PIL import Image

    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    Image.new("RGB", (16, 8), (200, 30, 30)).save(buf, "JPEG", exif=exif.tobytes())
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def applies_exif(
    decode: Callable[[list[torch.Tensor]], list[torch.Tensor]],
    *,
    adopt: Callable[[list[torch.Tensor]], None] | None = None,
) -> bool:
    """Whether ``decode`` applies EXIF orientation, by decoding a tagged probe image. The nvjpeg
    backend calls it under its allocation stream and passes ``adopt`` for the output."""
    (img,) = decode([_probe_jpeg()])
    if adopt is not None:
        adopt([img])
    return tuple(img.shape[1:]) == (16, 8)


def make_decoder(
    name: str,
    device: torch.device | str,
    decode: Callable[[list[torch.Tensor]], list[torch.Tensor]],
    *,
    applies_exif: bool | None = None,
) -> BatchDecoder:
    """A decoder for ``device`` (normalised: ``cuda`` -> ``cuda:<current>``)."""
    return BatchDecoder(name, normalize_device(device), decode, applies_exif)


def torchvision_decoder(device: torch.device) -> BatchDecoder:
    """torchvision's ``decode_jpeg`` (batched nvJPEG on CUDA, libjpeg-turbo on the CPU), no EXIF."""
    from torchvision.io import ImageReadMode, decode_jpeg

    from .._jpeg import quiet_torchvision_deprecation

    device = normalize_device(device)

    def decode(data: list[torch.Tensor]) -> list[torch.Tensor]:
        quiet_torchvision_deprecation()  # thread-safe, unlike catch_warnings (see there)
        # torchvision has no type information (read as Any): a list in, a list out
        return cast(
            list[torch.Tensor],
            decode_jpeg(data, mode=ImageReadMode.RGB, device=device, apply_exif_orientation=False),
        )

    return make_decoder("torchvision", device, decode, applies_exif=False)


def torchcodec_decoder(device: torch.device) -> BatchDecoder:
    """TorchCodec's ``decode_jpeg`` (batched nvJPEG on CUDA); raises ImportError without it, or
    the error TorchCodec raises when it is installed but cannot load (RuntimeError, OSError)."""
    from torchcodec.decoders import decode_jpeg

    device = normalize_device(device)
    return make_decoder(
        "torchcodec",
        device,
        # a list in, a list out (TorchCodec annotates the one-tensor form's result too)
        lambda data: cast(list[torch.Tensor], decode_jpeg(data, mode="RGB", device=str(device))),
    )


def default_decoder(
    device: torch.device, *, prefer: Literal["auto", "torchcodec", "torchvision"] = "auto"
) -> BatchDecoder:
    """TorchCodec's decoder when it is installed and loads (``prefer="auto"``), else
    torchvision's. A TorchCodec that is installed but fails to load (e.g. its FFmpeg libraries
    are missing: RuntimeError) is reported with a warning, and torchvision's is used."""
    if prefer in ("auto", "torchcodec"):
        try:
            return torchcodec_decoder(device)
        except ImportError:
            if prefer == "torchcodec":
                raise
        except (RuntimeError, OSError) as err:
            if prefer == "torchcodec":
                raise RuntimeError(
                    f"TorchCodec is installed but failed to load ({err}); fix its "
                    "install (it needs FFmpeg's libraries) or use "
                    "prefer='torchvision'."
                ) from err
            warnings.warn(
                f"gpucache: TorchCodec is installed but failed to load "
                f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''});"
                " decoding with torchvision's decode_jpeg instead. Fix TorchCodec's "
                "install (it needs FFmpeg's libraries) or uninstall it to silence "
                "this.",
                RuntimeWarning,
                stacklevel=2,
            )
    return torchvision_decoder(device)
