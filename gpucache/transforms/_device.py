"""Host-to-device copies that never make the calling thread wait for the device.

A copy from pageable host memory to CUDA synchronises the host with the stream it runs on (CUDA
stages the bytes first), so a per-batch ``torch.tensor(values, device="cuda")`` or
``cpu_tensor.to("cuda")`` on the training stream stalls the training loop every batch.
:func:`to_device` goes through pinned memory with ``non_blocking=True`` instead (the caching host
allocator keeps the pinned block until the copy is done), and :class:`DeviceConstants` makes a
transform's constants once per device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``x`` on ``device`` in one copy: from the CPU to CUDA through pinned memory with
    ``non_blocking``, so the calling thread never waits for the device; else a plain ``.to``."""
    if x.device == device:
        return x
    if device.type == "cuda" and x.device.type == "cpu":
        return (x if x.is_pinned() else x.pin_memory()).to(device, non_blocking=True)
    return x.to(device)


class DeviceConstants:
    """Tensors made once per (device, key) on the CPU and moved with :func:`to_device`; never
    pickled (a transform sent to another process makes its own)."""

    def __init__(self) -> None:
        self._cache: dict[tuple[torch.device, object], torch.Tensor] = {}

    def get(
        self, device: torch.device, key: object, make: Callable[[], torch.Tensor]
    ) -> torch.Tensor:
        t = self._cache.get((device, key))
        if t is None:
            t = self._cache[(device, key)] = to_device(make(), device)
        return t

    def __getstate__(self) -> dict[str, object]:
        return {"_cache": {}}

    def __repr__(self) -> str:
        return f"DeviceConstants({len(self._cache)} cached)"
