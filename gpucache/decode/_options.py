"""The decode options: what the loader decides once and every layer below it reads.

One frozen object travels whole from the loader to the backend, the worker pool and each worker
process (pickled once a worker, under every start method), so no function between them takes
the settings one by one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..store._decoded import DecodedPixels


@dataclass(frozen=True)
class DecodeOptions:
    """How batches are decoded, and by what workers (``GpuCachedLoader``'s arguments).

    Attributes:
        on_error: ``"skip"``, ``"raise"`` or ``"skip_warned"`` (:data:`._outcome.ON_ERROR`).
        exact: True decodes every JPEG in full before its plan; False lets a JPEG decode at a
            reduced DCT scale where its plan shrinks it enough (:mod:`._scaled`).
        seed: The loader's seed; each worker's own comes from it (:meth:`worker_seed`).
        num_workers: Worker processes of the cpu backend (0: decode in the loader's process).
        context: The workers' start method (None: the platform's default).
        worker_init_fn: Called as ``fn(worker_id)`` in each worker after seeding it.
        timeout: Seconds to wait for a batch (None: as long as the workers live).
        pin_memory: Receive batches into pinned memory.
        steps: The first batch steps, those that act on each sample alone
            (:func:`gpucache.transforms.per_sample_prefix`), run by the cpu backend with the
            decode when the batch ends on the CPU; the loop's process runs the rest.
        masks: Decode each sample's mask beside its image and send it through the plan
            (:mod:`._masks`); ``Decoded.masks`` holds them.
        mask_fill: The mask value where a plan pads (an ignore index).
        mask_dtype: The masks' dtype name (``"uint8"``, or ``"int32"`` for 16-bit masks).
        fill: The image value where a plan pads (every channel).
        pixels: The loader's decoded tier (``decoded=``), or None: samples held there are cut
            from its pixels instead of decoded (:func:`._core.decode_batch`); it pickles as
            its file's descriptor, O(1) bytes a worker.
    """

    on_error: str = "skip"
    exact: bool = True
    seed: int = 0
    num_workers: int = 0
    context: str | None = None
    worker_init_fn: Callable[[int], None] | None = None
    timeout: float | None = None
    pin_memory: bool = False
    steps: tuple[Any, ...] = ()
    masks: bool = False
    mask_fill: int = 255
    mask_dtype: str = "uint8"
    fill: int = 0
    pixels: DecodedPixels | None = None
    batch_files: bool = False  # the pool's: workers send batches as memory files (cpu._batch_files)

    def worker_seed(self, wid: int) -> int:
        """Worker ``wid``'s seed: ``SeedSequence(seed).spawn(num_workers)[wid]``'s first word."""
        return int(np.random.SeedSequence(self.seed).spawn(wid + 1)[wid].generate_state(1)[0])


#: The options of a loader made with every default (on_error="skip", exact decodes, no masks).
DEFAULTS = DecodeOptions()
