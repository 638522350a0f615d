"""backend="dali": NVIDIA DALI decodes each batch and runs its geometric plans in one graph.

The graph (:mod:`._dali_graph`) decodes each whole image, applies the orientation the store
recorded (never DALI's own reading of EXIF), then the plan's crops, resize and flip. Normalization
and dtype stay with the loader's pixel transforms, the same for every backend.

The encoded bytes go in as zero-copy views of the store (``external_source(no_copy=True)``), kept
alive until that batch's outputs are back; the plan and the orientation go in as one int32 row
per sample (:func:`._dali_graph.rows`). Outputs
reach torch through DLPack and are copied out of DALI's buffers at once; on CUDA they are taken
bound to the stream that copy runs on (``pipe.outputs(cuda_stream=...)``, the current stream of the
backend's device, :func:`~gpucache.decode.gpu._streams.consumer_stream`), so DALI reuses a buffer only
after the copy is done, not merely after it was queued. Samples the GPU decoder
does not take (PNG, GIF, WebP, CMYK, arithmetic JPEG) are decoded on the CPU and joined back in;
samples over the pixel budget are refused before DALI or the CPU fallback sees them.

``device=cpu`` runs the same graph with DALI's CPU decoder (``device_id=None``), which is how CI
covers it; on CUDA only the decoder's device and the pipeline's ``device_id`` change.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

try:
    from nvidia.dali.tensors import TensorListCPU, TensorListGPU
except ImportError as err:  # pragma: no cover - depends on what is installed
    raise ImportError(
        "backend='dali' needs NVIDIA DALI: pip install nvidia-dali-cuda120 (a "
        "clone's extra: pip install -e '.[dali]'), or use backend='nvjpeg' or 'cpu'."
    ) from err

from ...store._store import Store
from .._base import Backend
from .._device import normalize_device
from .._masks import MaskOptions
from .._options import DEFAULTS, DecodeOptions
from .._outcome import ON_ERROR, Decoded, out_size
from . import _dali_graph
from ._fallback import Part, decode_on_cpu, join, out_of_memory, split, stage_times
from ._mask_stage import MaskStage, PendingMasks
from ._streams import consumer_stream

log = logging.getLogger(__name__)


class _Pipe(Protocol):
    """What this backend calls of the graph's DALI ``Pipeline`` (DALI leaves these methods
    unannotated)."""

    def build(self) -> None: ...

    def feed_input(self, data_node: str, data: list[np.ndarray] | np.ndarray) -> None: ...

    def schedule_run(self) -> None: ...

    def outputs(
        self, cuda_stream: torch.cuda.Stream | None = None
    ) -> tuple[TensorListCPU | TensorListGPU, ...]: ...


@dataclass
class _Batch:
    indices: np.ndarray
    plans: np.ndarray
    stack: bool
    gpu_pos: np.ndarray  # positions DALI decodes
    cpu_pos: np.ndarray  # positions the CPU path decodes
    refused: Part  # positions over the pixel budget: never fed to DALI nor to the CPU
    views: list[np.ndarray] | None = None  # fed to DALI (zero-copy) and not yet collected
    masks: PendingMasks | None = None  # the batch's masks, decoded on the mask threads


class DaliBackend(Backend):
    name = "dali"

    def __init__(
        self,
        cache: Store,
        *,
        device: torch.device,
        options: DecodeOptions = DEFAULTS,
        batch_size: int,
        num_threads: int,
        prefetch: int = 2,
        hw_decoder_load: float = 0.65,
    ):
        """``options``: the loader's decode options (``on_error``, ``seed``, ``fill`` where a
        plan pads, ``exact`` for the CPU fallback, the masks)."""
        device = torch.device(device)
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"backend='dali' runs on 'cpu' or 'cuda', got device={device}.")
        for name, value in (
            ("batch_size", batch_size),
            ("num_threads", num_threads),
            ("prefetch", prefetch),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} should be an integer >= 1, got {value!r}.")
        if options.on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {options.on_error!r}.")
        self.cache, self.options = cache, options
        self.on_error, self.seed = options.on_error, int(options.seed) % 2**31
        self.batch_size, self.num_threads, self.prefetch = batch_size, num_threads, prefetch
        self.hw_decoder_load = hw_decoder_load
        self.device = normalize_device(device)  # cuda -> cuda:<current>, as for every backend
        self._queue: deque[_Batch] = deque()
        self._pipe: _Pipe | None = None
        self._closed = False
        # masks are decoded on threads of their own from submit() on, never on the caller's
        # (the training loop's) thread, and placed on the device in get() without a host sync
        self._mask_pool: ThreadPoolExecutor | None = None
        self._mask_stage: MaskStage | None = None
        masks = MaskOptions.of(options)
        if masks is not None:
            self._mask_pool = ThreadPoolExecutor(num_threads, "gpucache-dali-masks")
            self._mask_stage = MaskStage(
                cache,
                fill=masks.fill,
                dtype=masks.dtype,
                device=self.device,
                pool=self._mask_pool,
                chunks=num_threads,
            )
        # garbage collection may run on a mask thread: stop them there without joining
        self._finalizer = weakref.finalize(self, _stop_pool, self._mask_pool, wait=False)

    # ------------------------------------------------------------------ the DALI graph
    def _graph_on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def _pipeline(self) -> _Pipe:
        if self._pipe is not None:
            return self._pipe
        gpu = self._graph_on_gpu()  # the only CUDA-specific lines of this backend
        pipe: _Pipe = _dali_graph.define(
            gpu=gpu,
            device_id=self.device.index if gpu else None,
            batch_size=self.batch_size,
            num_threads=self.num_threads,
            seed=self.seed,
            hw_decoder_load=self.hw_decoder_load,
            fill=self.options.fill,
        )
        pipe.build()
        self._pipe = pipe
        return pipe

    def _run(self, indices: np.ndarray, plans: np.ndarray) -> list[np.ndarray]:
        """Feed one batch and schedule it; returns the views DALI reads until it is collected."""
        pipe = self._pipeline()
        views = [self.cache[i] for i in indices.tolist()]
        s = self.cache.samples[indices]
        rows = _dali_graph.rows(plans, s["orientation"], s["height"], s["width"])
        try:
            pipe.feed_input("enc", views)
            pipe.feed_input("plan", rows)
            pipe.schedule_run()
        except BaseException:
            self._reset()  # a half-fed iteration would shift every later batch
            raise
        return views

    def _outputs(self) -> torch.Tensor | list[torch.Tensor]:
        """The oldest scheduled batch, copied out of DALI's buffers (raises RuntimeError).

        On CUDA the outputs are bound to the stream the ``clone()`` below is queued on, so DALI
        frees them in that stream's order (``exec_dynamic=True`` allows it)."""
        assert self._pipe is not None
        stream = consumer_stream(self.device)
        (out,) = self._pipe.outputs() if stream is None else self._pipe.outputs(cuda_stream=stream)
        if out.is_dense_tensor():
            return torch.from_dlpack(out.as_tensor()).clone()
        return [torch.from_dlpack(out[k]).clone() for k in range(len(out))]

    def _reset(self) -> None:
        """Drop the pipeline (it may be unusable after an error) and what was in flight on it."""
        self._pipe = None
        for b in self._queue:
            b.views = None

    def _pump(self) -> None:
        """Schedule queued batches in order, at most ``prefetch`` in flight."""
        in_flight = sum(b.views is not None for b in self._queue)
        for b in self._queue:
            if in_flight >= self.prefetch:
                break
            if b.views is None and len(b.gpu_pos):
                b.views = self._run(b.indices[b.gpu_pos], b.plans[b.gpu_pos])
                in_flight += 1

    # ------------------------------------------------------------------ Backend
    def submit(
        self, indices: np.ndarray, plans: np.ndarray, stack: bool, key: tuple[int, ...] = ()
    ) -> None:
        if self._closed:
            raise RuntimeError("this DaliBackend is closed; make a new one (or a new loader).")
        indices = np.asarray(indices, dtype=np.int64)
        if len(indices) > self.batch_size:
            raise ValueError(
                f"a batch of {len(indices)} samples is larger than the pipeline's "
                f"batch_size={self.batch_size}; pass the loader's batch size."
            )
        plans = np.asarray(plans)
        b = _Batch(indices, plans, stack, *split(self.cache, indices, on_error=self.on_error))
        if self._mask_stage is not None:
            b.masks = self._mask_stage.submit(indices, plans, stack)
        self._queue.append(b)
        self._pump()

    def get(self) -> Decoded:
        if not self._queue:
            raise RuntimeError("get() called with no batch submitted.")
        b = self._queue[0]
        parts: list[Part] = [b.refused]
        took: dict[str, float] = {}  # DALI decodes and resizes in one pipeline: its wait is
        t0 = time.perf_counter()  # the "full" decode route's time
        try:
            if len(b.gpu_pos):
                if b.views is None:  # not in flight (after a reset): run it now
                    self._pump()
                try:
                    parts.append((b.gpu_pos, self._outputs(), False))
                except (MemoryError, torch.OutOfMemoryError) as err:
                    raise self._oom(err, len(b.gpu_pos)) from err
                except RuntimeError as err:  # DALI fails the whole batch: find the bad sample(s)
                    if "out of memory" in str(err) or "allocation failed" in str(err):
                        raise self._oom(err, len(b.gpu_pos)) from err
                    self._queue.popleft()
                    self._reset()
                    parts += self._isolate(b, err)
                else:
                    self._queue.popleft()
            else:
                self._queue.popleft()
            b.views = None
            t1 = time.perf_counter()
            took["full"] = t1 - t0
            self._pump()  # keep DALI busy while the CPU path below runs
            if len(b.cpu_pos):
                parts.append(
                    (
                        b.cpu_pos,
                        decode_on_cpu(self.cache, b.indices, b.plans, b.cpu_pos, self.options),
                        True,
                    )
                )
            took["fallback"] = time.perf_counter() - t1
        except BaseException:
            if self._queue and self._queue[0] is b:
                self._queue.popleft()
            if b.masks is not None:
                b.masks.cancel()
            self._reset()  # b's output may still be queued in DALI: drop it to keep the order
            raise
        t2 = time.perf_counter()
        out = join(
            len(b.indices),
            parts,
            indices=b.indices,
            stack=b.stack,
            device=self.device,
            out_hw=out_size(b.plans),
        )
        if b.masks is not None:
            assert self._mask_stage is not None
            out.masks = self._mask_stage.place(b.masks, b.plans, out.indices)
        took["collate"] = time.perf_counter() - t2
        out.times = stage_times(took)
        out.routes = {"full": len(b.gpu_pos), "fallback": len(b.cpu_pos)}
        out.busy = sum(took.values())
        return out

    def _oom(self, err: BaseException, n: int) -> torch.OutOfMemoryError:
        return out_of_memory(
            err,
            f"the DALI backend decoding a batch of {n} samples",
            self.device,
            f"lower batch_size, hw_decoder_load (now "
            f"{self.hw_decoder_load}) or prefetch_factor (now {self.prefetch} "
            "batches in flight), or free memory held elsewhere",
        )

    def _isolate(self, b: _Batch, err: RuntimeError) -> list[Part]:
        """Run a failed batch's DALI samples one at a time; what DALI rejects tries the CPU."""
        reason = str(err).split("encountered:")[-1].strip().splitlines()[0] if str(err) else ""
        log.warning(
            "gpucache: DALI failed a batch of %d samples (%s); decoding them one at a "
            "time to find the bad one(s)",
            len(b.gpu_pos),
            reason,
        )
        good: list[torch.Tensor] = []
        good_pos, rejected = [], []
        for p in b.gpu_pos.tolist():
            views = self._run(b.indices[p : p + 1], b.plans[p : p + 1])
            try:
                good.append(self._outputs()[0])
                good_pos.append(p)
            except RuntimeError:
                self._reset()
                rejected.append(p)
            del views  # DALI read them in place until now
        parts: list[Part] = [(np.asarray(good_pos, dtype=np.int64), good, False)]
        if rejected:  # libjpeg-turbo gets the last word: decoded there, or reported as failed
            results = decode_on_cpu(self.cache, b.indices, b.plans, rejected, self.options)
            for p, r in zip(rejected, results):
                if isinstance(r, torch.Tensor):
                    log.warning(
                        "gpucache: DALI could not decode sample %d (%s); decoded it on the CPU",
                        int(b.indices[p]),
                        self.cache.paths[int(b.indices[p])],
                    )
            parts.append((np.asarray(rejected, dtype=np.int64), results, True))
        return parts

    def __len__(self) -> int:
        return len(self._queue)

    def drain(self) -> None:
        """Drop queued batches; what DALI has in flight is collected and thrown away."""
        try:
            for b in self._queue:
                if b.views is not None and self._pipe is not None:  # in flight on it
                    (_,) = self._pipe.outputs()
        except RuntimeError:
            self._reset()
        for b in self._queue:
            if b.masks is not None:
                b.masks.cancel()
        self._queue.clear()

    def close(self) -> None:
        """Free the DALI pipeline and its buffers, stop the mask threads. Idempotent."""
        self._queue.clear()
        self._pipe = None
        self._closed = True
        self._finalizer.detach()
        _stop_pool(self._mask_pool, wait=True)


def _stop_pool(pool: ThreadPoolExecutor | None, *, wait: bool) -> None:
    if pool is not None:
        pool.shutdown(wait=wait, cancel_futures=True)
