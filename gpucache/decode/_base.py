"""The interface every decode backend implements: submit batches, get them back in order."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np

from ._outcome import Decoded

#: Batches the loader keeps in a GPU backend at least: while the loop trains on batch k, batch
#: k+1 is transformed and batch k+2 decoded (the nvjpeg backend's stages run side by side). With
#: two, only batch k+1 would be in flight during the step: its decode and transforms one after
#: the other (``benchmarks/overlap.py --ahead``).
GPU_IN_FLIGHT = 3


class Backend(ABC):
    """Turns (store indices, geometric plans) into decoded uint8 images, in submission order.

    The loader keeps up to ``prefetch`` batches submitted ahead of the one it hands out, so a
    backend may work on several batches at once (worker processes, CUDA streams, DALI's queue).
    """

    name: ClassVar[str]

    @abstractmethod
    def submit(
        self, indices: np.ndarray, plans: np.ndarray, stack: bool, key: tuple[int, ...] = ()
    ) -> None:
        """Queue one batch; ``stack`` asks for one (N, 3, H, W) tensor instead of a list.
        ``key`` is the batch's (seed, epoch, batch[, rank]), for a backend that runs batch
        steps (the cpu backend's ``DecodeOptions.steps``); the others ignore it."""

    @abstractmethod
    def get(self) -> Decoded:
        """The oldest submitted batch, decoded (images on the backend's output device)."""

    @abstractmethod
    def __len__(self) -> int:
        """Batches submitted and not yet returned."""

    def drain(self) -> None:
        """Drop the batches of an abandoned epoch."""
        while len(self):
            self.get()

    def close(self) -> None:  # noqa: B027 - optional: a backend with nothing to free keeps it
        """Free processes, pipelines, streams and buffers. Idempotent."""

    @property
    def pids(self) -> list[int]:
        """Worker processes this backend runs (for leak checks)."""
        return []

    def ready(self) -> int:
        """Submitted batches already decoded and waiting to be taken (queue occupancy)."""
        return 0

    def private_memory(self) -> dict[int, int]:
        """Private dirty bytes of each worker process, by worker id (none for in-process
        backends)."""
        return {}
