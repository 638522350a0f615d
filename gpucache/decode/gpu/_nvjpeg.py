"""backend="nvjpeg": batched nvJPEG decode and batched transforms in a pipeline of threads.

Each submitted batch goes through three stages, each on its own thread (``threaded=False`` runs
them in ``submit`` instead), so batch k+1 decodes while batch k is transformed and the training
step consumes batch k-1; the loader keeps at least three batches in flight
(:data:`gpucache.decode._base.GPU_IN_FLIGHT`):

1. **CPU** (a pool of threads, the rank's cores less two: :func:`default_cpu_threads`): samples the batched decoder does not take (PNG, GIF, WebP,
   CMYK, arithmetic JPEG) and progressive JPEGs (whose Huffman decoding nvJPEG would run on the
   host, one image at a time, inside the batched call) are decoded and planned on the CPU
   (:func:`~gpucache.decode.gpu._fallback.decode_on_cpu`, region decode included), ahead of and
   beside the GPU work, a batch's samples split among the threads; the pixel budget refuses
   oversized samples before any decoder sees them;
2. **decode** (``decoders`` concurrent calls: :meth:`NvjpegBackend._decode_threads`): batched
   ``decode_jpeg(list, device=...)`` calls (:mod:`._batched`: TorchCodec's when installed, else
   torchvision's) read zero-copy views of the store. TorchCodec gives each concurrent call a
   decoder of its own, so a batch is cut into ``decoders`` sub-batches of about equal pixels
   (:func:`._batched.sub_batches`), decoded at once on as many threads, each under its own
   allocation stream (:mod:`._streams`): one call's host work (headers, allocation,
   synchronisations) overlaps another's decoding. torchvision keeps one global decoder behind a
   mutex, so it gets one call a batch on one thread. If a call fails (one corrupt JPEG fails it
   all) its sub-batch is decoded one sample at a time, and what the decoder still rejects goes
   to the CPU; running out of device memory is never a bad sample (:mod:`._faults`):
   nvJPEG's own allocator failing (status 5) synchronises the device (the failed call's work
   may still be queued), empties torch's caching allocator and retries the call once, then,
   like any out of memory, raises ``torch.OutOfMemoryError`` with advice;
3. **transform** (one thread, the side stream; autocast off, so an autocast region around a
   synchronous ``submit`` leaves the pixels alone): the batch's plans run in a few chunks of a
   constant number of ops each, in at most 256 MiB of the device
   (:func:`gpucache.transforms._resample.resample`, EXIF orientation folded in) — per image
   only for a variable-size batch; the CPU stage's results cross in one pinned ``non_blocking``
   copy and join in batch order (:func:`~gpucache.decode.gpu._fallback.join`); an event marks the
   batch done.

:meth:`get` makes the consumer's stream wait on that event and ``record_stream``\\s the outputs:
no host synchronisation on the training stream.

There is no pinned staging copy of the compressed bytes: nvJPEG (torchvision, TorchCodec) reads
them through host pointers and copies them with its own pinned buffers. On a CPU device the very
same code runs with no streams: that is how CI covers everything but
:class:`~gpucache.decode.gpu._streams.CudaStreams`.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np
import torch

from ...ingest._sniff import Kind
from ...store._store import Store
from .._apply import no_autocast
from .._base import Backend
from .._device import normalize_device
from .._masks import MaskOptions
from .._options import DEFAULTS, DecodeOptions
from .._outcome import ON_ERROR, Decoded, out_size
from ..cpu._procs import default_workers
from ._batched import BatchDecoder, applies_exif, default_decoder, sub_batches
from ._calls import DecoderCalls
from ._decoded_plans import DecodedPlans
from ._fallback import Result, decode_on_cpu, join, split, stage_times
from ._faults import raise_if_broken
from ._jobs import Batch, Chunk, Done, Job, Outputs, stage_result, stop_pools
from ._mask_stage import MaskStage, PendingMasks
from ._streams import CudaStreams, HostStreams

log = logging.getLogger(__name__)


def default_cpu_threads() -> int:
    """Threads of the CPU stage (libjpeg-turbo and PIL release the GIL): this rank's part of the
    cores (:func:`..cpu._procs.default_workers`) less two, for the training loop's thread and the
    decode and transform stages, and at least 2. A progressive JPEG costs about 8 ms there."""
    return max(2, default_workers() - 2)


class NvjpegBackend(Backend):
    name = "nvjpeg"

    def __init__(
        self,
        cache: Store,
        *,
        device: torch.device,
        options: DecodeOptions = DEFAULTS,
        decoder: BatchDecoder | None = None,
        threaded: bool = True,
        cpu_threads: int | None = None,
        decode_threads: int | None = None,
    ):
        """``options``: the loader's decode options (``on_error``, ``fill`` where a plan pads,
        ``exact`` for the CPU stage's decodes, the masks)."""
        device = normalize_device(device)
        if options.on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {options.on_error!r}.")
        self.cache, self.device, self.options = cache, device, options
        self.on_error = options.on_error
        self.decoder = decoder if decoder is not None else default_decoder(device)
        if normalize_device(self.decoder.device) != device:
            raise ValueError(
                f"decoder {self.decoder.name!r} decodes to {self.decoder.device}, "
                f"but the backend's device is {device}; make it for {device}."
            )
        self._streams = CudaStreams(device) if device.type == "cuda" else HostStreams(device)
        self._calls = DecoderCalls(self.decoder, self._streams, device)
        self.applies_exif = (
            self.decoder.applies_exif
            if self.decoder.applies_exif is not None
            else self.measure_applies_exif()
        )
        kinds = cache.samples["kind"]
        # progressive JPEGs go to the CPU stage: nvJPEG Huffman-decodes them on the host anyway
        self._gpu_mask: np.ndarray = cache.gpu_decodable() & (kinds != Kind.JPEG_PROGRESSIVE)
        # the transform stage's plans, its work buffer within the stage's fixed budget
        self._plans = DecodedPlans(
            cache, options, applies_exif=self.applies_exif, decoder_name=self.decoder.name
        )
        self._pending: list[Job] = []
        self._pools: dict[str, ThreadPoolExecutor] = {}
        #: threads of the CPU stage, among which a batch's CPU samples are split
        self.cpu_threads = max(1, default_cpu_threads() if cpu_threads is None else cpu_threads)
        #: concurrent decoder calls a batch is split among (threaded only; one unthreaded)
        decoders = self._decode_threads(decode_threads)  # checked whether threaded or not
        self.decoders = decoders if threaded else 1
        if threaded:
            self._pools = {
                "cpu": ThreadPoolExecutor(self.cpu_threads, "gpucache-nvjpeg-cpu"),
                # one thread decodes each batch itself; with several decoders two threads hand
                # out the sub-batches (the next batch's queue behind the current one's)
                "decode": ThreadPoolExecutor(
                    1 if self.decoders == 1 else 2, "gpucache-nvjpeg-decode"
                ),
                "transform": ThreadPoolExecutor(1, "gpucache-nvjpeg-transform"),
            }
            if self.decoders > 1:
                self._pools["decoders"] = ThreadPoolExecutor(
                    self.decoders, "gpucache-nvjpeg-decoder"
                )
        #: the batch's masks, split among the CPU stage's threads (inline when unthreaded)
        masks = MaskOptions.of(options)
        self._mask_stage = (
            None
            if masks is None
            else MaskStage(
                cache,
                fill=masks.fill,
                dtype=masks.dtype,
                device=device,
                pool=self._pools.get("cpu"),
                chunks=self.cpu_threads if self._pools else 1,
            )
        )
        self._closed = False
        self._threads: list[threading.Thread] = []  # the stages' threads, once they ran
        # garbage collection may happen on a pool's own thread: stop them without joining there
        self._finalizer = weakref.finalize(self, stop_pools, list(self._pools.values()), wait=False)

    def _decode_threads(self, given: int | None) -> int:
        """Concurrent decoder calls a batch is split among (``decode_threads``, else the
        decoder's default): TorchCodec keeps a pool of decoders a device and gives each
        concurrent call its own (no global lock), so two calls keep the GPU's decoders busy
        while one waits on the host (how many pay best on a GPU is what the device check's
        ``decoders`` part measures, at 1, 2 and 4); torchvision's decoder is one global
        instance behind a mutex (a second call would only queue on it), so one."""
        if given is not None:
            if given < 1:
                raise ValueError(f"decode_threads should be >= 1, got {given}.")
            return given
        return 2 if self.decoder.name == "torchcodec" else 1

    def measure_applies_exif(self) -> bool:
        """Whether the decoder applies EXIF orientation, by decoding a tagged probe image under
        the backend's own streams (never on the caller's current stream). Out of memory there
        is ``torch.OutOfMemoryError`` too, after the same one retry as a batch's."""
        with self._streams.on_side():
            with self._streams.decoding():
                what = "probing whether it applies EXIF orientation (one 16 x 8 image)"
                try:
                    return applies_exif(
                        lambda data: self._calls.batch(data, what), adopt=self._streams.adopt
                    )
                except torch.OutOfMemoryError:
                    raise
                except Exception as err:
                    raise_if_broken(err, self.decoder.name, self.device)
                    raise

    # ------------------------------------------------------------------ the three stages
    def _note_thread(self) -> None:
        if self._pools and threading.current_thread() not in self._threads:
            self._threads.append(threading.current_thread())

    def _cpu_stage(
        self, indices: np.ndarray, plans: np.ndarray, positions: np.ndarray
    ) -> tuple[list[Result], float]:
        """One chunk of the batch's CPU samples: their results and the seconds it took."""
        self._note_thread()
        t0 = time.perf_counter()
        out = decode_on_cpu(self.cache, indices, plans, positions, self.options)
        return out, time.perf_counter() - t0

    def _decode_stage(
        self, indices: np.ndarray, positions: np.ndarray, took: dict[str, float]
    ) -> Outputs:
        """Batched decode of ``indices[positions]``: the outputs (or why each failed), in
        order, and what marks them written: the event of the one call (None off CUDA), or
        with several decoders a list of them, one a sub-batch. With ``decoders`` > 1 the
        positions are cut into that many sub-batches (:func:`._batched.sub_batches`), each
        decoded by its own call on a thread of the decoders' pool, at once; this thread waits
        for all of them (an error is raised once every call ended). ``took`` gets the host time
        of the reads and of the calls, from the first start to the last end (on CUDA the
        kernels run on after it returns)."""
        self._note_thread()
        if not len(positions):
            return [], None
        pool = self._pools.get("decoders")
        if pool is None:
            images, ready, (t0, t1, t2) = self._decode_part(indices, positions)
            took["read"], took["full"] = t1 - t0, t2 - t1
            return images, ready
        s = self.cache.samples
        rows = indices[positions]
        pixels = s["height"][rows].astype(np.int64) * s["width"][rows]
        futures = [
            pool.submit(self._decode_part, indices, positions[part])
            for part in sub_batches(pixels, self.decoders)
        ]
        wait(futures)
        parts = [f.result() for f in futures]  # the first error, in batch order
        times = np.array([t for _, _, t in parts])  # (start, read, end) a call
        took["read"] = float((times[:, 1] - times[:, 0]).max())
        took["full"] = float(times[:, 2].max() - times[:, 1].min())
        images = [x for part_images, _, _ in parts for x in part_images]
        return images, [ready for _, ready, _ in parts if ready is not None]

    def _decode_part(
        self, indices: np.ndarray, positions: np.ndarray
    ) -> tuple[list[torch.Tensor | Exception], torch.cuda.Event | None, tuple[float, float, float]]:
        """One decoder call on ``indices[positions]`` under this thread's allocation stream:
        the outputs (or why each failed), the event that marks them written (None off CUDA),
        and the times it started, read the store's views and returned."""
        self._note_thread()
        t0 = time.perf_counter()
        data = [self.cache._bytes_tensor(int(i)) for i in indices[positions].tolist()]
        t1 = time.perf_counter()
        with self._streams.on_side(), self._streams.decoding() as decoding:
            images = self._calls.each(data)
        return images, decoding.ready, (t0, t1, time.perf_counter())

    def _transform_stage(
        self,
        batch: Batch,
        gpu: Future[Outputs] | Outputs,
        cpu: list[Future[Chunk]] | list[Chunk],
        masks: PendingMasks | None = None,
    ) -> Done:
        """The batch's plans on the decoded images, joined with the CPU stage's results (and
        the refused samples) in batch order; ``fill`` where a plan pads."""
        self._note_thread()
        indices, plans, stack, took = batch.indices, batch.plans, batch.stack, batch.took
        gpu_pos, cpu_pos = batch.gpu_pos, batch.cpu_pos
        # float32 pixels whatever autocast region the caller is in (a synchronous submit runs
        # here on the caller's thread; autocast is per thread)
        with self._streams.on_side(), no_autocast(self.device):
            decoded, ready = stage_result(gpu)
            self._streams.adopt((t for t in decoded if isinstance(t, torch.Tensor)), ready)
            t0 = time.perf_counter()
            parts = self._plans.parts(indices, plans, stack, gpu_pos, decoded)
            t1 = time.perf_counter()
            chunks = [stage_result(c) for c in cpu]  # the CPU stage's chunks, in batch order
            took["fallback"] = sum(seconds for _, seconds in chunks)
            parts.append((cpu_pos, [r for results, _ in chunks for r in results], True))
            parts.append(batch.refused)
            t2 = time.perf_counter()
            out = join(
                len(indices),
                parts,
                indices=indices,
                stack=stack,
                device=self.device,
                out_hw=out_size(plans),
            )
            if masks is not None:
                assert self._mask_stage is not None
                out.masks = self._mask_stage.place(masks, plans, out.indices)
            took["resize"], took["collate"] = t1 - t0, time.perf_counter() - t2
            out.times, out.routes = (
                stage_times(took),
                {
                    "full": len(gpu_pos),
                    "fallback": len(cpu_pos),
                },
            )
            out.busy = sum(out.times[k] for k in ("read", "decode", "resize", "collate"))
            return Done(out, self._streams.record())

    # ------------------------------------------------------------------ Backend
    def submit(
        self, indices: np.ndarray, plans: np.ndarray, stack: bool, key: tuple[int, ...] = ()
    ) -> None:
        if self._closed:
            raise RuntimeError("this NvjpegBackend is closed; make a new one (or a new loader).")
        indices, plans = np.asarray(indices, dtype=np.int64), np.asarray(plans)
        try:
            gpu_ok, cpu_ok, refused = split(self.cache, indices, on_error=self.on_error)
        except Exception as err:  # noqa: BLE001 - raised at get(), in batch order
            failed: Future[Done] = Future()
            failed.set_exception(err)
            self._pending.append(Job([], None, failed))
            return
        on_gpu = self._gpu_mask[indices[gpu_ok]]
        gpu_pos, cpu_pos = gpu_ok[on_gpu], np.sort(np.concatenate([cpu_ok, gpu_ok[~on_gpu]]))
        batch = Batch(indices, plans, stack, gpu_pos, cpu_pos, refused)
        took = batch.took
        if not self._pools:
            cpu = [self._cpu_stage(indices, plans, cpu_pos)]
            gpu = self._decode_stage(indices, gpu_pos, took)
            masks = self._mask_stage.submit(indices, plans, stack) if self._mask_stage else None
            done = self._transform_stage(batch, gpu, cpu, masks)
            self._pending.append(Job(cpu, gpu, done))
            return
        n = min(self.cpu_threads, len(cpu_pos))  # the batch's CPU samples split among threads
        cpu_f = [
            self._pools["cpu"].submit(self._cpu_stage, indices, plans, chunk)
            for chunk in (np.array_split(cpu_pos, n) if n else [])
        ]
        # queued after the images' CPU chunks, split among the same threads
        mask_f = self._mask_stage.submit(indices, plans, stack) if self._mask_stage else None
        gpu_f = self._pools["decode"].submit(self._decode_stage, indices, gpu_pos, took)
        done_f = self._pools["transform"].submit(self._transform_stage, batch, gpu_f, cpu_f, mask_f)
        self._pending.append(Job(cpu_f, gpu_f, done_f, mask_f))

    def get(self) -> Decoded:
        if not self._pending:
            raise RuntimeError("get() called with no batch submitted.")
        job = self._pending.pop(0)
        try:
            done = stage_result(job.done)
        except BaseException:
            self.close()  # the threads stop; what was queued behind the failed batch is dropped
            raise
        images, masks = done.decoded.images, done.decoded.masks
        tensors = [images] if isinstance(images, torch.Tensor) else list(images)
        if masks is not None:
            tensors += [masks] if isinstance(masks, torch.Tensor) else masks
        self._streams.hand_over(done.event, tensors)
        return done.decoded

    def __len__(self) -> int:
        return len(self._pending)

    def drain(self) -> None:
        """Drop the batches of an abandoned epoch: queued stages are cancelled, running ones
        waited for (their errors too belong to the abandoned epoch)."""
        pending, self._pending = self._pending, []
        for job in pending:
            for f in job.futures():
                if not f.cancel():
                    f.exception()

    def close(self) -> None:
        """Cancel queued batches, wait for running stages, stop the threads. Idempotent."""
        self._closed = True
        self._pending = []
        self._finalizer.detach()
        stop_pools(list(self._pools.values()), wait=True)

    @property
    def gpu_mask(self) -> np.ndarray:
        """Per sample of the store, whether this backend sends it to its batched GPU decoder
        (the rest, progressive JPEGs included, take its CPU stage by design)."""
        return self._gpu_mask

    @property
    def thread_alive(self) -> bool:
        """Whether any of the pipeline's threads is running (for shutdown checks)."""
        return any(t.is_alive() for t in self._threads)
