"""The GPU backends' masks: decoded on threads ahead of the batch, placed on the device unawaited.

A batch's mask PNGs cost 0.2-0.4 ms each to decode (:mod:`.._masks`), 50-100 ms for 256 of them:
on the training loop's thread that would stall every step. :meth:`MaskStage.submit` splits a
batch's masks among threads (libpng releases the GIL) as soon as the batch is submitted, so they
decode beside the images; :meth:`MaskStage.place` then puts them on the device without a host
synchronisation: a fixed-size batch goes into one host buffer (pinned when the device is CUDA),
crosses in one ``non_blocking`` copy with its plans, and is gathered there in a constant number of
ops (:func:`.._masks.gather_masks`, its output size read from the host plans, never from the
device). A variable-size batch's masks go through their plans on the threads, one copy each.

The nvjpeg backend runs it on its CPU stage's threads and places the masks on its transform
thread; the DALI backend runs it on threads of its own and places them on the consumer's thread.
Device-agnostic: CI runs it on CPU tensors and on the emulated GPU, whose sync counter holds it
to no host synchronisation.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from ...base._plan import Col
from ...store._store import Store
from ...store._targets import kept_rows
from ...transforms._device import to_device
from .. import _masks


@dataclass
class PendingMasks:
    """One batch's masks in the making: ``host`` is filled by ``futures`` (one a chunk)."""

    indices: np.ndarray
    host: torch.Tensor | list[torch.Tensor | None]
    futures: list[Future[None]]

    def wait(self) -> None:
        """Until every chunk is decoded; a chunk's error is raised here."""
        for f in self.futures:
            f.result()

    def cancel(self) -> None:
        """Drop the batch: queued chunks are cancelled, running ones waited for (their errors
        belong to the dropped batch)."""
        for f in self.futures:
            if not f.cancel():
                f.exception()


def _done(run: Callable[[], None]) -> Future[None]:
    """A future of ``run`` run now (no pool: every chunk inline, in order)."""
    f: Future[None] = Future()
    try:
        run()
        f.set_result(None)
    except Exception as err:  # noqa: BLE001 - raised at wait(), in batch order
        f.set_exception(err)
    return f


class MaskStage:
    """Masks of a store decoded on ``pool``'s threads (``chunks`` pieces a batch; inline without
    a pool) and placed on ``device``: ``fill`` where a plan pads, ``dtype`` the store's."""

    def __init__(
        self,
        cache: Store,
        *,
        fill: int,
        dtype: torch.dtype,
        device: torch.device,
        pool: Executor | None,
        chunks: int,
    ) -> None:
        if cache.masks is None:
            raise ValueError("a mask stage needs a store with masks (build it with masks=)")
        self.cache, self.fill, self.dtype, self.device = cache, fill, dtype, device
        self.masks = cache.masks
        self.pool, self.chunks = pool, max(1, chunks)

    def _run(self, work: Callable[[], None]) -> Future[None]:
        return self.pool.submit(work) if self.pool is not None else _done(work)

    def submit(self, indices: np.ndarray, plans: np.ndarray, stack: bool) -> PendingMasks:
        """Start decoding the masks of ``indices`` (a fixed-size batch when ``stack``)."""
        idx = np.asarray(indices, dtype=np.int64)
        plans = np.asarray(plans)
        cut = np.array_split(np.arange(len(idx)), min(self.chunks, len(idx))) if len(idx) else []
        if stack:
            m = self.masks
            hmax = int(m.heights[idx].max()) if len(idx) else 0
            wmax = int(m.widths[idx].max()) if len(idx) else 0
            pinned = self.device.type == "cuda"  # one pinned buffer, one non_blocking copy
            host = torch.zeros((len(idx), hmax, wmax), dtype=self.dtype, pin_memory=pinned)

            def fill_rows(rows: np.ndarray) -> None:
                for k in rows.tolist():
                    x = _masks.decode_one(self.cache, int(idx[k]), self.dtype)
                    host[k, : x.shape[0], : x.shape[1]] = x

            return PendingMasks(idx, host, [self._run(partial(fill_rows, r)) for r in cut])
        each: list[torch.Tensor | None] = [None] * len(idx)

        def plan_rows(rows: np.ndarray) -> None:
            for k in rows.tolist():
                mask = _masks.decode_one(self.cache, int(idx[k]), self.dtype)
                each[k] = _masks.apply_mask_plan(mask, plans[k].tolist(), self.fill)

        return PendingMasks(idx, each, [self._run(partial(plan_rows, r)) for r in cut])

    def place(
        self, pending: PendingMasks, plans: np.ndarray, kept: np.ndarray
    ) -> torch.Tensor | list[torch.Tensor]:
        """The masks of the ``kept`` samples (indices, in batch order; the rest failed) on the
        device, on the calling thread's current stream, with no host synchronisation."""
        pending.wait()
        rows = kept_rows(pending.indices, kept)
        host = pending.host
        if isinstance(host, torch.Tensor):
            plans = np.asarray(plans)[rows]
            size = (int(plans[0, Col.HEIGHT2]), int(plans[0, Col.WIDTH2])) if len(rows) else (0, 0)
            if len(rows) != len(host):  # samples failed: their rows go (rare; a host copy)
                host = host[torch.from_numpy(rows)]
            on = to_device(host, self.device)
            p = to_device(
                torch.from_numpy(np.ascontiguousarray(plans, dtype=np.int64)), self.device
            )
            return _masks.gather_masks(on, p, self.fill, size=size)
        out = []
        for r in rows.tolist():
            x = host[r]
            assert x is not None  # every chunk ran (wait() raised otherwise)
            out.append(to_device(x, self.device))
        return out
