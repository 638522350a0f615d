"""nvJPEG under :class:`~tests.support.emulated_cuda.EmulatedCuda`: torchvision's (and
TorchCodec's) CUDA ``decode_jpeg`` as they run (see that module's doc): outputs allocated on the
current stream and written from the decoder's private stream, the decoder's host syncs, one global
torchvision decoder rebuilt on a device change, and the faults switched on by ``decoder_fault``.
"""

from __future__ import annotations

import contextlib
import io

import torch

from .emulated_order import Stream, _caller, _join, _what, active

NVJPEG_ALLOCATOR_FAILURE = 5
DECODER_BYTES = 64 * 2**20  # device memory a decoder holds outside torch's caching allocator
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


def decoder_stream(emu, library: str, given: torch.device, dev: torch.device) -> Stream:
    """The private stream of the decoder a call uses, building (or rebuilding) it."""
    init = RuntimeError(
        f"Failed to initialize nvjpeg with hardware backend: {NVJPEG_ALLOCATOR_FAILURE}"
    )
    with emu._lock:
        if library == "torchvision":
            cur = emu._tv_decoder
            if cur is None or cur[0] != given:  # torch.device("cuda") != "cuda:0"
                if emu.decoder_fault == "init":
                    raise init
                if cur is not None:
                    emu.decoder_rebuilds += 1  # the old decoder is leaked, not freed
                n = 1 + emu.decoder_rebuilds
                emu.outside[dev.index] += DECODER_BYTES
                emu._tv_decoder = (
                    given,
                    Stream(
                        dev, _label=(f"nvJPEG's private stream of {dev} (torchvision decoder #{n})")
                    ),
                )
            return emu._tv_decoder[1]
        if dev.index not in emu._codec_decoders:  # TorchCodec: a decoder cache per device
            if emu.decoder_fault == "init":
                raise init
            emu.outside[dev.index] += DECODER_BYTES
            emu._codec_decoders[dev.index] = Stream(
                dev, _label=(f"nvJPEG's private stream of {dev} (TorchCodec decoder)")
            )
        return emu._codec_decoders[dev.index]


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
        with emu._lock:
            tick = emu._tick(private)
            for x in outs:
                if (blk := emu._block(x, dev.index, current)) is not None:
                    emu._write(blk, private, tick, "nvJPEG decode", _what(x))
        emu._host_sync(
            "nvJPEG decode: cudaStreamSynchronize of its private stream (after decoding)",
            [private],
            credit=emu.trust_decoder_sync,
        )
        emu._wait(current, private.clock)  # event.record(private); event.block(current)


def emulated_decode_jpeg(cpu_decode, *, library: str):
    """torchvision's (or TorchCodec's: it applies EXIF on CUDA too) ``decode_jpeg`` with the
    CUDA path emulated (see the module doc)."""
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
                "allocation stream (decode/_streams.py)."
            )
        private = decoder_stream(emu, library, given, dev)
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
            raise RuntimeError(
                f"{_FAILED}Failed to initialize batch decoding: {NVJPEG_ALLOCATOR_FAILURE}"
            )
        out = [emu._wrap(x, dev.index) for x in decoded_cpu]
        with emu._lock:
            emu.outside[dev.index] += emu.decoder_leak
        decoded(emu, out, dev, current, private, ours)
        return out if batch else out[0]

    return decode_jpeg


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
