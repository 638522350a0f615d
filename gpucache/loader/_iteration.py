"""The loader's passes: each ``iter(loader)`` plans, submits and collects its batches through a
decode backend, prefetching ahead, and finishes each batch on the loader's device (labels or
masks, the batch steps the backend did not run, ``BatchInfo``).

:class:`Iteration` is the part of :class:`~gpucache.GpuCachedLoader` that runs passes; the loader
sets up what it reads (its annotations) and adds the DataLoader habits and the resume state.
"""

from __future__ import annotations

import logging
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
import torch

from ..decode import _masks
from ..decode._base import GPU_IN_FLIGHT, Backend
from ..decode._options import DecodeOptions
from ..decode._outcome import Decoded
from ..decode._timing import TIMED, stage_clock
from ..decode._timing import stage_range as _range
from ..shares._order import Segment
from ..store._store import Store
from ..store._targets import dense_targets, kept_rows, ragged_targets
from ..transforms._compose import Compose
from ..transforms._device import to_device
from ..transforms._generator import batch_generator
from ..transforms._steps import apply_mask_steps, apply_steps
from ._sampling import Sampling
from ._stats import LoaderStats
from ._tier import Tier, store_plans

log = logging.getLogger(__name__)


class BatchInfo(NamedTuple):
    """Per-sample details of a batch (``return_metadata=True``). Strings stay Python lists."""

    indices: torch.Tensor  # store indices, in batch order
    paths: list[str]
    metadata: list[str] | None
    skipped: list[tuple[int, str]]  # (store index, reason) of samples left out of this batch
    #: (N, 11) geometric plan of each sample (transforms.map_boxes), in the store's image
    #: coordinates (float64 on the decoded tier: its first crop scaled by the image's factor)
    plans: np.ndarray | None = None
    targets: list[torch.Tensor] | None = None  # per-sample ragged targets (K_i, C), as stored
    #: the batch's class labels when masks take their place in the batch (a store with masks)
    labels: torch.Tensor | None = None


class _Pass:
    """Where one pass over an epoch stands: it started at global position ``start`` (node
    shares: after the epoch's ``prior`` segments)."""

    def __init__(
        self,
        epoch: int,
        start: int,
        replicas: int,
        batch_size: int,
        total: int,
        prior: list[Segment] | None = None,
    ):
        self.epoch, self.start, self.replicas, self.batch_size = epoch, start, replicas, batch_size
        self.total, self.batches_done, self.prior = total, 0, prior

    @property
    def position(self) -> int:
        """Global samples of the epoch's order consumed: ranks go in lockstep, so batch k of every
        rank covers global slots [start + k*B*W, start + (k+1)*B*W)."""
        return min(self.total, self.start + self.batches_done * self.batch_size * self.replicas)


class Iteration:
    """Passes over the epochs: the batches of each, prefetched through the backend, finished on
    the loader's device. ``GpuCachedLoader.__init__`` sets every attribute annotated here."""

    cache: Store
    sampling: Sampling
    transform: Compose
    decode_options: DecodeOptions
    device: torch.device
    backend_name: str
    prefetch_factor: int
    hw_decoder_load: float
    return_metadata: bool
    stats: LoaderStats
    _tier: Tier
    _steps_in_backend: int
    _masks_dtype: torch.dtype | None

    def _start(self) -> None:
        """No pass yet: the next one plays epoch 0, with a backend made on its first batch."""
        self._next_epoch = 0  # the epoch a fresh pass plays
        # (epoch, global position, node shares: the epoch's segments so far) from load_state_dict
        self._resume: tuple[int, int, list[Segment]] | None = None
        self._pass: _Pass | None = None  # the pass under way (or abandoned), for state_dict()
        self._passes = 0  # counts passes, so a superseded iterator can tell
        #: node shares: repeats this rank plays in the pass under way (its node's padding, and
        #: samples its build left out), and samples of its node that drop_last leaves out
        self.epoch_padding = self.epoch_dropped = 0
        self._backend: Backend | None = None
        self._closed = False  # close() was called: iterating raises instead of restarting

    def plans(self, epoch: int, batch: int, indices: np.ndarray) -> np.ndarray:
        """The geometric plan of each sample of one batch (seeded by seed, epoch, batch, rank)."""
        rng = np.random.default_rng(list(self.sampling.key(epoch, batch)))
        if self._tier.heights is not None and self._tier.widths is not None:  # the tier's sizes
            return self.transform.plan(self._tier.heights[indices], self._tier.widths[indices], rng)
        s = self.cache.samples
        return self.transform.plan(
            s["height"][indices].astype(np.int64), s["width"][indices].astype(np.int64), rng
        )

    def _get_backend(self) -> Backend:
        if self._backend is None:
            if self._masks_dtype is not None:
                _masks.warm()  # before the workers fork: not once in each
            self._backend = _make_backend(self)
            self.stats.probe = self._backend.private_memory
        return self._backend

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        """A fresh pass: the next epoch from batch 0, or where ``load_state_dict`` said."""
        if self._closed:
            raise RuntimeError(
                "gpucache: this GpuCachedLoader is closed (close() was called, or its `with` "
                "block ended): its workers are stopped and it does not start new ones behind "
                "your back. Make a new GpuCachedLoader(...) to iterate again, or keep this one "
                "open (no close(), no `with`) for as many epochs as you need."
            )
        backend = self._get_backend()
        backend.drain()  # results of a pass left early
        epoch, start, segments = (
            self._resume if self._resume is not None else (self._next_epoch, 0, [])
        )
        prior: list[Segment] | None = segments
        order = self.sampling
        bs, replicas = order.batch_size, order.num_replicas
        if order.nodes is not None:  # this node's share: the rest of its epoch after `prior`
            rank_plan = order.node_plan(epoch, segments)
            batches = order.batches(rank_plan.indices)
            first = sum(s.batches_done for s in segments)
            self.epoch_padding, self.epoch_dropped = rank_plan.padded, rank_plan.dropped
        else:
            batches = order.batches(order.epoch_indices(epoch, start))
            first = start // (bs * replicas)  # batch number of the first batch, for the plans
            prior = None
        self._passes += 1
        me = self._passes
        self._resume, self._next_epoch = None, epoch + 1
        self._pass = pos = _Pass(epoch, start, replicas, bs, order.global_size(), prior)
        stack = self.transform.fixed_size
        ahead = (
            self.prefetch_factor * max(1, self.decode_options.num_workers)
            if self.backend_name == "cpu"
            else max(GPU_IN_FLIGHT, self.prefetch_factor)
        )
        submitted = 0
        in_flight: deque[tuple[np.ndarray, np.ndarray]] = deque()  # (indices, plans) per batch
        stats, clock = self.stats, stage_clock
        began = handed = clock()
        wall = stats.wall
        for b in range(len(batches)):
            if self._passes != me:
                raise RuntimeError(
                    "this GpuCachedLoader iterator was superseded: a newer "
                    "iter(loader) started a fresh pass; iterate that one."
                )
            asked = clock()
            if b:
                stats.record_step(asked - handed)
            profiled = torch.autograd._profiler_enabled()
            with _range("gpucache.plan", profiled):
                while submitted < len(batches) and submitted < b + ahead:
                    idx = batches[submitted]
                    in_flight.append((idx, self.plans(epoch, first + submitted, idx)))
                    backend.submit(
                        idx, in_flight[-1][1], stack, self.sampling.key(epoch, first + submitted)
                    )
                    submitted += 1
            planned = clock()
            ready = backend.ready() if TIMED else 0
            try:
                with _range("gpucache.wait_for_batch", profiled):
                    out = backend.get()
            except BaseException:
                self._stop_backend()  # a failed backend is not reused; the next pass starts afresh
                raise
            pos.batches_done = b + 1
            row = {"plan": planned - asked}
            batch = self._finish(out, epoch, first + b, *in_flight.popleft(), row, profiled)
            handed = clock()
            if b:
                row["wait"] = handed - asked
            else:  # workers starting, the queue filling: not the steady state
                stats.first_wait += handed - asked
            stats.record(row, len(out.indices), out, ready)
            stats.wall = wall + handed - began
            yield batch
        stats.record_step(clock() - handed)
        stats.wall = wall + clock() - began
        stats.passes += 1
        stats.end_epoch(epoch)
        if self._pass is pos:
            self._pass = None  # finished: state_dict() now points at the next epoch's start

    @property
    def fill(self) -> int:
        """The image value where a plan pads (``fill=``)."""
        return self.decode_options.fill

    def _finish(
        self,
        out: Decoded,
        epoch: int,
        batch: int,
        submitted: np.ndarray,
        plans: np.ndarray,
        row: dict[str, float],
        profiled: bool,
    ) -> tuple[Any, ...]:
        """``(images, labels)``, or ``(images, labels, BatchInfo)`` with ``return_metadata``;
        the seconds its transfer and batch transforms took go into ``row``."""
        clock = stage_clock
        s = self.stats
        s.batches += 1
        s.samples += len(out.indices)
        s.cpu_decoded += out.cpu_decoded
        for index, reason in out.failed:
            s.skipped += 1
            s.skipped_samples.append((index, reason))
            warnings.warn(f"gpucache: skipped {reason}", RuntimeWarning, stacklevel=3)
        for index, reason in out.warned:  # kept (on_error="skip_warned" skips them): once each
            if index not in s.warned_samples:
                s.warned_samples[index] = reason
                s.warned += 1
                log.warning("gpucache: %s", reason)
        for index, reason in out.mismatched:  # kept, decoded without restart markers: once each
            if index not in s.mismatched_samples:
                s.mismatched_samples[index] = reason
                warnings.warn(f"gpucache: {reason}", RuntimeWarning, stacklevel=3)
        move = self._move
        t0 = clock()
        with _range("gpucache.transfer", profiled):
            images = out.images
            images = (
                move(images) if isinstance(images, torch.Tensor) else [move(im) for im in images]
            )
            dense = dense_targets(self.cache)  # float (N, C) targets replace int labels if stored
            labels = move(
                torch.from_numpy((self.cache.labels if dense is None else dense)[out.indices])
            )
        t1 = clock()
        generator = batch_generator(*self.sampling.key(epoch, batch))
        if out.rng_state is not None:  # the backend ran the first steps: the rest go on from there
            generator.set_state(torch.frombuffer(bytearray(out.rng_state), dtype=torch.uint8))
        rest = self.transform.steps[self._steps_in_backend :]
        kept = plans[kept_rows(submitted, out.indices)]
        masks = None
        if self._masks_dtype is not None:
            with _range("gpucache.masks", profiled):
                masks = self._batch_masks(out)
        with _range("gpucache.transform", profiled):
            images, labels = apply_steps(rest, images, labels, generator)
            if masks is not None:
                masks = apply_mask_steps(rest, masks)
        row["transfer"], row["transform"] = t1 - t0, clock() - t1
        first = labels if masks is None else masks
        if not self.return_metadata:
            return images, first
        meta = self.cache.metadata
        info = BatchInfo(
            torch.from_numpy(out.indices),
            [self.cache.paths[i] for i in out.indices],
            None if meta is None else [meta[i] for i in out.indices],
            out.failed,
            store_plans(self._tier, out.indices, kept, self.cache),
            _ragged(self.cache, out.indices, move),
            None if masks is None else labels,
        )
        return images, first, info

    def _batch_masks(self, out: Decoded) -> torch.Tensor | list[torch.Tensor]:
        """The batch's masks on the loader's device, as the backend brought them: the cpu
        workers decode them beside the images, the GPU backends on threads of their own and
        already on the device (never on this, the training loop's, thread)."""
        m = out.masks
        if m is None:
            raise RuntimeError(
                f"gpucache: the {self.backend_name} backend returned a batch without its masks "
                "(a backend bug; please report it)."
            )
        return self._move(m) if isinstance(m, torch.Tensor) else [self._move(t) for t in m]

    def _move(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` on the loader's device; with ``pin_memory`` through pinned memory and
        ``non_blocking`` (no host synchronisation on the training stream)."""
        return to_device(x, self.device) if self.decode_options.pin_memory else x.to(self.device)

    def _stop_backend(self) -> None:
        if self._backend is not None:
            self._backend.close()
            self._backend = None


def _ragged(
    cache: Store, indices: np.ndarray, move: Callable[[torch.Tensor], torch.Tensor]
) -> list[torch.Tensor] | None:
    """The batch's ragged targets, moved in one copy and split on the device (views)."""
    rows = ragged_targets(cache, indices)
    if rows is None:
        return None
    if not rows:
        return []
    joined = move(torch.from_numpy(np.concatenate(rows)))
    return list(joined.split([len(r) for r in rows]))


def _make_backend(loader: Iteration) -> Backend:
    name = loader.backend_name
    if name == "pixels":  # the decoded tier on a CUDA device
        from ..decode.gpu._pixels import PixelBackend

        assert loader._tier.pixels is not None
        return PixelBackend(
            loader.cache,
            loader._tier.pixels,
            device=loader.device,
            resident=loader._tier.name == "device",
            options=loader.decode_options,
        )
    if name == "cpu":
        from ..decode.cpu._backend import CpuBackend

        return CpuBackend(loader.cache, loader.decode_options)
    if name == "nvjpeg":
        from ..decode.gpu._nvjpeg import NvjpegBackend

        return NvjpegBackend(loader.cache, device=loader.device, options=loader.decode_options)
    from ..decode.gpu._dali import DaliBackend

    return DaliBackend(
        loader.cache,
        device=loader.device,
        options=loader.decode_options,
        batch_size=loader.sampling.batch_size,
        num_threads=max(1, loader.decode_options.num_workers),
        prefetch=max(2, loader.prefetch_factor),
        hw_decoder_load=loader.hw_decoder_load,
    )
