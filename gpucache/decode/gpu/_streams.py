"""Stream handling of the GPU backends: the only CUDA stream and event lines of gpucache.

The backend calls the same five methods on every device; :class:`HostStreams` (CPU, or any
device without streams) runs everything in order and checks the hand-over rule that CUDA's
``record_stream`` needs, so CI catches a CPU tensor reaching it. :class:`CudaStreams` is
**untested on GPU**.

On CUDA a batch is decoded and planned on the backend's side stream, in the background thread.
The decoder's outputs are allocated on a dedicated *allocation stream* (one for each decoding
thread): torchvision's ``decode_jpegs_cuda`` allocates them on the current stream, then writes
them from a private stream that waits for nothing but itself (TorchCodec's hardware engine does
not follow the stream it is given either), so memory freed by kernels still queued on the side
stream must never be handed to it. Blocks of the allocation stream are only reused once the side
stream's work on them is done (``record_stream``), and the side stream waits for that stream.

Every stream of gpucache has the priority :data:`STREAM_PRIORITY`, and none of a backend's
streams is another of its own: ``torch.cuda.Stream()`` hands out streams round-robin from a pool
of 32 a device and priority, the default priority's pool being the one user code and
torchvision's decoder (its builds that take ``getStreamFromPool()``) draw from, so once enough
streams were made there the side stream could be the decoder's own, and decode and transforms
would run one after the other.

The DALI backend takes its outputs bound to :func:`consumer_stream`, the stream its copies run on.
Under :class:`~tests.support.emulated_cuda.EmulatedCuda` a stream call from any other gpucache
module fails, so CI keeps them here.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable
from types import TracebackType

import torch

from .._device import normalize_device

#: The priority of gpucache's streams: not the default (0), whose pool of streams torchvision's
#: decoder and user code both use; -1 is the next pool (a higher priority: CUDA's lower numbers).
STREAM_PRIORITY = -1
#: Streams torch's pool holds a device and priority (``kStreamsPerPool``).
POOL_SIZE = 32
#: What marks a decoder's outputs written: the event of its one call, one event a sub-batch
#: when several threads decoded them, or None (decoded on the calling thread, or no streams).
Ready = torch.cuda.Event | list[torch.cuda.Event] | None


def consumer_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The calling thread's current stream *of ``device``* (not of the current device), where
    torch queues work on that device's tensors; None off CUDA."""
    if device.type != "cuda":
        return None
    return torch.cuda.current_stream(device)


def check_on_device(tensors: Iterable[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """The tensors, after checking each is on ``device`` (what ``record_stream`` needs)."""
    tensors, device = list(tensors), normalize_device(device)
    stray = sorted({str(t.device) for t in tensors if normalize_device(t.device) != device})
    if stray:
        raise RuntimeError(
            f"hand-over of tensors on {stray} by a backend on {device}: every "
            "result (CPU fallback included) must be moved to the device first."
        )
    return tensors


class HostStreams:
    """No streams: work runs in order on the calling thread; hand-over only checks devices."""

    def __init__(self, device: torch.device):
        self.device = normalize_device(device)

    def on_side(self) -> contextlib.AbstractContextManager[object]:
        return contextlib.nullcontext()

    def decoding(self) -> _Decoding:
        """The decoder's context; its ``ready`` (after the block) is what :meth:`adopt` waits
        for (None here: no streams)."""
        return _Decoding(None)

    def adopt(self, tensors: Iterable[torch.Tensor], ready: Ready = None) -> None:
        """Decoder outputs are used on the side stream from now on (``ready``: the
        :meth:`decoding` block's event when the outputs were decoded on another thread, or a
        list of them, one a sub-batch, when several threads decoded them)."""

    def record(self) -> torch.cuda.Event | None:
        return None

    def release_cached(self) -> None:
        """Before a decoder call is retried: wait for what the failed call left queued, then
        give the memory torch's caching allocator holds unused back to the device (for a
        decoder that allocates outside it, such as nvJPEG); nothing off CUDA."""

    def hand_over(self, event: torch.cuda.Event | None, tensors: Iterable[torch.Tensor]) -> None:
        check_on_device(tensors, self.device)


class CudaStreams(HostStreams):
    """A side stream for the batch's work and, for each decoding thread, an allocation stream
    for the decoder's outputs."""

    def __init__(self, device: torch.device):
        super().__init__(device)
        self._mine: list[torch.cuda.Stream] = []
        self._making = threading.Lock()
        self.side = self._distinct(torch.cuda.Stream(self.device, priority=STREAM_PRIORITY))
        self._local = threading.local()

    def _distinct(self, stream: torch.cuda.Stream) -> torch.cuda.Stream:
        """``stream``, or if it is one of this backend's streams already another one of
        :data:`STREAM_PRIORITY`: the pool is round-robin, so after streams made elsewhere it
        comes back to ours (two decoding threads on one stream would decode one after the
        other)."""
        with self._making:
            for _ in range(POOL_SIZE):
                if not any(stream == mine for mine in self._mine):
                    break
                stream = torch.cuda.Stream(self.device, priority=STREAM_PRIORITY)
            self._mine.append(stream)  # a pool all ours (32 decoders): reused, still in order
            return stream

    @property
    def alloc(self) -> torch.cuda.Stream:
        """The calling thread's allocation stream (no two decoding threads have the same one)."""
        stream = getattr(self._local, "alloc", None)
        if stream is None:
            alloc = torch.cuda.Stream(self.device, priority=STREAM_PRIORITY)
            stream = self._local.alloc = self._distinct(alloc)
        return stream

    def on_side(self) -> contextlib.AbstractContextManager[object]:
        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(self.device))
        stack.enter_context(torch.cuda.stream(self.side))
        return stack

    def decoding(self) -> _Decoding:
        """The decoder's context: the calling thread's allocation stream, after waiting for what
        is queued on it. ``torch.cuda.Stream()`` hands out streams from a small round-robin pool,
        so this stream may be one a user computes on; blocks freed there are reused by the
        decoder's outputs, which nvJPEG writes from a stream of its own that waits for nothing.
        Waiting here (free: torchvision's decode waits for the host anyway) means no queued
        kernel still uses them. After the block, ``ready`` is an event recorded on that stream."""
        return _Decoding(self.alloc, barrier=self.alloc)

    def adopt(self, tensors: Iterable[torch.Tensor], ready: Ready = None) -> None:
        if ready is None:  # decoded on this thread, under its allocation stream
            self.side.wait_stream(self.alloc)
        else:  # decoded on other threads, each under its own stream: one event, or one a part
            for event in ready if isinstance(ready, list) else [ready]:
                self.side.wait_event(event)
        for t in tensors:
            t.record_stream(self.side)

    def record(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(self.side)
        return event

    def release_cached(self) -> None:
        """A failed decoder call may leave its kernels queued on a stream gpucache has no handle
        to (torchvision's private stream; TorchCodec's hardware engine), still writing the
        outputs it allocated and freed on the allocation stream, whose blocks torch's allocator
        hands to the retry's outputs at once (and ``empty_cache`` keeps a block whose segment
        holds a live one). So the device is synchronised first (a host sync, on the decoding
        thread, on this error path only), then the cache emptied."""
        with torch.cuda.device(self.device):
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def hand_over(self, event: torch.cuda.Event | None, tensors: Iterable[torch.Tensor]) -> None:
        consumer = consumer_stream(self.device)  # the backend's device, not the current one
        assert consumer is not None and event is not None  # a CUDA device; record() made it
        consumer.wait_event(event)
        for t in check_on_device(tensors, self.device):
            t.record_stream(consumer)


class _Decoding:
    """``with streams.decoding() as d:`` runs the decoder under ``stream``, after synchronising
    ``barrier``; afterwards ``d.ready`` is an event recorded on ``stream`` (None without one)."""

    def __init__(
        self, stream: torch.cuda.Stream | None, *, barrier: torch.cuda.Stream | None = None
    ) -> None:
        self.stream, self.barrier = stream, barrier
        self.ready: torch.cuda.Event | None = None
        self._context: contextlib.AbstractContextManager[object] = contextlib.nullcontext()

    def __enter__(self) -> _Decoding:
        if self.barrier is not None:
            self.barrier.synchronize()
        if self.stream is not None:
            self._context = torch.cuda.stream(self.stream)
        self._context.__enter__()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        err: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._context.__exit__(kind, err, tb)
        if self.stream is not None and kind is None:
            self.ready = torch.cuda.Event()
            self.ready.record(self.stream)
