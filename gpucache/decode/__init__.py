"""Decode backends behind one interface (:class:`~gpucache.decode._base.Backend`).

- ``cpu``: worker processes decoding with libjpeg-turbo (:mod:`.cpu`)
- ``nvjpeg``: batched nvJPEG in background threads with their own CUDA streams (``gpu._nvjpeg``)
- ``dali``: an NVIDIA DALI pipeline; CPU-only mode on a CPU device (``gpu._dali``)

The CPU decode and plan executor every backend uses (``_core``, ``_jpeg``, ``_roi``, ``_roi_rst``,
``_scaled``, ``_masks``) sit at this package's top, beside the options and the interface.

``auto`` picks nvjpeg on CUDA and cpu elsewhere: dali is never chosen for the user, since its GPU
graph has not run on a GPU yet (docs/guides/backends.md, "GPU status"); ``backend="dali"`` asks
for it.

``resolve(backend, device)`` turns the user's choice into a concrete backend name; the device
itself is resolved and given its index in :mod:`._device`.
"""

from __future__ import annotations

import importlib.util

import torch

BACKENDS = ("auto", "cpu", "nvjpeg", "dali")


def dali_available() -> bool:
    return importlib.util.find_spec("nvidia.dali") is not None


def resolve(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}.")
    if backend == "auto":
        # not dali, installed or not: its GPU graph has not run on a GPU yet (see the manual)
        return "nvjpeg" if device.type == "cuda" else "cpu"
    if backend == "nvjpeg" and device.type != "cuda":
        raise ValueError(
            f"backend='nvjpeg' decodes on a CUDA device, but device is {device}; use "
            "backend='cpu', or backend='dali', whose CPU mode runs without a GPU."
        )
    if backend == "dali" and not dali_available():
        raise ImportError(
            "backend='dali' needs NVIDIA DALI: pip install nvidia-dali-cuda120 (a clone's "
            "extra: pip install -e '.[dali]'), or use backend='auto'."
        )
    return backend
