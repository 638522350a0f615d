"""GpuCachedLoader: order, sharding, epochs, prefetch and resume; drives a decode backend."""

from __future__ import annotations

import functools
import logging
import multiprocessing as mp
import os
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, NamedTuple

import numpy as np
import torch

from .. import decode as _decode
from ..base import _dist
from ..decode import _masks
from ..decode._base import GPU_IN_FLIGHT, Backend
from ..decode._core import TIMED, Decoded, MaskOptions, stage_clock
from ..decode._core import stage_range as _range
from ..decode._options import DecodeOptions
from ..decode._workers import default_workers
from ..store._store import Store
from ..store._targets import dense_targets, kept_rows, ragged_targets
from ..transforms._compose import as_compose
from ..transforms._device import to_device
from ..transforms._generator import batch_generator
from ..transforms._steps import apply_mask_steps, apply_steps
from ..transforms._transform import Transform
from . import _nodes, _state, _tier
from ._nodes import NodeOrder, RankPlan, Segment
from ._sampling import Sampling
from ._stats import LoaderStats

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


class GpuCachedLoader:
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
        num_samples: Samples an epoch with ``weights`` (default: the subset's size).
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
        _check_int("batch_size", batch_size, 1, "use batch_size=1 or more")
        if num_workers is not None:
            _check_int(
                "num_workers", num_workers, 0, "use num_workers=0 to decode in the main process"
            )
        _check_int("prefetch_factor", prefetch_factor, 1, "use prefetch_factor=1 or more")
        num_replicas, rank = _dist.sharding(num_replicas, rank)
        _check_int("num_replicas", num_replicas, 1, "use num_replicas=world size (>= 1)")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_replicas:
            raise ValueError(f"rank should be in [0, {num_replicas}), got {rank!r}.")
        if timeout is not None and timeout < 0:
            raise ValueError(
                "timeout option should be non-negative; use timeout=None to wait "
                "for as long as workers are alive."
            )
        if on_error not in ("skip", "raise", "skip_warned"):
            raise ValueError(
                f"on_error must be 'skip', 'raise' or 'skip_warned', got {on_error!r}."
            )
        if multiprocessing_context not in (None, "fork", "spawn", "forkserver"):
            raise ValueError(
                "multiprocessing_context must be None, 'fork', 'spawn' or "
                f"'forkserver', got {multiprocessing_context!r}."
            )
        self.cache = cache
        self.sampling = Sampling(
            len(cache), indices=indices, weights=weights, num_samples=num_samples
        )
        self._nodes = _node_order(cache, self.sampling, num_replicas, rank)
        self.batch_size, self.shuffle, self.drop_last = batch_size, shuffle, drop_last
        if seed is not None and generator is not None:
            raise ValueError(
                "give seed or generator, not both; the generator's initial_seed() "
                "is used as the seed."
            )
        if seed is None:  # a fresh seed, the same on every rank (or a clear error)
            seed = (
                generator.initial_seed()
                if generator is not None
                else _dist.agreed_seed(num_replicas, shuffle)
            )
        self.seed = int(seed) % 2**63
        if not persistent_workers:
            warnings.warn(
                "persistent_workers=False is ignored: GpuCachedLoader always keeps its "
                "workers for the next epoch (call close() to stop them).",
                stacklevel=2,
            )
        self.transform = as_compose(transform)
        self._masks_dtype = _mask_setup(cache, masks, mask_fill, fill, self.transform)
        self.mask_fill, self.fill = mask_fill, fill
        self.device = _decode._resolve_device(device)  # normalised: cuda -> cuda:<current>
        self.backend_name = _decode.resolve(backend, self.device)
        self.num_workers = default_workers() if num_workers is None else num_workers
        self.prefetch_factor = prefetch_factor
        if pin_memory and self.device.type != "cuda":
            warnings.warn(
                "pin_memory=True has no effect without a CUDA device; ignoring it.", stacklevel=2
            )
        self.pin_memory = self.device.type == "cuda" and pin_memory is not False
        self.worker_init_fn, self.multiprocessing_context = worker_init_fn, multiprocessing_context
        self.timeout = timeout or None
        self.hw_decoder_load = hw_decoder_load
        self.on_error, self.return_metadata = on_error, return_metadata
        self.exact = bool(exact)  # False: CPU decode may use DCT scaling (docs/guides/backends.md)
        self.num_replicas, self.rank = num_replicas, rank
        self._tier = _tier.choose(
            cache,
            _tier.request(
                decoded=decoded,
                decoded_side=decoded_side,
                decoded_budget=decoded_budget,
                device_budget=device_budget,
                cache_dir=cache_dir,
            ),
            device=self.device,
            private_ok=self.device.type == "cuda"
            or self.num_workers == 0
            or mp.get_context(multiprocessing_context).get_start_method() == "fork",
            several=num_replicas > 1 or _dist.local()[0] > 1,
        )
        if self._tier.pixels is not None:  # cut from pixels: on the CPU, or on the device
            self.backend_name = "cpu" if self.device.type == "cpu" else "pixels"
        # the first batch steps that act on each sample alone run in the cpu backend's workers
        # (or its inline decode) when the batch ends on the CPU; the rest here, after them
        cpu_batches = self.backend_name == "cpu" and self.device.type == "cpu"
        self._steps_in_backend = (
            self.transform.per_sample_steps() if cpu_batches and self.transform.fixed_size else 0
        )
        self.stats = LoaderStats(
            workers=max(1, self.num_workers) if self.backend_name == "cpu" else 1,
            backend=self.backend_name,
        )
        self.stats.tier = self._tier.describe()
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

    # ------------------------------------------------------------------ order and sharding
    def _global_size(self) -> int:
        """Samples in one epoch's global order (before sharding; node shares: every node's)."""
        return self.sampling.size if self._nodes is None else self._nodes.total

    def _global_order(self, epoch: int) -> np.ndarray:
        """The epoch's order over all ranks, as store indices, before sharding.

        Everything else (sharding, resume, batches) works on positions in this array, so a subset
        or a weighted draw only has to change this function and ``_global_size``."""
        return self.sampling.order(self.seed, epoch, self.shuffle)

    def _shard(self, order: np.ndarray, start: int, replicas: int, rank: int) -> np.ndarray:
        """``rank``'s share of ``order[start:]``: DistributedSampler's rule (pad to a multiple of
        ``replicas`` by repeating the rest from its start, or drop the tail with ``drop_last``),
        then every ``replicas``-th slot. Global slot j of the rest goes to rank j % replicas.
        Padding repeats samples of the rest only, so a resumed epoch never shows a consumed one."""
        rest = order[start:]
        if self.drop_last:
            rest = rest[: len(rest) // replicas * replicas]
        elif len(rest) % replicas:
            rest = np.concatenate([rest, np.resize(rest, replicas - len(rest) % replicas)])
        return rest[rank::replicas]

    def _batches(self, mine: np.ndarray) -> list[np.ndarray]:
        bs = self.batch_size
        batches = [mine[i : i + bs] for i in range(0, len(mine), bs)]
        if self.drop_last and batches and len(batches[-1]) < bs:
            batches.pop()
        return batches

    def epoch_indices(self, epoch: int, start: int = 0) -> np.ndarray:
        """Store indices this rank visits in ``epoch`` from global position ``start``, in order
        (node shares: the whole epoch, ``start`` 0)."""
        if self._nodes is not None:
            return self._node_plan(epoch, []).indices
        return self._shard(self._global_order(epoch), start, self.num_replicas, self.rank)

    def _node_plan(self, epoch: int, prior: list[Segment]) -> RankPlan:
        assert self._nodes is not None
        return self._nodes.plan(
            self.seed, epoch, self.shuffle, prior, self.batch_size, self.drop_last
        )

    # ------------------------------------------------------------------ DataLoader habits
    def __len__(self) -> int:
        """Batches of a full epoch on this rank."""
        if self._nodes is not None:
            return self._nodes.full_batches(self.batch_size, self.drop_last)
        n, r, bs = self._global_size(), self.num_replicas, self.batch_size
        mine = n // r if self.drop_last else -(-n // r)
        return mine // bs if self.drop_last else -(-mine // bs)

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
                segments = [*self._pass.prior, self._segment(self._pass.batches_done)]
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
            "samples": self._global_size(),
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
            state, samples=self._global_size(), shuffle=self.shuffle, store=store, sampling=sampling
        )
        segments = [Segment(*s) for s in _state.segments(state, self._nodes is not None)]
        if self._nodes is not None:  # the few samples of other shares this node is handed
            held = _nodes.holding(self, seed, epoch, segments)
            if held is not None:
                self._stop_backend()  # its workers hold the store the bigger one replaces
                self.cache, self._nodes = held
        if seed != self.seed:
            self._stop_backend()  # workers are seeded from the loader's seed: restart them with it
            self.seed = seed
        self._resume, self._pass = (epoch, position, segments), None

    @functools.cached_property
    def _fingerprints(self) -> tuple[str, str]:
        """(store, sampling) fingerprints for the state: computed once, the same on every rank
        (node shares: of the whole listing, the same on every node and at any node count)."""
        if self._nodes is not None:
            return _nodes.fingerprint(self._nodes.share), "all"
        return _state.store_fingerprint(self.cache), _state.sampling_fingerprint(self.sampling)

    def _segment(self, batches_done: int) -> Segment:
        assert self._nodes is not None
        return Segment(self._nodes.nodes, self._nodes.per_node, self.batch_size, batches_done)

    def _key(self, epoch: int, batch: int) -> tuple[int, ...]:
        """What seeds one batch's plans and batch steps: (seed, epoch, batch[, rank])."""
        return (self.seed, epoch, batch) + ((self.rank,) if self.num_replicas > 1 else ())

    def plans(self, epoch: int, batch: int, indices: np.ndarray) -> np.ndarray:
        """The geometric plan of each sample of one batch (seeded by seed, epoch, batch, rank)."""
        rng = np.random.default_rng(list(self._key(epoch, batch)))
        if self._tier.heights is not None and self._tier.widths is not None:  # the tier's sizes
            return self.transform.plan(self._tier.heights[indices], self._tier.widths[indices], rng)
        s = self.cache.samples
        return self.transform.plan(
            s["height"][indices].astype(np.int64), s["width"][indices].astype(np.int64), rng
        )

    @property
    def tier(self) -> str:
        """Where batches come from: ``"decoded"`` (pixels decoded once, on the host),
        ``"device"`` (those pixels on the GPU) or ``"raw"`` (JPEGs decoded every batch)."""
        return self._tier.name

    @property
    def tier_reason(self) -> str | None:
        """Why the tier is not the one asked for (or where it is held instead), else None."""
        return self._tier.reason

    # ------------------------------------------------------------------ iteration
    @property
    def decode_options(self) -> DecodeOptions:
        """The decode options the backend gets (built anew: ``load_state_dict`` may change the
        seed, and backends are made again after it)."""
        return DecodeOptions(
            on_error=self.on_error,
            exact=self.exact,
            seed=self.seed,
            num_workers=self.num_workers,
            context=self.multiprocessing_context,
            worker_init_fn=self.worker_init_fn,
            timeout=self.timeout,
            pin_memory=self.pin_memory,
            steps=tuple(t for _, t in self.transform.steps[: self._steps_in_backend]),
            masks=self._masks_dtype is not None,
            mask_fill=self.mask_fill,
            mask_dtype=str(self._masks_dtype or torch.uint8).removeprefix("torch."),
            fill=self.fill,
            pixels=self._tier.pixels,
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
        bs, replicas = self.batch_size, self.num_replicas
        if self._nodes is not None:  # this node's share: the rest of its epoch after `prior`
            rank_plan = self._node_plan(epoch, segments)
            batches = self._batches(rank_plan.indices)
            first = sum(s.batches_done for s in segments)
            self.epoch_padding, self.epoch_dropped = rank_plan.padded, rank_plan.dropped
        else:
            batches = self._batches(self.epoch_indices(epoch, start))
            first = start // (bs * replicas)  # batch number of the first batch, for the plans
            prior = None
        self._passes += 1
        me = self._passes
        self._resume, self._next_epoch = None, epoch + 1
        self._pass = pos = _Pass(epoch, start, replicas, bs, self._global_size(), prior)
        stack = self.transform.fixed_size
        ahead = (
            self.prefetch_factor * max(1, self.num_workers)
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
                        idx, in_flight[-1][1], stack, self._key(epoch, first + submitted)
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
        generator = batch_generator(*self._key(epoch, batch))
        if out.rng_state is not None:  # the backend ran the first steps: the rest go on from there
            generator.set_state(torch.frombuffer(bytearray(out.rng_state), dtype=torch.uint8))
        rest = self.transform.steps[self._steps_in_backend :]
        kept = plans[kept_rows(submitted, out.indices)]
        masks = None
        if self._masks_dtype is not None:
            with _range("gpucache.masks", profiled):
                masks = self._batch_masks(out)
        if self.fill and self.backend_name != "cpu":  # the GPU backends pad with zeros
            images = _masks.fill_padding(images, kept, self.fill)
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
            _tier.store_plans(self._tier, out.indices, kept, self.cache),
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
        return to_device(x, self.device) if self.pin_memory else x.to(self.device)

    # ------------------------------------------------------------------ shutdown
    @property
    def worker_pids(self) -> list[int]:
        return self._backend.pids if self._backend is not None else []

    def close(self) -> None:
        """Stop workers and free the backend's resources. Idempotent. A closed loader cannot be
        iterated again (``RuntimeError``): make a new one."""
        self._closed = True
        self._stop_backend()

    def _stop_backend(self) -> None:
        if self._backend is not None:
            self._backend.close()
            self._backend = None

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


def _node_order(cache: Store, sampling: Sampling, num_replicas: int, rank: int) -> NodeOrder | None:
    """The node order of a node-sharded store (None for a whole one), checked against the job."""
    share = cache.node_share
    if share is None:
        return None
    if sampling.indices is not None or sampling.weights is not None:
        raise ValueError(
            "indices= and weights= take store indices of a whole data set; this store holds "
            "one node's share (shard='node'), whose indices differ from node to node. Build "
            "the subset as its own store, or use shard=None."
        )
    order = NodeOrder(share, num_replicas=num_replicas, rank=rank)
    _nodes.check_job(share, num_replicas, rank)
    return order


def _check_int(name: str, value: object, low: int, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} option should be an integer >= {low}, got {value!r}; {fix}.")


def _make_backend(loader: GpuCachedLoader) -> Backend:
    name = loader.backend_name
    if name == "pixels":  # the decoded tier on a CUDA device
        from ..decode._pixels import PixelBackend

        assert loader._tier.pixels is not None
        return PixelBackend(
            loader.cache,
            loader._tier.pixels,
            device=loader.device,
            resident=loader._tier.name == "device",
            options=loader.decode_options,
        )
    if name == "cpu":
        from ..decode._cpu import CpuBackend

        return CpuBackend(loader.cache, loader.decode_options)
    if name == "nvjpeg":
        from ..decode._nvjpeg import NvjpegBackend

        return NvjpegBackend(
            loader.cache,
            device=loader.device,
            on_error=loader.on_error,
            masks=MaskOptions.of(loader.decode_options),
        )
    from ..decode._dali import DaliBackend

    return DaliBackend(
        loader.cache,
        device=loader.device,
        batch_size=loader.batch_size,
        num_threads=max(1, loader.num_workers),
        prefetch=max(2, loader.prefetch_factor),
        hw_decoder_load=loader.hw_decoder_load,
        seed=loader.seed,
        on_error=loader.on_error,
        masks=MaskOptions.of(loader.decode_options),
    )
