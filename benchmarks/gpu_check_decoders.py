"""The device check's decoders part (for ``gpu_check.py``).

Decode-only images/s of every batched GPU decoder available, at 1, 2 and 4 concurrent calls,
each call a sub-batch (:func:`gpucache.decode.gpu._batched.sub_batches`) on a thread and stream of
its own, all of a pass's sub-batches queued at once: torchvision's and TorchCodec's
``decode_jpeg`` (the nvjpeg backend's), nvImageCodec's batched decoder with its hardware backend,
and DALI's ``decoders.image`` on ``mixed`` (``hw_decoder_load``), the last two on CUDA only. It
records the fastest decoder and concurrency: the measurement the backend's default (TorchCodec
at two calls, torchvision at one) answers to. Under the emulation (no timing of worth) it
records how many calls were ever inside a decoder at once (torchvision's mutex keeps it at 1).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata

import numpy as np
import torch

from gpucache.decode.gpu._batched import sub_batches, torchcodec_decoder, torchvision_decoder
from gpucache.ingest._sniff import Kind
from tests.support.emulated_cuda import EmulatedCuda

CONCURRENCY = (1, 2, 4)


def installed(name: str) -> bool:
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def _nvimgcodec(device: torch.device):
    from nvidia import nvimgcodec

    dec = nvimgcodec.Decoder(
        device_id=device.index,
        backends=[
            nvimgcodec.Backend(nvimgcodec.BackendKind.HW_GPU_ONLY),
            nvimgcodec.Backend(nvimgcodec.BackendKind.GPU_ONLY),
        ],
    )

    def decode(data: list[torch.Tensor]) -> list:
        stream = torch.cuda.current_stream(device).cuda_stream
        images = dec.decode([nvimgcodec.CodeStream(t.numpy()) for t in data], cuda_stream=stream)
        return [im for im in images if im is not None]

    return decode


def _dali(device: torch.device, batch: int):
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=batch, num_threads=2, device_id=device.index, prefetch_queue_depth=1)
    def graph():
        jpegs = fn.external_source(name="jpegs", dtype=types.UINT8)
        return fn.decoders.image(jpegs, device="mixed", output_type=types.RGB, hw_decoder_load=0.65)

    pipe = graph()
    pipe.build()

    def decode(data: list[torch.Tensor]) -> list:
        pipe.feed_input("jpegs", [t.numpy() for t in data])
        (images,) = pipe.run()
        return [images[k] for k in range(len(images))]

    return decode


def available_decoders(c) -> dict:
    """Each batched GPU decoder installed: a factory of one call's decode function (a thread
    makes its own)."""
    dev = c.decode_device
    makers = {"torchvision": lambda: torchvision_decoder(dev).decode}
    if installed("torchcodec"):
        makers["torchcodec"] = lambda: torchcodec_decoder(dev).decode
    if not c.args.emulate:  # these two run on a real GPU only
        try:
            from nvidia import nvimgcodec  # noqa: F401

            makers["nvimgcodec"] = lambda: _nvimgcodec(dev)
        except ImportError:
            pass
        from gpucache.decode import dali_available

        if dali_available():
            makers["dali"] = lambda: _dali(dev, c.args.batch)
    return makers


def _rate(c, make, data: list[torch.Tensor], pixels: np.ndarray, k: int, deadline: float) -> dict:
    """Decode-only images/s with ``k`` concurrent calls: every batch cut into ``k`` sub-batches,
    all queued at once on ``k`` threads, each with its own decoder and stream; the median of
    the timed passes after a warm-up one."""
    local = threading.local()
    dev = c.decode_device

    def call(rows: np.ndarray) -> int:
        fn = getattr(local, "fn", None)
        if fn is None:
            fn, local.stream = make(), torch.cuda.Stream(dev)
            local.fn = fn
        local.stream.synchronize()  # as the backend does: nothing queued there still uses a block
        with torch.cuda.stream(local.stream):
            return len(fn([data[i] for i in rows.tolist()]))

    b = c.args.batch
    parts = [
        np.arange(s, min(s + b, len(data)))[cut]
        for s in range(0, len(data), b)
        for cut in sub_batches(pixels[s : s + b], k)
    ]
    emu = EmulatedCuda._active
    if emu is not None:
        emu.decode_overlap = 0
    rates, decoded = [], 0
    with ThreadPoolExecutor(k, "gpu-check-decoder") as pool:
        for rnd in range(1 + c.args.epochs):
            c.sync()
            t0 = time.perf_counter()
            decoded = sum(pool.map(call, parts))
            c.sync()
            if rnd:
                rates.append(decoded / (time.perf_counter() - t0))
            if rnd and time.perf_counter() > deadline:
                break
    out = {"img_s": float(np.median(rates)), "images": decoded, "of": len(data)}
    if emu is not None:
        out["calls_at_once"] = emu.decode_overlap
    return out


def _decodable(c, rows: np.ndarray) -> np.ndarray:
    """The rows torchvision's GPU decoder decodes (a batch that fails is tried one sample at a
    time): a corrupt sample would fail every call it is in."""
    decode = torchvision_decoder(c.decode_device).decode
    cache, keep, b = c.data, [], c.args.batch
    with torch.cuda.stream(torch.cuda.Stream(c.decode_device)):
        for s in range(0, len(rows), b):
            part = rows[s : s + b].tolist()
            try:
                decode([cache._bytes_tensor(i) for i in part])
                keep += part
            except RuntimeError:
                for i in part:
                    try:
                        decode([cache._bytes_tensor(i)])
                        keep.append(i)
                    except RuntimeError:
                        continue
    c.sync()
    return np.asarray(keep, dtype=np.int64)


def decoders(c) -> dict:
    """See the module doc."""
    cache = c.data
    s = cache.samples
    candidates = np.flatnonzero(cache.gpu_decodable() & (s["kind"] != Kind.JPEG_PROGRESSIVE))
    rows = _decodable(c, candidates)
    data = [cache._bytes_tensor(int(i)) for i in rows.tolist()]
    pixels = s["height"][rows].astype(np.int64) * s["width"][rows]
    deadline = c.deadline("decoders")
    out: dict = {
        "photos": len(rows),
        "left_out": len(candidates) - len(rows),  # baseline JPEGs the GPU decoder refused
        "batch": c.args.batch,
        "img_s": {},
        "errors": {},
    }
    makers = available_decoders(c)
    for name, make in makers.items():
        for k in CONCURRENCY:
            try:
                r = _rate(c, make, data, pixels, k, deadline)
            except Exception as err:  # noqa: BLE001 - recorded; the other decoders still run
                out["errors"][f"{name} x{k}"] = f"{type(err).__name__}: {str(err)[:300]}"
                break
            out["img_s"][f"{name} x{k}"] = r["img_s"]
            if "calls_at_once" in r:
                out.setdefault("calls_at_once", {})[f"{name} x{k}"] = r["calls_at_once"]
            if r["images"] != r["of"]:
                out["errors"][f"{name} x{k}"] = f"decoded {r['images']} of {r['of']}"
    if out["img_s"]:
        best = max(out["img_s"], key=out["img_s"].get)
        out["fastest"] = best
    # the backend's own decoders must decode every photo at every concurrency; the others are
    # measured where they run (an error there is recorded, not a failure)
    must = [n for n in ("torchvision", "torchcodec") if n in makers]
    out["ok"] = bool(rows.size) and all(
        f"{n} x{k}" in out["img_s"] and f"{n} x{k}" not in out["errors"]
        for n in must
        for k in CONCURRENCY
    )
    return out
