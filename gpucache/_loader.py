"""GpuCachedLoader: order, sharding, epochs, prefetch and resume; drives a decode backend."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import numpy as np
import torch

from . import decode as _decode
from ._store import JpegCache
from ._workers import usable_cores
from .decode._base import Backend
from .decode.cpu import Decoded
from .transforms import Transform, as_compose

log = logging.getLogger("gpucache")


class BatchInfo(NamedTuple):
    """Per-sample details of a batch (``return_metadata=True``). Strings stay Python lists."""

    indices: torch.Tensor  # store indices, in batch order
    paths: list[str]
    metadata: list[str] | None
    skipped: list[tuple[int, str]]  # (store index, reason) of samples left out of this batch


@dataclass
class LoaderStats:
    """Running counts since the loader was made."""

    batches: int = 0
    samples: int = 0
    skipped: int = 0  # samples that failed to decode and were left out
    cpu_decoded: int = 0  # samples decoded on the CPU (all of them for backend="cpu")
    skipped_samples: list[tuple[int, str]] = field(default_factory=list)


class GpuCachedLoader:
    """A ``torch.utils.data.DataLoader`` replacement that decodes from a :class:`JpegCache`.

    Yields ``(images, labels)`` on ``device`` (``(images, labels, BatchInfo)`` with
    ``return_metadata=True``). ``transform=None`` yields a list of variable-size uint8 CHW tensors;
    a transform that fixes the output size yields one (N, C, H, W) batch.
    """

    def __init__(
        self,
        cache: JpegCache,
        *,
        batch_size: int,
        shuffle: bool = False,
        drop_last: bool = False,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        transform: Transform | Sequence[Transform] | None = None,
        # where and how to decode
        device: str | torch.device | None = None,
        backend: Literal["auto", "cpu", "nvjpeg", "dali"] = "auto",
        num_workers: int | None = None,
        prefetch_factor: int = 2,
        pin_memory: bool | None = None,
        worker_init_fn: Callable[[int], None] | None = None,
        persistent_workers: bool = True,
        multiprocessing_context: str | None = None,
        timeout: float | None = 300.0,
        hw_decoder_load: float = 0.65,
        # bad samples, metadata, sharding
        on_error: Literal["skip", "raise"] = "skip",
        return_metadata: bool = False,
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        if not isinstance(cache, JpegCache):
            raise TypeError(f"cache must be a gpucache.JpegCache, got {type(cache).__name__}; "
                            "build one with JpegCache.from_folder(root) or JpegCache.open(path).")
        _check_int("batch_size", batch_size, 1, "use batch_size=1 or more")
        if num_workers is not None:
            _check_int("num_workers", num_workers, 0,
                       "use num_workers=0 to decode in the main process")
        _check_int("prefetch_factor", prefetch_factor, 1, "use prefetch_factor=1 or more")
        _check_int("num_replicas", num_replicas, 1, "use num_replicas=world size (>= 1)")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank should be in [0, {num_replicas}), got {rank}.")
        if timeout is not None and timeout < 0:
            raise ValueError("timeout option should be non-negative; use timeout=None to wait "
                             "for as long as workers are alive.")
        if on_error not in ("skip", "raise"):
            raise ValueError(f"on_error must be 'skip' or 'raise', got {on_error!r}.")
        if multiprocessing_context not in (None, "fork", "spawn", "forkserver"):
            raise ValueError("multiprocessing_context must be None, 'fork', 'spawn' or "
                             f"'forkserver', got {multiprocessing_context!r}.")
        self.cache = cache
        self.batch_size, self.shuffle, self.drop_last = batch_size, shuffle, drop_last
        if seed is not None and generator is not None:
            raise ValueError("give seed or generator, not both; the generator's initial_seed() "
                             "is used as the seed.")
        if seed is None:
            seed = (generator.initial_seed() if generator is not None
                    else np.random.SeedSequence().entropy)
        self.seed = int(seed) % 2**63
        if not persistent_workers:
            warnings.warn("persistent_workers=False is ignored: GpuCachedLoader always keeps its "
                          "workers for the next epoch (call close() to stop them).", stacklevel=2)
        self.transform = as_compose(transform)
        self.device = _decode.resolve_device(device)
        self.backend_name = _decode.resolve(backend, self.device)
        self.num_workers = usable_cores() if num_workers is None else num_workers
        self.prefetch_factor = prefetch_factor
        if pin_memory and self.device.type != "cuda":
            warnings.warn("pin_memory=True has no effect without a CUDA device; ignoring it.",
                          stacklevel=2)
        self.pin_memory = self.device.type == "cuda" and pin_memory is not False
        self.worker_init_fn, self.multiprocessing_context = worker_init_fn, multiprocessing_context
        self.timeout = timeout or None
        self.hw_decoder_load = hw_decoder_load
        self.on_error, self.return_metadata = on_error, return_metadata
        self.num_replicas, self.rank = num_replicas, rank
        self.stats = LoaderStats()
        self._epoch, self._resume_at = 0, 0
        self._backend: Backend | None = None

    # ------------------------------------------------------------------ DataLoader habits
    def _num_samples(self) -> int:
        n, r = len(self.cache), self.num_replicas
        return n // r if self.drop_last and r > 1 else -(-n // r)

    def __len__(self) -> int:
        n = self._num_samples()
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Order and crops come from (seed, epoch); an epoch also advances after each full pass."""
        self._epoch, self._resume_at = int(epoch), 0

    @property
    def epoch(self) -> int:
        return self._epoch

    def state_dict(self) -> dict:
        return {"seed": self.seed, "epoch": self._epoch, "batches_done": self._resume_at,
                "batch_size": self.batch_size, "num_replicas": self.num_replicas,
                "samples": len(self.cache)}

    def load_state_dict(self, state: dict) -> None:
        """Resume: the next iteration continues the saved epoch after its last finished batch."""
        for key in ("batch_size", "num_replicas", "samples"):
            mine = self.state_dict()[key]
            if state[key] != mine:
                raise ValueError(f"state_dict was saved with {key}={state[key]}, this loader has "
                                 f"{mine}; resume with the same settings and store.")
        self.seed, self._epoch, self._resume_at = state["seed"], state["epoch"], \
            state["batches_done"]

    def epoch_indices(self, epoch: int) -> np.ndarray:
        """Store indices this rank visits in ``epoch``, in order (DistributedSampler's rule)."""
        n = len(self.cache)
        order = (np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle
                 else np.arange(n))
        total = self._num_samples() * self.num_replicas
        if total > n:  # pad by repeating, so every rank gets as many samples
            order = np.concatenate([order, order[: total - n]])
        return order[:total][self.rank::self.num_replicas]

    def plans(self, epoch: int, batch: int, indices: np.ndarray) -> np.ndarray:
        """The geometric plan of each sample of one batch (seeded by seed, epoch and batch)."""
        rng = np.random.default_rng([self.seed, epoch, batch])
        s = self.cache.samples
        return self.transform.plan(s["height"][indices].astype(np.int64),
                                   s["width"][indices].astype(np.int64), rng)

    # ------------------------------------------------------------------ iteration
    def _get_backend(self) -> Backend:
        if self._backend is None:
            self._backend = _make_backend(self)
        return self._backend

    def __iter__(self) -> Iterator:
        backend = self._get_backend()
        backend.drain()  # results of an epoch left early
        epoch, start = self._epoch, self._resume_at
        order = self.epoch_indices(epoch)
        bs = self.batch_size
        batches = [order[i:i + bs] for i in range(0, len(order), bs)]
        if self.drop_last and batches and len(batches[-1]) < bs:
            batches.pop()
        stack = self.transform.fixed_size
        ahead = (self.prefetch_factor * max(1, self.num_workers) if self.backend_name == "cpu"
                 else max(2, self.prefetch_factor))  # GPU backends: >= 2 batches in flight
        submitted = start
        for b in range(start, len(batches)):
            while submitted < len(batches) and submitted < b + ahead:
                idx = batches[submitted]
                backend.submit(idx, self.plans(epoch, submitted, idx), stack)
                submitted += 1
            try:
                out = backend.get()
            except BaseException:
                self.close()  # a failed backend is not reused; the next iteration starts afresh
                raise
            self._resume_at = b + 1
            yield self._finish(out)
        self._epoch, self._resume_at = epoch + 1, 0

    def _finish(self, out: Decoded):
        s = self.stats
        s.batches += 1
        s.samples += len(out.indices)
        s.cpu_decoded += out.cpu_decoded
        for index, reason in out.failed:
            s.skipped += 1
            s.skipped_samples.append((index, reason))
            warnings.warn(f"gpucache: skipped {reason}", RuntimeWarning, stacklevel=3)
        nb = self.pin_memory
        images = out.images
        if isinstance(images, torch.Tensor):
            images = images.to(self.device, non_blocking=nb)
        else:
            images = [im.to(self.device, non_blocking=nb) for im in images]
        images = self.transform(images)
        labels = torch.from_numpy(self.cache.labels[out.indices]).to(self.device,
                                                                    non_blocking=nb)
        if not self.return_metadata:
            return images, labels
        meta = self.cache.metadata
        info = BatchInfo(torch.from_numpy(out.indices), [self.cache.paths[i] for i in out.indices],
                         None if meta is None else [meta[i] for i in out.indices], out.failed)
        return images, labels, info

    # ------------------------------------------------------------------ shutdown
    @property
    def worker_pids(self) -> list[int]:
        return self._backend.pids if self._backend is not None else []

    def close(self) -> None:
        """Stop workers and free the backend's resources. Idempotent; iterating again restarts."""
        if self._backend is not None:
            self._backend.close()
            self._backend = None

    def __enter__(self) -> GpuCachedLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"GpuCachedLoader({self.cache!r}, batch_size={self.batch_size}, "
                f"backend={self.backend_name!r}, device={str(self.device)!r}, "
                f"num_workers={self.num_workers})")


def _check_int(name: str, value, low: int, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} option should be an integer >= {low}, got {value!r}; {fix}.")


def _make_backend(loader: GpuCachedLoader) -> Backend:
    name = loader.backend_name
    common = dict(seed=loader.seed, on_error=loader.on_error)
    if name == "cpu":
        from .decode.cpu_backend import CpuBackend

        return CpuBackend(loader.cache, num_workers=loader.num_workers,
                          context=loader.multiprocessing_context,
                          worker_init_fn=loader.worker_init_fn, timeout=loader.timeout,
                          pin_memory=loader.pin_memory, **common)
    if name == "nvjpeg":
        from .decode.nvjpeg import NvjpegBackend

        return NvjpegBackend(loader.cache, device=loader.device, on_error=loader.on_error)
    from .decode.dali import DaliBackend

    return DaliBackend(loader.cache, device=loader.device, batch_size=loader.batch_size,
                       num_threads=max(1, loader.num_workers), prefetch=max(2, loader.prefetch_factor),
                       hw_decoder_load=loader.hw_decoder_load, **common)
