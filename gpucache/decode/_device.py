"""The decode device: the one place a device gets its index.

:func:`normalize_device` gives every device gpucache keeps or compares its index, so
``torch.device("cuda")`` and ``cuda:0`` never meet unnormalised; :func:`resolve_device` turns the
user's ``device=`` into one, and :func:`check_local_rank` warns when a launcher's rank and the
current CUDA device disagree.
"""

from __future__ import annotations

import warnings

import torch

from ..base import _dist


def normalize_device(device: str | int | torch.device) -> torch.device:
    """The device as torch reports it on tensors: ``cuda`` without an index becomes the calling
    thread's current CUDA device (``cuda:N``, what ``torch.device("cuda")`` allocates on), and a
    CPU device loses its index (CPU tensors report plain ``cpu``)."""
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if dev.type == "cpu" and dev.index is not None:
        return torch.device("cpu")
    return dev


def resolve_device(device: str | torch.device | None) -> torch.device:
    """None -> cuda when present, else cpu; "cuda" without CUDA is a clear error. Normalised
    (:func:`normalize_device`); under a launcher, warns when the current CUDA device is not
    this rank's (see :func:`check_local_rank`)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"device={str(device)!r} but CUDA is not available on this machine "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}); "
            "use device='cpu' or device=None to pick what is present."
        )
    if dev.type == "cuda" and dev.index is None:
        check_local_rank()
    return normalize_device(dev)


_warned_local_rank: set[tuple[int, int]] = set()


def check_local_rank() -> None:
    """Warn once when a launcher's LOCAL_RANK differs from the current CUDA device: without
    ``torch.cuda.set_device``, every rank of a torchrun job would decode on cuda:0.

    Only when this process sees a GPU of that index: with one GPU visible per rank (Slurm's
    per-task binding, a per-rank ``CUDA_VISIBLE_DEVICES``) every rank rightly decodes on its
    cuda:0, and there is no cuda:LOCAL_RANK to advise."""
    size, local_rank = _dist.local()
    if size <= 1 or torch.cuda.device_count() <= local_rank:
        return
    current = torch.cuda.current_device()
    if local_rank == current or (local_rank, current) in _warned_local_rank:
        return
    _warned_local_rank.add((local_rank, current))
    warnings.warn(
        f"gpucache: LOCAL_RANK={local_rank} but the current CUDA device is cuda:{current}, so "
        f"this rank decodes on cuda:{current} along with the other ranks that did not choose a "
        "device. Call torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) before making the "
        "loader, or pass device=f\"cuda:{os.environ['LOCAL_RANK']}\".",
        RuntimeWarning,
        stacklevel=4,
    )
