"""backend="cpu": decode in persistent worker processes, or inline with ``num_workers=0``.

Out of memory is never a bad sample: inline it raises ``MemoryError`` (``store/_oom.py``), in a
worker a ``WorkerError`` that says so.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from ...store._oom import raise_if_out_of_memory
from ...store._store import Store
from .._base import Backend
from .._core import decode_batch
from .._options import DecodeOptions
from .._outcome import Decoded
from ._pool import WorkerPool


class CpuBackend(Backend):
    name = "cpu"

    def __init__(self, cache: Store, options: DecodeOptions):
        self.cache, self.options = cache, options
        self.pool = WorkerPool(cache, options) if options.num_workers > 0 else None
        self._inline: deque[tuple[np.ndarray, np.ndarray, bool, tuple[int, ...]]] = deque()

    def submit(
        self, indices: np.ndarray, plans: np.ndarray, stack: bool, key: tuple[int, ...] = ()
    ) -> None:
        if self.pool is not None:
            self.pool.submit(indices, plans, stack, key)
        else:  # decoded lazily in get(), so an abandoned epoch costs nothing
            self._inline.append((indices, plans, stack, key))

    def get(self) -> Decoded:
        if self.pool is not None:
            return self.pool.get()
        indices, plans, stack, key = self._inline.popleft()
        try:
            out = decode_batch(self.cache, indices, plans, self.options, stack=stack, key=key)
        except RuntimeError as err:  # the batch's own (the stack); a sample's is OutOfMemory
            raise_if_out_of_memory(err, f"while decoding a batch of {len(indices)} samples")
            raise
        if self.options.pin_memory and hasattr(out.images, "pin_memory"):
            out.images = out.images.pin_memory()
        return out

    def __len__(self) -> int:
        return len(self.pool) if self.pool is not None else len(self._inline)

    def drain(self) -> None:
        if self.pool is None:
            self._inline.clear()
        else:
            self.pool.drain()

    def close(self) -> None:
        self._inline.clear()
        if self.pool is not None:
            self.pool.close()

    @property
    def pids(self) -> list[int]:
        return self.pool.pids if self.pool is not None else []

    def ready(self) -> int:
        return self.pool.ready() if self.pool is not None else 0

    def private_memory(self) -> dict[int, int]:
        return self.pool.private_memory() if self.pool is not None else {}
