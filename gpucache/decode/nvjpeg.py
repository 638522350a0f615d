"""backend="nvjpeg": batched nvJPEG decode in a background thread, straight into device tensors.

Each submitted batch is decoded by one background thread (``threaded=False`` decodes it in
``submit`` instead), so staging, host-side Huffman decoding, the CPU fallback and the join overlap
with the training step that consumes the previous batch; the loader keeps at least two batches in
flight. Per batch, in that thread:

1. the pixel budget refuses oversized samples; the rest split into what the batched decoder takes
   and what the CPU decodes (:func:`~gpucache.decode._fallback.split`);
2. one batched ``decode_jpeg(list, device=...)`` call (:mod:`._batched`: TorchCodec's when
   installed, else torchvision's) reads zero-copy views of the store; its outputs are allocated
   on a dedicated stream (:mod:`._streams`); EXIF orientation is applied if the decoder skips it;
3. each image runs its plan (:func:`~gpucache.decode._core.apply_plan`, the CPU backend's function);
   if the batched call fails (one corrupt JPEG fails it all) the batch is decoded one sample at a
   time, and what the decoder still rejects is retried on the CPU before it is reported;
4. every result is moved to the device and joined in batch order, and an event marks the batch done.

:meth:`get` makes the consumer's stream wait on that event and ``record_stream``\\s the outputs.

There is no pinned staging copy: nvJPEG (torchvision, TorchCodec) reads the compressed bytes
through host pointers and copies them with its own pinned buffers, so a pinned copy of ours would
add a memcpy and buy nothing. On a CPU device the very same code runs with no streams: that is how
CI covers everything but :class:`~gpucache.decode._streams.CudaStreams`.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from . import normalize_device
from ._base import Backend
from ._batched import BatchDecoder, applies_exif, default_decoder, orient
from ._fallback import Part, decode_on_cpu, join, out_of_memory, split
from ._streams import CudaStreams, HostStreams
from ._core import Decoded, apply_plan, check_size, failure, out_size

log = logging.getLogger("gpucache")


@dataclass
class _Done:
    decoded: Decoded
    event: object | None  # the side stream's event after the batch (None without streams)


class NvjpegBackend(Backend):
    name = "nvjpeg"

    def __init__(self, cache, *, device: torch.device, on_error: str,
                 decoder: BatchDecoder | None = None, threaded: bool = True):
        device = normalize_device(device)
        self.cache, self.device, self.on_error = cache, device, on_error
        self.decoder = decoder if decoder is not None else default_decoder(device)
        if normalize_device(self.decoder.device) != device:
            raise ValueError(f"decoder {self.decoder.name!r} decodes to {self.decoder.device}, "
                             f"but the backend's device is {device}; make it for {device}.")
        self._streams = CudaStreams(device) if device.type == "cuda" else HostStreams(device)
        self.applies_exif = (self.decoder.applies_exif if self.decoder.applies_exif is not None
                             else self.measure_applies_exif())
        self._pending: list[Future | _Done] = []
        self._pool = (ThreadPoolExecutor(1, thread_name_prefix="gpucache-nvjpeg") if threaded
                      else None)
        self._closed = False
        self._thread: threading.Thread | None = None  # the pool's thread, once it ran a batch
        # garbage collection may happen on the pool's own thread: stop it without joining there
        self._finalizer = weakref.finalize(self, _shutdown, self._pool, wait=False)

    def measure_applies_exif(self) -> bool:
        """Whether the decoder applies EXIF orientation, by decoding a tagged probe image under
        the backend's own streams (never on the caller's current stream)."""
        with self._streams.on_side():
            with self._streams.decoding():
                return applies_exif(self.decoder.decode, adopt=self._streams.adopt)

    # ------------------------------------------------------------------ one batch (any thread)
    def _decode_batch(self, indices: np.ndarray, plans: np.ndarray, stack: bool) -> _Done:
        try:
            return self._decode_batch_on(indices, plans, stack)
        except torch.OutOfMemoryError as err:
            raise out_of_memory(err, f"the nvjpeg backend ({self.decoder.name}'s decoder) "
                                f"decoding a batch of {len(indices)} samples", self.device,
                                "at least 2 batches are decoded ahead: lower batch_size or "
                                "prefetch_factor, or free memory held elsewhere") from err

    def _decode_batch_on(self, indices: np.ndarray, plans: np.ndarray, stack: bool) -> _Done:
        if self._pool is not None:
            self._thread = threading.current_thread()
        gpu_pos, cpu_pos, refused = split(self.cache, indices, on_error=self.on_error)
        with self._streams.on_side():
            parts = self._decode_gpu(indices, plans, gpu_pos)
            parts.append((cpu_pos, decode_on_cpu(self.cache, indices, plans, cpu_pos,
                                                 on_error=self.on_error), True))
            parts.append(refused)
            decoded = join(len(indices), parts, indices=indices, stack=stack, device=self.device,
                           out_hw=out_size(plans))
            return _Done(decoded, self._streams.record())

    def _decode_all(self, data: list[torch.Tensor]) -> list[torch.Tensor | Exception]:
        try:
            return list(self.decoder.decode(data))
        except torch.OutOfMemoryError:
            raise  # not a bad sample: retrying one by one, then on the CPU, would hide it
        except Exception:  # noqa: BLE001 - one bad JPEG fails the batched call: find it
            out: list[torch.Tensor | Exception] = []
            for d in data:
                try:
                    out.append(self.decoder.decode([d])[0])
                except torch.OutOfMemoryError:
                    raise
                except Exception as err:  # noqa: BLE001 - retried on the CPU, then reported
                    out.append(err)
            return out

    def _decode_gpu(self, indices: np.ndarray, plans: np.ndarray,
                    positions: np.ndarray) -> list[Part]:
        """Batched decode of ``indices[positions]``; what the decoder rejects tries the CPU."""
        if not len(positions):
            return []
        data = [self.cache._bytes_tensor(int(i)) for i in indices[positions].tolist()]
        with self._streams.decoding():
            images = self._decode_all(data)
        self._streams.adopt(t for t in images if isinstance(t, torch.Tensor))
        done, results, retry = [], [], []
        for p, img in zip(positions.tolist(), images):
            i = int(indices[p])
            if isinstance(img, Exception):
                retry.append(p)
                continue
            try:
                if not self.applies_exif:
                    img = orient(img, self.cache.samples["orientation"][i])
                results.append(apply_plan(check_size(self.cache, i, img), plans[p]))
            except torch.OutOfMemoryError:
                raise
            except Exception as err:  # noqa: BLE001 - reported like any bad sample
                results.append(failure(self.cache, i, err, self.on_error))
            done.append(p)
        parts: list[Part] = [(np.asarray(done, dtype=np.int64), results, False)]
        if retry:  # libjpeg-turbo gets the last word: decoded there, or reported as failed
            rescued = decode_on_cpu(self.cache, indices, plans, retry, on_error=self.on_error)
            for p, r in zip(retry, rescued):
                if isinstance(r, torch.Tensor):
                    log.warning("gpucache: %s could not decode sample %d (%s); decoded it on the "
                                "CPU", self.decoder.name, int(indices[p]),
                                self.cache.paths[int(indices[p])])
            parts.append((np.asarray(retry, dtype=np.int64), rescued, True))
        return parts

    # ------------------------------------------------------------------ Backend
    def submit(self, indices: np.ndarray, plans: np.ndarray, stack: bool) -> None:
        if self._closed:
            raise RuntimeError("this NvjpegBackend is closed; make a new one (or a new loader).")
        job = functools.partial(self._decode_batch, np.asarray(indices, dtype=np.int64),
                                np.asarray(plans), stack)
        self._pending.append(self._pool.submit(job) if self._pool is not None else job())

    def get(self) -> Decoded:
        if not self._pending:
            raise RuntimeError("get() called with no batch submitted.")
        item = self._pending.pop(0)
        try:
            done = item.result() if isinstance(item, Future) else item
        except BaseException:
            self.close()  # the thread stops; what was queued behind the failed batch is dropped
            raise
        images = done.decoded.images
        self._streams.hand_over(done.event, [images] if isinstance(images, torch.Tensor)
                                else images)
        return done.decoded

    def __len__(self) -> int:
        return len(self._pending)

    def drain(self) -> None:
        """Drop the batches of an abandoned epoch: queued ones are cancelled, a running one waited
        for (its errors too belong to the abandoned epoch)."""
        pending, self._pending = self._pending, []
        for item in pending:
            if isinstance(item, Future) and not item.cancel():
                item.exception()

    def close(self) -> None:
        """Cancel queued batches, wait for a running one, stop the thread. Idempotent."""
        self._closed = True
        self._pending = []
        self._finalizer.detach()
        _shutdown(self._pool, wait=True)

    @property
    def thread_alive(self) -> bool:
        """Whether the background decode thread is running (for shutdown checks)."""
        return self._thread is not None and self._thread.is_alive()


def _shutdown(pool: ThreadPoolExecutor | None, *, wait: bool) -> None:
    if pool is not None:
        pool.shutdown(wait=wait, cancel_futures=True)
