"""nvJPEG under :class:`~tests.support.emulated_cuda.EmulatedCuda`: torchvision's (and
TorchCodec's) CUDA ``decode_jpeg`` as they run (see that module's doc): outputs allocated on the
current stream and written from the decoder's private stream, the decoder's host syncs, one global
torchvision decoder rebuilt on a device change, and the faults switched on by ``decoder_fault``.
"""

from __future__ import annotations

import contextlib
import io
import time

import torch

from .emulated_order import Stream, _caller, _join, _what, active

NVJPEG_ALLOCATOR_FAILURE = 5
DECODER_BYTES = 64 * 2**20  # device memory a decoder holds outside torch's caching allocator
CODEC_POOL = 32  # idle TorchCodec decoders kept a device (its kMaxCachedDecodersPerDevice)
_FAILED = "Error while decoding JPEG images: "  # torchvision's prefix of a decode call's error


def work_bytes(images: list[torch.Tensor]) -> int:
    """nvJPEG's own device memory during a call decoding to ``images``: 3 bytes a pixel."""
    with torch._C.DisableTorchFunction():
        return sum(3 * x.shape[-1] * x.shape[-2] for x in images)


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} bytes"


class _Decoder:
    """One decoder a call uses: its private stream (torchvision's, or the one standing for a
    TorchCodec decoder's nvJPEG hardware engine), and whether it goes back to TorchCodec's
    pool after the call."""

    def __init__(self, stream: Stream, *, pooled: bool) -> None:
        self.stream, self.pooled = stream, pooled


def _init_error() -> RuntimeError:
    return RuntimeError(
        f"Failed to initialize nvjpeg with hardware backend: {NVJPEG_ALLOCATOR_FAILURE}"
    )


def take_decoder(emu, library: str, given: torch.device, dev: torch.device) -> _Decoder:
    """The decoder a call uses, building (or rebuilding) it.

    torchvision: one global decoder (rebuilt, the old one leaked, when the device differs as a
    ``torch.device``); its private stream comes from torch's pool of streams with
    ``decoder_stream_from_pool`` (torchvision's decoders before its stable-ABI rewrite take
    ``getStreamFromPool()``, the pool ``torch.cuda.Stream()`` hands out too), else it is a stream
    of its own (``cudaStreamCreate``). TorchCodec: a pool of idle decoders a device; a call takes
    one (or builds one: concurrent calls each get their own) and gives it back after a call that
    succeeded (at most :data:`CODEC_POOL` are kept), while a call that fails destroys it. Each
    TorchCodec decoder writes from a stream of its own: its nvJPEG hardware engine does not
    honour the stream it is given (TorchCodec brackets it with synchronisations instead)."""
    with emu._lock:
        if library == "torchvision":
            cur = emu._tv_decoder
            if cur is None or cur[0] != given:  # torch.device("cuda") != "cuda:0"
                if emu.decoder_fault == "init":
                    raise _init_error()
                if cur is not None:
                    emu.decoder_rebuilds += 1  # the old decoder is leaked, not freed
                n = 1 + emu.decoder_rebuilds
                emu.outside[dev.index] += DECODER_BYTES
                label = f"nvJPEG's private stream of {dev} (torchvision decoder #{n})"
                stream = (
                    emu._pool_stream(dev, 0, label=label)
                    if emu.decoder_stream_from_pool
                    else Stream(dev, _label=label)
                )
                emu._tv_decoder = (given, stream)
            return _Decoder(emu._tv_decoder[1], pooled=False)
        idle = emu._codec_idle.setdefault(dev.index, [])
        if idle:
            return _Decoder(idle.pop(), pooled=True)
        if emu.decoder_fault == "init":
            raise _init_error()
        emu.outside[dev.index] += DECODER_BYTES
        emu.codec_decoders_built += 1
        n = emu.codec_decoders_built
        return _Decoder(
            Stream(dev, _label=f"the nvJPEG engine of TorchCodec decoder #{n} on {dev}"),
            pooled=True,
        )


def give_back(emu, dev: torch.device, decoder: _Decoder, *, ok: bool) -> None:
    """After a call: a TorchCodec decoder back to its pool (destroyed after a failed call, or
    when the pool is full); torchvision's stays."""
    if not decoder.pooled:
        return
    with emu._lock:
        idle = emu._codec_idle.setdefault(dev.index, [])
        if ok and len(idle) < CODEC_POOL:
            idle.append(decoder.stream)
        else:
            emu.outside[dev.index] -= DECODER_BYTES


@contextlib.contextmanager
def decoding_call(emu):
    """A decode call's work: counted in ``emu.decode_active`` (the most at once in
    ``emu.decode_overlap``), and, while ``emu.decode_rendezvous`` is set and neither met nor
    missed, held until that many calls are inside at once (or ``rendezvous_timeout_s`` passed:
    ``emu.rendezvous_missed``), so a test sees the overlap of concurrent calls however the
    threads are scheduled, and a decoder that serialises them cannot meet it."""
    with emu._lock:
        emu.decode_active += 1
        emu.decode_overlap = max(emu.decode_overlap, emu.decode_active)
        emu._decode_cond.notify_all()
    try:
        want = emu.decode_rendezvous
        if want and not (emu.rendezvous_met or emu.rendezvous_missed):
            deadline = time.monotonic() + emu.rendezvous_timeout_s
            with emu._decode_cond:
                while emu.decode_active < want and not (
                    emu.rendezvous_met or emu.rendezvous_missed
                ):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        emu.rendezvous_missed = True
                        break
                    emu._decode_cond.wait(left)
                else:
                    emu.rendezvous_met = True
                emu._decode_cond.notify_all()
        yield
    finally:
        with emu._lock:
            emu.decode_active -= 1


def decoded(
    emu, outs: list[torch.Tensor], dev: torch.device, current: Stream, private: Stream, ours: bool
) -> None:
    """The decoder's outputs, allocated on ``current``, written by ``private``."""
    with torch._C.DisableTorchFunction():
        with emu._lock:
            for x in outs:
                emu._block(x, dev.index, current)
            _join(private.clock, emu._host())
            if not ours:  # outside gpucache: the decoder as pytorch/vision PR 9606 fixes it
                _join(private.clock, current.clock)
        emu._host_sync(
            "nvJPEG decode: cudaStreamSynchronize of its private stream (before decoding)",
            [private],
            credit=emu.trust_decoder_sync,
        )
        _write_outputs(emu, outs, dev, current, private)
        emu._host_sync(
            "nvJPEG decode: cudaStreamSynchronize of its private stream (after decoding)",
            [private],
            credit=emu.trust_decoder_sync,
        )
        emu._wait(current, private.clock)  # event.record(private); event.block(current)


def _write_outputs(emu, outs, dev: torch.device, current: Stream, private: Stream) -> None:
    with torch._C.DisableTorchFunction(), emu._lock:
        tick = emu._tick(private)
        for x in outs:
            if (blk := emu._block(x, dev.index, current)) is not None:
                emu._write(blk, private, tick, "nvJPEG decode", _what(x))


def failed_mid_decode(
    emu, outs: list[torch.Tensor], dev: torch.device, current: Stream, private: Stream
) -> None:
    """A call that fails inside ``nvjpegDecodeBatched`` (``fail_mid_decode``): its outputs were
    allocated on ``current`` and the decoder queued its writes into them, then it raised; the
    outputs are freed with those writes still queued, and nothing made ``current`` wait for
    them (the error skips the event and the synchronisation after decoding)."""
    with torch._C.DisableTorchFunction(), emu._lock:
        for x in outs:
            emu._block(x, dev.index, current)
        _join(private.clock, emu._host())
    _write_outputs(emu, outs, dev, current, private)


def emulated_decode_jpeg(cpu_decode, *, library: str):
    """torchvision's (or TorchCodec's: it applies EXIF on CUDA too) ``decode_jpeg`` with the
    CUDA path emulated (see the module doc). torchvision's holds one global mutex for the whole
    call, as its ``decoderMutex``; TorchCodec's has none (each call its own decoder)."""
    exif = library == "torchcodec"

    def decode_jpeg(input, mode=None, device="cpu", **kwargs):
        given = torch.device(device)
        if given.type != "cuda":
            kw = {} if mode is None else {"mode": mode}
            return cpu_decode(input, device=device, **kw, **kwargs)
        emu = active()
        dev = emu.index_device(given)  # un-indexed: the calling thread's current device
        current = emu.current_stream(dev)
        ours = _caller().startswith("gpucache")
        if current.default and emu.default_stream_decode == "raise" and ours:
            raise RuntimeError(
                f"emulated CUDA: nvJPEG decode called on the default stream of "
                f"{dev}; torchvision allocates its outputs on the current stream "
                "and writes them from its own, so gpucache must decode under its "
                "allocation stream (decode/gpu/_streams.py)."
            )
        mutex = emu._tv_mutex if library == "torchvision" else contextlib.nullcontext()
        with mutex:
            decoder = take_decoder(emu, library, given, dev)
            ok = False
            try:
                with decoding_call(emu):
                    out = _decode(emu, cpu_decode, input, mode, exif, dev, current, decoder, ours)
                ok = True
            finally:
                give_back(emu, dev, decoder, ok=ok)
        return out

    return decode_jpeg


def _decode(emu, cpu_decode, input, mode, exif, dev, current, decoder, ours):
    """The CUDA decode of ``input`` by ``decoder``, its faults and its memory (see the module
    doc)."""
    private = decoder.stream
    kw = {} if mode is None else {"mode": mode}
    if not exif:
        kw["apply_exif_orientation"] = False  # torchvision's CUDA decoder ignores EXIF
    batch = isinstance(input, list)
    data = input if batch else [input]
    with emu._lock:
        emu.decode_calls += 1
    if emu.decoder_fault == "oom":
        raise RuntimeError(_oom_message(data, dev))
    if emu.decoder_fault == "alloc":
        raise RuntimeError(f"{_FAILED}Failed to decode batch: {NVJPEG_ALLOCATOR_FAILURE}")
    decoded_cpu = cpu_decode(data, **kw)
    free, _ = emu.mem_get_info(dev)
    if free < work_bytes(decoded_cpu):  # nvJPEG's cudaMalloc, outside torch's allocator
        if not emu.fail_mid_decode:
            raise RuntimeError(
                f"{_FAILED}Failed to initialize batch decoding: {NVJPEG_ALLOCATOR_FAILURE}"
            )
        failed_mid_decode(
            emu, [emu._wrap(x, dev.index) for x in decoded_cpu], dev, current, private
        )
        del decoded_cpu  # the outputs are freed, their writes still queued
        raise RuntimeError(f"{_FAILED}Failed to decode batch: {NVJPEG_ALLOCATOR_FAILURE}")
    out = [emu._wrap(x, dev.index) for x in decoded_cpu]
    with emu._lock:
        emu.outside[dev.index] += emu.decoder_leak
    decoded(emu, out, dev, current, private, ours)
    return out if batch else out[0]


def _oom_message(data: list[torch.Tensor], dev: torch.device) -> str:
    """torchvision's message when allocating the first output fails (CUDA's, rethrown)."""
    from PIL import Image

    size = 0
    with (
        contextlib.suppress(Exception),
        torch._C.DisableTorchFunction(),
        Image.open(io.BytesIO(data[0].numpy().tobytes())) as im,
    ):
        size = 3 * im.width * im.height
    return (
        f"Error while decoding JPEG images: CUDA out of memory. Tried to allocate "
        f"{_size(size)}. GPU {dev.index} has a total capacity of 79.19 GiB of which "
        f"{_size(1 << 20)} is free. Of the allocated memory 77.91 GiB is allocated by "
        "PyTorch, and 1.07 GiB is reserved by PyTorch but unallocated."
    )
