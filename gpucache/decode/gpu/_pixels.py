"""The decoded tier on a CUDA device: batches cut from pixels decoded once, transformed there.

Two ways, one class:

- ``resident`` (the ``device`` tier): the tier's pixels are uploaded to the device once a
  process (one copy of :attr:`DecodedPixels.data`, on first use); a batch's images are views of
  that one buffer (no op), and :func:`gpucache.transforms._resample.resample` runs every plan of
  a fixed-size batch in its constant number of ops a chunk: no decode, no host-to-device copy of
  pixels a batch;
- otherwise (the ``decoded`` tier on CUDA): the batch's images are joined on the host into one
  pinned buffer and cross in one ``non_blocking`` copy, then the same ops run.

A sample the tier marks as decoded from the store (it failed, or libjpeg warned, at build) is
decoded on the CPU through :func:`.._core.decode_batch` as it would be without the tier, and put
in its place. Masks follow their images' plans on the host (the tier's size first, nearest
neighbour) and cross beside them. Device-agnostic: CI runs it on CPU tensors and on the
emulated GPU; it has not run on a real GPU.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np
import torch

from ...store._decoded import IN_TIER, DecodedPixels
from ...store._readonly import tensor_over
from ...store._store import Store
from ...transforms._chunks import BUDGET_BYTES, Scratch
from ...transforms._resample import resample
from .._apply import apply_plan, no_autocast
from .._base import Backend
from .._core import decode_batch
from .._masks import MaskOptions, fill_padding
from .._options import DecodeOptions
from .._outcome import Decoded, out_size


class PixelBackend(Backend):
    name = "pixels"

    def __init__(
        self,
        cache: Store,
        pixels: DecodedPixels,
        *,
        device: torch.device,
        resident: bool,
        options: DecodeOptions,
    ) -> None:
        self.cache, self.pixels, self.device, self.options = cache, pixels, device, options
        self.resident = resident
        self.masks = MaskOptions.of(options)
        self._flat: torch.Tensor | None = None  # the tier on the device (resident)
        self._scratch = Scratch(BUDGET_BYTES)
        self._queue: deque[tuple[np.ndarray, np.ndarray, bool]] = deque()

    @property
    def device_bytes(self) -> int:
        """Bytes of the device this backend holds for the tier itself."""
        return 0 if self._flat is None else self._flat.numel()

    def _on_device(self) -> torch.Tensor:
        if self._flat is None:  # one upload a process, of the whole tier
            self._flat = tensor_over(self.pixels.data).to(self.device)
        return self._flat

    def submit(
        self, indices: np.ndarray, plans: np.ndarray, stack: bool, key: tuple[int, ...] = ()
    ) -> None:
        self._queue.append((np.asarray(indices, np.int64), np.asarray(plans), stack))

    def __len__(self) -> int:
        return len(self._queue)

    def drain(self) -> None:
        self._queue.clear()

    def close(self) -> None:
        self._queue.clear()
        self._flat = None

    def get(self) -> Decoded:
        indices, plans, stack = self._queue.popleft()
        t0 = time.perf_counter()
        held = self.pixels.status[indices] == IN_TIER
        rest = np.flatnonzero(~held)
        store = None
        if len(rest):  # decoded from the store, as without the tier
            store = decode_batch(self.cache, indices[rest], plans[rest], self.options, stack=False)
        t1 = time.perf_counter()
        images = self._images(indices[held])
        t2 = time.perf_counter()
        kept_store = set() if store is None else set(store.indices.tolist())
        keep = np.array([h or int(indices[k]) in kept_store for k, h in enumerate(held)], bool)
        order = np.flatnonzero(keep)
        mine = held[order]  # which of the kept come from the tier
        fill = self.options.fill
        with no_autocast(self.device):
            if stack:
                out = self._stacked(images, plans[held], store, mine, out_size(plans))
            else:
                it, st = iter(images), iter([] if store is None else store.images)
                out_list = [
                    apply_plan(next(it), plans[k], fill) if h else next(st).to(self.device)
                    for k, h in zip(order.tolist(), mine.tolist())
                ]
        t3 = time.perf_counter()
        result = Decoded(
            out if stack else out_list,
            indices[order],
            [] if store is None else store.failed,
            int((~mine).sum()),
            warned=[] if store is None else store.warned,
            times={"read": t2 - t1, "decode": t1 - t0, "resize": t3 - t2},
            routes={"fallback": int((~mine).sum())},
        )
        result.busy = t3 - t0
        if self.masks is not None:
            result.masks = self._masks(indices, plans, order, mine, store, stack)
        return result

    def _images(self, rows: np.ndarray) -> list[torch.Tensor]:
        """The tier's images of ``rows`` on the device, (3, H, W) views of HWC pixels."""
        p = self.pixels
        heights, widths = p.heights[rows].tolist(), p.widths[rows].tolist()
        starts = p.offsets[rows].tolist()
        if self.resident:
            flat = self._on_device()
        else:  # the batch's images joined on the host, one copy to the device
            host = tensor_over(p.data)
            parts = [host[s : s + h * w * 3] for s, h, w in zip(starts, heights, widths)]
            joined = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
            if self.device.type == "cuda":
                joined = joined.pin_memory()
            flat = joined.to(self.device, non_blocking=True)
            sizes = [h * w * 3 for h, w in zip(heights, widths)]
            starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int).tolist()
        return [
            flat[s : s + h * w * 3].view(h, w, 3).permute(2, 0, 1)
            for s, h, w in zip(starts, heights, widths)
        ]

    def _stacked(
        self,
        images: list[torch.Tensor],
        plans: np.ndarray,
        store: Decoded | None,
        mine: np.ndarray,
        size: tuple[int, int],
    ) -> torch.Tensor:
        tier = None
        if images:  # the batched resize pads with zeros: fill where the plans pad
            tier = fill_padding(
                resample(images, plans, scratch=self._scratch), plans, self.options.fill
            )
        extra = [] if store is None else list(store.images)
        if not extra:
            if tier is not None:
                return tier
            return torch.empty((0, 3, *size), dtype=torch.uint8, device=self.device)
        out = torch.empty((len(mine), 3, *size), dtype=torch.uint8, device=self.device)
        if tier is not None:
            out[torch.from_numpy(np.flatnonzero(mine)).to(self.device)] = tier
        out[torch.from_numpy(np.flatnonzero(~mine)).to(self.device)] = torch.stack(extra).to(
            self.device
        )
        return out

    def _masks(
        self,
        indices: np.ndarray,
        plans: np.ndarray,
        order: np.ndarray,
        mine: np.ndarray,
        store: Decoded | None,
        stack: bool,
    ) -> torch.Tensor | list[torch.Tensor]:
        assert self.masks is not None
        p = self.pixels
        from_store = iter([] if store is None or store.masks is None else list(store.masks))
        masks = []
        for k, m in zip(order.tolist(), mine.tolist()):
            i = int(indices[k])
            if m:
                size = (int(p.heights[i]), int(p.widths[i]))
                masks.append(self.masks.apply(self.cache, i, plans[k].tolist(), size))
            else:
                masks.append(next(from_store))
        if not stack:
            return [m.to(self.device) for m in masks]
        if not masks:
            return torch.empty((0, *out_size(plans)), dtype=self.masks.dtype, device=self.device)
        return torch.stack(masks).to(self.device)
