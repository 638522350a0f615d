"""GpuCachedLoader: its arguments checked and held (order and sharding as one
:class:`~._sampling.Sampling`, decoding as one :class:`~gpucache.decode._options.DecodeOptions`),
the DataLoader habits and the resume state; the passes themselves are :mod:`._iteration`'s."""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing as mp
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import torch

from .. import decode as _decode
from ..base import _dist
from ..decode import _masks
from ..decode._device import resolve_device
from ..decode._options import DecodeOptions
from ..decode.cpu._procs import default_workers
from ..shares import _order as _nodes
from ..shares._order import NodeOrder, Segment
from ..store._store import Store
from ..transforms._compose import Compose, as_compose
from ..transforms._transform import Transform
from . import _sampling, _state, _tier
from ._iteration import Iteration
from ._sampling import Sampling, Visits
from ._stats import LoaderStats


class GpuCachedLoader(Iteration):
    """A ``torch.utils.data.DataLoader`` replacement that decodes from a :class:`JpegCache`.

    Yields ``(images, labels)`` on ``device`` (``(images, labels, BatchInfo)`` with
    ``return_metadata=True``). For a store with masks it yields ``(images, masks)``: (N, H, W)
    integer masks aligned pixel for pixel with the images (``masks=False`` for labels instead;
    the labels are in ``BatchInfo.labels``). ``transform=None`` yields a list of variable-size uint8 CHW tensors;
    a transform that fixes the output size yields one (N, C, H, W) batch. Every argument but the
    store is keyword-only; they come in groups, each named in italics at its first argument.

    Args:
        cache: The store to read (``JpegCache.from_folder``, ``JpegCache.open``, ...).
        batch_size: *Order and sharding.* Samples a batch (per rank).
        shuffle: A new order every epoch, drawn from ``(seed, epoch)``.
        drop_last: Leave out the last, short batch (and, across ranks, the samples that do not
            divide evenly) instead of padding like ``DistributedSampler``.
        seed: Order, crops and augmentation draws come from it; the same seed gives the same
            batches on every backend and worker count. None: one is drawn (the same on every
            rank of a job).
        generator: Instead of ``seed``, its ``initial_seed()`` (not both).
        num_replicas: Ranks the epoch is split across; None: the process group's world size
            (or ``WORLD_SIZE``), else 1.
        rank: This process's rank; None: the process group's (or ``RANK``), else 0.
        indices: Iterate this subset of the store (store indices) instead of all of it.
        weights: Draw ``num_samples`` samples an epoch with these probabilities (with
            replacement), like ``WeightedRandomSampler``.
        num_samples: Visits an epoch with ``weights`` (default: the subset's size).
        num_workers: *Workers.* CPU decode processes (``backend="cpu"``; DALI's CPU threads
            for ``"dali"``). None: this rank's share of the usable cores. 0 decodes in the
            main process.
        prefetch_factor: Batches each worker works on ahead (GPU backends: batches in flight,
            at least 3).
        persistent_workers: Accepted for ``DataLoader`` compatibility and ignored: workers are
            always persistent (started on the first iteration, reused every epoch, stopped by
            ``close()``). False warns that it has no effect.
        multiprocessing_context: ``"fork"``, ``"spawn"`` or ``"forkserver"``; None: the
            platform's default. Workers attach to the same store pages under each.
        worker_init_fn: Called as ``fn(worker_id)`` in each worker after seeding it.
        timeout: Seconds to wait for a batch before a hung worker becomes a ``WorkerError``;
            None waits as long as the workers live.
        device: *Decoding.* Where batches end up: None is CUDA when present, else the CPU;
            ``"cuda"`` means the current CUDA device.
        backend: ``"cpu"`` (worker processes, libjpeg-turbo), ``"nvjpeg"`` (batched GPU decode
            and transforms), ``"dali"`` (an NVIDIA DALI pipeline), or ``"auto"``: nvjpeg on
            CUDA, else cpu (dali only when asked for: its GPU graph is untested on GPU).
        exact: True decodes every JPEG in full before its plan (bit-exact with a full decode);
            False (default) lets the CPU decode at a reduced DCT scale and cut an eval crop
            before its resize, within the tolerance the manual states.
        hw_decoder_load: DALI only: the share of JPEGs sent to the GPU's hardware decoder.
        on_error: A sample that fails to decode is left out and reported (``"skip"``), stops
            the run (``"raise"``: ``SampleError``), or, with ``"skip_warned"``, also left out
            when libjpeg warned about corrupt data it decoded anyway.
        transform: *Output.* Geometric transforms (planned per sample from stored sizes),
            then batch steps (Normalize, ColorJitter, MixUp, any callable); torchvision
            pipelines are translated. None yields the decoded images.
        pin_memory: Move batches to CUDA through pinned memory with ``non_blocking`` (default
            on CUDA); no effect on the CPU.
        return_metadata: Also yield a :class:`BatchInfo` (indices, paths, metadata, skipped
            samples, plans, ragged targets, and the labels when masks are yielded) with each
            batch.
        masks: *Masks.* None (default): yield each batch's masks in place of its labels when
            the store has masks; False: labels as for any store; True: masks, and a store
            without them is an error. Masks follow their image's plan by nearest neighbour:
            uint8 for 8-bit masks, int32 when the store holds 16-bit ones.
        mask_fill: The mask value where a plan pads (CenterCrop on a small image,
            ``Letterbox``, ``Pad``): an ignore index, 255 by default.
        fill: The image value (every channel, uint8) where a plan pads; 0 by default.
        decoded: *Decoded tier* (docs/guides/decoded.md). Decode every image once, resized so
            its short side is this many pixels (never enlarged), and hold those pixels once per
            node; batches are then cut from them, not decoded. None (default): the raw tier.
        decoded_side: ``"short"`` (default; for Resize/RandomResizedCrop pipelines) or
            ``"long"``: the long side is made ``decoded`` (letterbox pipelines).
        decoded_budget: Bytes the tier may take; None: half of the node's available memory.
            A tier over it, or one whose file cannot be written, falls back to the raw tier
            with a warning naming the bytes and the fix (``tier_reason``).
        device_budget: Hold the tier on the GPU too (the ``device`` tier, CUDA only): bytes,
            or a share of the GPU's free memory (a float); None (default): not on the GPU.
        cache_dir: The node cache folder the tier's file goes in; None: the folder of a node
            store, else the default node cache folder when a file is needed.
    """

    def __init__(
        self,
        cache: Store,
        *,
        # order and sharding
        batch_size: int,
        shuffle: bool = False,
        drop_last: bool = False,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        num_replicas: int | None = None,
        rank: int | None = None,
        indices: Sequence[int] | np.ndarray | None = None,
        weights: Sequence[float] | np.ndarray | None = None,
        num_samples: int | None = None,
        # workers
        num_workers: int | None = None,
        prefetch_factor: int = 2,
        persistent_workers: bool = True,
        multiprocessing_context: str | None = None,
        worker_init_fn: Callable[[int], None] | None = None,
        timeout: float | None = 300.0,
        # decoding
        device: str | torch.device | None = None,
        backend: Literal["auto", "cpu", "nvjpeg", "dali"] = "auto",
        exact: bool = False,
        hw_decoder_load: float = 0.65,
        on_error: Literal["skip", "raise", "skip_warned"] = "skip",
        # output
        transform: Transform | Sequence[Transform] | None = None,
        pin_memory: bool | None = None,
        return_metadata: bool = False,
        # masks
        masks: bool | None = None,
        mask_fill: int = 255,
        fill: int = 0,
        # decoded tier
        decoded: int | None = None,
        decoded_side: Literal["short", "long"] = "short",
        decoded_budget: int | None = None,
        device_budget: int | float | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if not isinstance(cache, Store):
            raise TypeError(
                f"cache must be a gpucache.JpegCache, got {type(cache).__name__}; "
                "build one with JpegCache.from_folder(root) or JpegCache.open(path)."
            )
        _check_workers(
            num_workers, prefetch_factor, persistent_workers, multiprocessing_context, timeout
        )
        if on_error not in ("skip", "raise", "skip_warned"):
            raise ValueError(
                f"on_error must be 'skip', 'raise' or 'skip_warned', got {on_error!r}."
            )
        self.cache = cache
        # order and sharding: one value
        num_replicas, rank = _sampling.sharding(num_replicas, rank)
        visits = Visits(len(cache), indices=indices, weights=weights, num_samples=num_samples)
        nodes = _sampling.node_order(cache, visits, num_replicas, rank)
        self.sampling = Sampling(
            visits,
            batch_size=batch_size,
            shuffle=shuffle,
            drop_last=drop_last,
            seed=_sampling.seed_of(seed, generator, num_replicas, shuffle),
            num_replicas=num_replicas,
            rank=rank,
            nodes=nodes,
        )
        # output and masks
        self.transform = as_compose(transform)
        self._masks_dtype = _mask_setup(cache, masks, mask_fill, fill, self.transform)
        self.return_metadata = return_metadata
        # decoding: where, by which backend and workers, from which tier
        self.device = resolve_device(device)  # normalised: cuda -> cuda:<current>
        self.backend_name = _decode.resolve(backend, self.device)
        workers = default_workers() if num_workers is None else num_workers
        self.prefetch_factor, self.hw_decoder_load = prefetch_factor, hw_decoder_load
        request = _tier.request(
            decoded=decoded,
            decoded_side=decoded_side,
            decoded_budget=decoded_budget,
            device_budget=device_budget,
            cache_dir=cache_dir,
        )
        self._tier = _tier_of(
            cache, request, self.device, workers, multiprocessing_context, num_replicas
        )
        if self._tier.pixels is not None:  # cut from pixels: on the CPU, or on the device
            self.backend_name = "cpu" if self.device.type == "cpu" else "pixels"
        self._steps_in_backend = _steps_in_backend(self.transform, self.backend_name, self.device)
        self.decode_options = DecodeOptions(
            on_error=on_error,
            exact=bool(exact),  # False: CPU decode may use DCT scaling (docs/guides/backends.md)
            seed=self.sampling.seed,
            num_workers=workers,
            context=multiprocessing_context,
            worker_init_fn=worker_init_fn,
            timeout=timeout or None,
            pin_memory=_pin_memory(pin_memory, self.device),
            steps=tuple(t for _, t in self.transform.steps[: self._steps_in_backend]),
            masks=self._masks_dtype is not None,
            mask_fill=mask_fill,
            mask_dtype=str(self._masks_dtype or torch.uint8).removeprefix("torch."),
            fill=fill,
            pixels=self._tier.pixels,
        )
        self.stats = LoaderStats(
            workers=max(1, workers) if self.backend_name == "cpu" else 1,
            backend=self.backend_name,
        )
        self.stats.tier = self._tier.describe()
        self._start()

    # ------------------------------------------------------------------ the arguments, as held
    @property
    def batch_size(self) -> int:
        """Samples a batch (per rank)."""
        return self.sampling.batch_size

    @property
    def shuffle(self) -> bool:
        """A new order every epoch, drawn from ``(seed, epoch)``."""
        return self.sampling.shuffle

    @property
    def drop_last(self) -> bool:
        """The last, short batch (and the samples ranks cannot split evenly) left out."""
        return self.sampling.drop_last

    @property
    def seed(self) -> int:
        """The seed of the order, crops and augmentation draws (a state's after
        ``load_state_dict``)."""
        return self.sampling.seed

    @property
    def num_replicas(self) -> int:
        return self.sampling.num_replicas

    @property
    def rank(self) -> int:
        return self.sampling.rank

    @property
    def _nodes(self) -> NodeOrder | None:
        """A node-sharded store's order (``_nodes.holding`` reads it), else None."""
        return self.sampling.nodes

    @property
    def num_workers(self) -> int:
        """CPU decode processes (0: the main process decodes)."""
        return self.decode_options.num_workers

    @property
    def pin_memory(self) -> bool:
        return self.decode_options.pin_memory

    @property
    def timeout(self) -> float | None:
        return self.decode_options.timeout

    @property
    def multiprocessing_context(self) -> str | None:
        return self.decode_options.context

    @property
    def worker_init_fn(self) -> Callable[[int], None] | None:
        return self.decode_options.worker_init_fn

    @property
    def on_error(self) -> str:
        return self.decode_options.on_error

    def epoch_indices(self, epoch: int, start: int = 0) -> np.ndarray:
        """Store indices this rank visits in ``epoch`` from global position ``start``, in order
        (node shares: the whole epoch, ``start`` 0)."""
        return self.sampling.epoch_indices(epoch, start)

    # ------------------------------------------------------------------ DataLoader habits
    def __len__(self) -> int:
        """Batches of a full epoch on this rank."""
        return self.sampling.full_batches()

    def set_epoch(self, epoch: int) -> None:
        """The next ``iter()`` plays ``epoch`` from its start. Order and crops come from
        (seed, epoch); without set_epoch the epoch advances after every pass."""
        self._next_epoch, self._resume, self._pass = int(epoch), None, None

    @property
    def epoch(self) -> int:
        """The epoch of the pass under way, else the one the next ``iter()`` plays."""
        if self._resume is not None:
            return self._resume[0]
        return self._pass.epoch if self._pass is not None else self._next_epoch

    def state_dict(self) -> dict[str, Any]:
        """Where the epoch stands, independent of world size: the seed, the epoch and how many
        samples of the epoch's global order all ranks together have been handed, with
        fingerprints of the store and of ``indices=``/``weights=`` (see ``gpucache.loader._state``)."""
        segments: list[Segment] = []
        if self._resume is not None:
            epoch, position, segments = self._resume
        elif self._pass is not None:
            epoch, position = self._pass.epoch, self._pass.position
            if self._pass.prior is not None:
                segments = [*self._pass.prior, self.sampling.segment(self._pass.batches_done)]
        else:
            epoch, position = self._next_epoch, 0
        store, sampling = self._fingerprints
        nodes = {}
        if self._nodes is not None:  # each layout the epoch ran under, and what it consumed
            nodes = {"segments": [list(s) for s in segments if s.batches_done]}
            position = self._nodes.consumed_count(self.seed, epoch, self.shuffle, segments)
        return {
            "version": _state.VERSION,
            "seed": self.seed,
            "epoch": epoch,
            "position": position,
            "samples": self.sampling.global_size(),
            "shuffle": self.shuffle,
            "batch_size": self.batch_size,
            "num_replicas": self.num_replicas,
            "store": store,
            "sampling": sampling,
            **nodes,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The next ``iter()`` continues the saved epoch after its last batch handed out.

        Any world size and batch size: the rest of the epoch's global order is split among this
        loader's ``num_replicas`` ranks (every remaining sample once, apart from padding). A state
        of another store, subset, sample count or shuffle setting, or one with values out of range,
        is refused (``ValueError``/``TypeError``) and changes nothing."""
        store, sampling = self._fingerprints
        seed, epoch, position = _state.parse(
            state,
            samples=self.sampling.global_size(),
            shuffle=self.shuffle,
            store=store,
            sampling=sampling,
        )
        segments = [Segment(*s) for s in _state.segments(state, self._nodes is not None)]
        if self._nodes is not None:  # the few samples of other shares this node is handed
            held = _nodes.holding(self, seed, epoch, segments)
            if held is not None:
                self._stop_backend()  # its workers hold the store the bigger one replaces
                self.cache, nodes = held
                self.sampling = dataclasses.replace(self.sampling, nodes=nodes)
        if seed != self.seed:
            self._stop_backend()  # workers are seeded from the loader's seed: restart them with it
            self.sampling = dataclasses.replace(self.sampling, seed=seed)
            self.decode_options = dataclasses.replace(self.decode_options, seed=seed)
        self._resume, self._pass = (epoch, position, segments), None

    @functools.cached_property
    def _fingerprints(self) -> tuple[str, str]:
        """(store, sampling) fingerprints for the state: computed once, the same on every rank
        (node shares: of the whole listing, the same on every node and at any node count)."""
        if self._nodes is not None:
            return _nodes.fingerprint(self._nodes.share), "all"
        subset = _state.sampling_fingerprint(self.sampling.visits)
        return _state.store_fingerprint(self.cache), subset

    @property
    def tier(self) -> str:
        """Where batches come from: ``"decoded"`` (pixels decoded once, on the host),
        ``"device"`` (those pixels on the GPU) or ``"raw"`` (JPEGs decoded every batch)."""
        return self._tier.name

    @property
    def tier_reason(self) -> str | None:
        """Why the tier is not the one asked for (or where it is held instead), else None."""
        return self._tier.reason

    # ------------------------------------------------------------------ shutdown
    @property
    def worker_pids(self) -> list[int]:
        return self._backend.pids if self._backend is not None else []

    def close(self) -> None:
        """Stop workers and free the backend's resources. Idempotent. A closed loader cannot be
        iterated again (``RuntimeError``): make a new one."""
        self._closed = True
        self._stop_backend()

    def __enter__(self) -> GpuCachedLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"GpuCachedLoader({self.cache!r}, batch_size={self.batch_size}, "
            f"backend={self.backend_name!r}, device={str(self.device)!r}, "
            f"num_workers={self.num_workers})"
        )


def _check_workers(
    num_workers: int | None,
    prefetch_factor: int,
    persistent_workers: bool,
    context: str | None,
    timeout: float | None,
) -> None:
    """The worker arguments' checks (``persistent_workers=False`` warns: it has no effect)."""
    if num_workers is not None:
        _sampling.check_int(
            "num_workers", num_workers, 0, "use num_workers=0 to decode in the main process"
        )
    _sampling.check_int("prefetch_factor", prefetch_factor, 1, "use prefetch_factor=1 or more")
    if timeout is not None and timeout < 0:
        raise ValueError(
            "timeout option should be non-negative; use timeout=None to wait "
            "for as long as workers are alive."
        )
    if context not in (None, "fork", "spawn", "forkserver"):
        raise ValueError(
            "multiprocessing_context must be None, 'fork', 'spawn' or "
            f"'forkserver', got {context!r}."
        )
    if not persistent_workers:
        warnings.warn(
            "persistent_workers=False is ignored: GpuCachedLoader always keeps its "
            "workers for the next epoch (call close() to stop them).",
            stacklevel=3,
        )


def _pin_memory(pin_memory: bool | None, device: torch.device) -> bool:
    """Whether batches go to ``device`` through pinned memory: on CUDA unless turned off."""
    if pin_memory and device.type != "cuda":
        warnings.warn(
            "pin_memory=True has no effect without a CUDA device; ignoring it.", stacklevel=3
        )
    return device.type == "cuda" and pin_memory is not False


def _tier_of(
    cache: Store,
    request: _tier.TierRequest,
    device: torch.device,
    workers: int,
    context: str | None,
    num_replicas: int,
) -> _tier.Tier:
    """The decoded tier ``request`` asks for (or the raw one), for a loader on ``device`` with
    ``workers`` started by ``context``, one of ``num_replicas`` ranks: its pixels may live in
    this process's memory when its workers fork (or there are none, or batches end on CUDA) and
    it is its node's only rank."""
    return _tier.choose(
        cache,
        request,
        device=device,
        private_ok=device.type == "cuda"
        or workers == 0
        or mp.get_context(context).get_start_method() == "fork",
        several=num_replicas > 1 or _dist.local()[0] > 1,
    )


def _steps_in_backend(transform: Compose, backend_name: str, device: torch.device) -> int:
    """The first batch steps that act on each sample alone run in the cpu backend's workers (or
    its inline decode) when the batch ends on the CPU; the rest in the loop's process."""
    cpu_batches = backend_name == "cpu" and device.type == "cpu"
    return transform.per_sample_steps() if cpu_batches and transform.fixed_size else 0


def _mask_setup(
    cache: Store, masks: bool | None, mask_fill: int, fill: int, transform: Any
) -> torch.dtype | None:
    """The dtype of the masks the loader yields, or None when it yields labels; checks the
    masks arguments against the store and the transform."""
    if masks not in (None, True, False):
        raise ValueError(f"masks must be None, True or False, got {masks!r}.")
    if isinstance(fill, bool) or not isinstance(fill, int) or not 0 <= fill <= 255:
        raise ValueError(f"fill must be an integer in [0, 255] (a uint8 pixel), got {fill!r}.")
    if masks is True and cache.masks is None:
        raise ValueError(
            "masks=True, but this store has no masks; build it with masks= (for example "
            "JpegCache.from_folder(root, masks=MASK_ROOT)), or leave masks=None."
        )
    if masks is False or cache.masks is None:
        return None
    dtype = _masks.mask_dtype(cache.masks)
    _masks.check_fill(mask_fill, dtype)
    if transform.changes_labels:
        raise ValueError(
            "this transform has steps that mix samples and labels (MixUp/CutMix/WithLabels), "
            "which cannot move masks with them; leave them out for a store with masks, or "
            "pass masks=False to the loader to get labels."
        )
    return dtype
