"""Decode backends behind one interface (:class:`~gpucache.decode._base.Backend`).

- ``cpu``: worker processes decoding with libjpeg-turbo (``cpu_backend``)
- ``nvjpeg``: batched nvJPEG in a background thread with its own CUDA streams (``nvjpeg``)
- ``dali``: an NVIDIA DALI pipeline; CPU-only mode on a CPU device (``dali``)

``auto`` picks dali when it is importable and the device is CUDA, else nvjpeg on CUDA, else cpu.

``resolve(backend, device)`` turns the user's choice into a concrete backend name.
"""

from __future__ import annotations

import importlib.util

import torch

BACKENDS = ("auto", "cpu", "nvjpeg", "dali")


def dali_available() -> bool:
    return importlib.util.find_spec("nvidia.dali") is not None


def resolve_device(device: str | torch.device | None) -> torch.device:
    """None -> cuda when present, else cpu; "cuda" without CUDA is a clear error."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device={str(device)!r} but CUDA is not available on this machine "
                           f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}); "
                           "use device='cpu' or device=None to pick what is present.")
    return dev


def resolve(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}.")
    if backend == "auto":
        if device.type != "cuda":
            return "cpu"
        return "dali" if dali_available() else "nvjpeg"
    if backend == "nvjpeg" and device.type != "cuda":
        raise ValueError(f"backend='nvjpeg' decodes on a CUDA device, but device is {device}; use "
                         "backend='cpu', or backend='dali', whose CPU mode runs without a GPU.")
    if backend == "dali" and not dali_available():
        raise ImportError("backend='dali' needs NVIDIA DALI: pip install 'gpucache[dali]' "
                          "(nvidia-dali-cuda120), or use backend='auto'.")
    return backend
