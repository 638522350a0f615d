"""One-call GPU check: correctness, stream-ordering stress, transforms, throughput, overlap, memory.

    PYTHONPATH=. python3 benchmarks/gpu_check.py --out OUT [PHOTOS]  # on a CUDA machine
    PYTHONPATH=. python3 benchmarks/gpu_check.py --emulate --out OUT # CPU, same code
    PYTHONPATH=. python3 benchmarks/gpu_check.py --emulate --device cuda:1 --out OUT # another GPU

Everything it writes goes into the one folder ``--out`` (see :mod:`benchmarks.gpu_check_out`: the
JSON, the machine with ``nvidia-smi -q``, full tracebacks, hung parts' stacks). PHOTOS, a folder of
real photos (ImageFolder layout or flat; at most --max-photos of them, drawn at random), is what
the transforms, throughput, overlap and memory parts run on; without it they run on the synthetic
photos, whose kinds (5% progressive, 3% over 1,500 px, gray, CMYK, EXIF) the correctness and
ordering parts are for. The JSON is written at start and rewritten after every part, so a crash
(even before the first part) still leaves a file; each part runs in its own try (an error is
printed whole and recorded, the next part runs), prints its whole result and its seconds, and
stops at its share of --budget-s. The nvjpeg backend's parts run first, DALI's last (a DALI that
crashes the process then costs only its own parts):
(env) versions (of the installed distributions: importlib.metadata), the decoder in use and
    whether it applies EXIF (measured, not assumed), and one image through each nvJPEG entry
    point called directly, torchvision's ``decode_jpeg([bytes], device=cuda:N)`` and TorchCodec's
    when installed (no backend's CPU retry in between to hide a decoder that fails): it must
    decode, to the device asked for, at the header's size;
(a) each backend against the CPU decode (gpucache.decode._core.decode_batch) on the batches and
    plans *as drawn* (a skipped sample shifts nothing), within TOLERANCE, EXIF-rotated samples kept;
    samples the backend lost that the CPU decoded fail the check, and samples it kept that the
    CPU refused (corrupt scans nvJPEG decodes anyway) are counted; the GPU decoder must have
    decoded every kept sample the backend sends it (kept - ``cpu_decoded`` of each batch): a
    decoder that fails (to initialise, say) sends every sample to the backend's CPU retry, whose
    pixels alone would pass;
(b) stream-ordering stress: batch checksums vs a synchronised reference while the backend's *side*
    stream is kept busy, checksums kept on the device (no synchronisation per step);
(t) the batched transforms against the per-image path on the device, TF32 matmuls off and on,
    by maximum difference (and share of values that differ); and the synchronous backend inside a
    bfloat16 ``torch.autocast`` region against outside it (must be equal);
(c) images/s of the train pipeline: nvjpeg threaded and synchronous, torchvision's per-image GPU
    decode, the cpu backend with every core; dali's in a part of its own;
(d) overlap: the nvjpeg epoch with a training step, threaded vs synchronous (benchmarks/overlap.py);
(e) GPU memory, allocated and reserved (each stream keeps its own pool), after each epoch;
(s), (f), (y) (:mod:`benchmarks.gpu_check_parts`), (d) (:mod:`benchmarks.gpu_check_decoders`): each backend with masks on outputs taller
    than wide, wider than tall and square, every sample flipped, batched against the cpu decode
    and (nvjpeg) its per-image path, with the alignment IoU of image and mask; ``fill`` and
    ``mask_fill`` not 0 through the loader; host syncs a batch with masks, by thread; and
    decode-only images/s of each batched GPU decoder available at 1, 2 and 4 concurrent calls;
(p) (:mod:`benchmarks.gpu_check_tier`) the device tier: ``decoded=`` pixels held on the GPU,
    against the cpu backend on the same tier, its device bytes, host syncs a batch, images/s.
``--emulate`` runs all of it on the CPU under :class:`~tests.support.emulated_cuda.EmulatedCuda`
(two emulated GPUs): the same ``device="cuda"`` code paths, streams and device indices, with
torchvision's decoder, which ignores EXIF there as on CUDA; DALI, which cannot run its GPU graph
without a GPU, runs its CPU mode, and the overlap part a CPU device. Exit 0 all passed, 1 a check
failed or a part raised, 2 no CUDA (not emulating). The parts' shares add up to 0.9 of
--budget-s without DALI and 1.24 with it (120 s by default; a part stops at its share once it
did its minimum, and on a GPU most parts end well before it), the rest being the stores' builds,
warm-ups and the minimum work a part does past its share (one epoch, the memory part's five).
``--emulate`` defaults to
64 images in batches of 16 (the data parts on 32 of them, the mask parts on 16 masked ones in
batches of 8) and --budget-s 60: the same code paths
and checks (every kind of sample: gray, CMYK, progressive, EXIF-rotated; four batches an epoch,
three in flight), sized for
the nvjpeg backend's batched transforms on CPU tensors (about 50-100 ms a photo on a 2-core VM),
which dominate the emulated run: the parts then do about their minimum (one or two epochs;
memory, five).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from importlib import metadata
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import gpu_check_decoders, gpu_check_tier  # noqa: E402
from benchmarks import gpu_check_parts as parts
from benchmarks._record import run_info  # noqa: E402
from benchmarks.gpu_check_out import Outputs, system  # noqa: E402
from benchmarks.overlap import measure as measure_overlap  # noqa: E402
from gpucache import GpuCachedLoader, JpegCache  # noqa: E402
from gpucache import transforms as T  # noqa: E402
from gpucache.decode import dali_available  # noqa: E402
from gpucache.decode._base import GPU_IN_FLIGHT  # noqa: E402
from gpucache.decode._core import decode_batch  # noqa: E402
from gpucache.decode._device import normalize_device  # noqa: E402
from gpucache.decode._jpeg import quiet_torchvision_deprecation  # noqa: E402
from gpucache.decode._options import DEFAULTS, DecodeOptions  # noqa: E402
from gpucache.decode.gpu._batched import default_decoder, torchvision_decoder  # noqa: E402
from gpucache.decode.gpu._nvjpeg import NvjpegBackend  # noqa: E402
from gpucache.testing import cached_jpeg_folder  # noqa: E402
from gpucache.transforms._orientation import orient  # noqa: E402
from tests.support.emulated_cuda import EmulatedCuda  # noqa: E402

TOLERANCE = parts.TOLERANCE  # mean absolute difference in levels, decoder IDCT/upsampling
TRAIN = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip()])
VAL = T.Compose([T.Resize(256), T.CenterCrop(224)])
NORMALIZE = T.Normalize((0.5,) * 3, (0.25,) * 3)
#: Each part's share of --budget-s (a part runs at least its minimum past it; see the doc).
SHARES = {
    "correctness": 0.05,
    "ordering": 0.06,
    "transforms": 0.06,
    "rate": 0.06,  # each contender
    "cpu rate": 0.06,
    "overlap": 0.1,
    "memory": 0.07,
    "shapes": 0.05,
    "fill": 0.03,
    "syncs": 0.02,
    "decoders": 0.06,
    "tier": 0.04,
}
#: The parts' kinds, by name (a backend's name stripped), for their shares and hang watch.
_KIND = {
    "vs cpu": "correctness",
    "ordering": "ordering",
    "transforms": "transforms",
    "throughput": "rate",
    "overlap": "overlap",
    "memory": "memory",
    "shapes": "shapes",
    "fill": "fill",
    "syncs": "syncs",
    "decoders": "decoders",
    "device tier": "tier",
}
DALI_DISTRIBUTIONS = ("nvidia-dali-cuda130", "nvidia-dali-cuda120", "nvidia-dali-cuda110")


class Check:
    """Settings, the device, the results dict and its JSON file."""

    def __init__(self, args, out: Outputs):
        self.args, self.out = args, out
        self.device = torch.device(args.device)  # as given: the library normalises it
        self.result: dict = {
            "run": run_info(),  # command, date, machine, commit
            "emulated": args.emulate,
            "device": args.device,
            "photos": args.photos,
            "parts": {},
            "errors": {},
            "seconds_per_part": {},
            "finished": False,
        }
        self.t0 = time.perf_counter()
        self.cache: JpegCache  # the synthetic photos (or --folder): correctness, ordering
        self.data: JpegCache  # PHOTOS (else the same): transforms, throughput, overlap, memory
        self.masked: JpegCache  # synthetic photos with masks: shapes, fill, syncs
        self.default_decoders: int | None = None  # the nvjpeg backend's, once throughput ran

    def deadline(self, part: str) -> float:
        return time.perf_counter() + SHARES[part] * self.args.budget_s

    @property
    def decode_device(self) -> torch.device:
        """The device as the backends pass it to a decoder (``cuda`` -> ``cuda:<current>``):
        torchvision keeps one CUDA decoder and makes a new one (leaking the old) whenever the
        device it is given differs from the last one's, so every direct call here uses this."""
        return normalize_device(self.device)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def decoder(self):
        if self.args.emulate:  # torchvision's, which ignores EXIF on CUDA and here alike
            return torchvision_decoder(self.device)
        return default_decoder(self.device)

    def backend(
        self,
        name: str,
        *,
        threaded: bool = True,
        batch: int | None = None,
        cache=None,
        options: DecodeOptions = DEFAULTS,
        decoders: int | None = None,
    ):
        cache = self.cache if cache is None else cache
        if name == "nvjpeg":
            return NvjpegBackend(
                cache,
                device=self.device,
                options=options,
                decoder=self.decoder(),
                threaded=threaded,
                decode_threads=decoders,
            )
        from gpucache.decode.gpu._dali import DaliBackend

        return DaliBackend(
            cache,
            device=self.device_for(name),
            options=options,
            batch_size=batch or self.args.batch,
            num_threads=4,
        )

    def device_for(self, name: str) -> torch.device:
        """DALI cannot run its GPU graph on emulated CUDA: it runs its CPU mode there."""
        return torch.device("cpu") if self.args.emulate and name == "dali" else self.device

    def batches(
        self, backend, transform, *, batch: int, seed: int, shuffle: bool = False, stack=True
    ):
        """(indices as drawn, plans as drawn, Decoded) per batch of the backend's store, as
        many batches in flight as the loader keeps (``GPU_IN_FLIGHT``)."""
        cache = backend.cache
        order = np.random.default_rng(seed).permutation(len(cache)) if shuffle else None
        if order is None:
            order = np.arange(len(cache))
        drawn = [order[k : k + batch] for k in range(0, len(order), batch)]
        s = cache.samples
        plans = [
            transform.plan(
                s["height"][b].astype(np.int64),
                s["width"][b].astype(np.int64),
                np.random.default_rng([seed, k]),
            )
            for k, b in enumerate(drawn)
        ]
        submitted = 0
        for k in range(len(drawn)):
            while submitted < len(drawn) and submitted < k + GPU_IN_FLIGHT:
                backend.submit(drawn[submitted], plans[submitted], stack)
                submitted += 1
            yield drawn[k], plans[k], backend.get()

    def part(self, name: str, fn, *args) -> None:
        if name in self.args.skip.split(","):
            return
        t0 = time.perf_counter()
        print(f"[{t0 - self.t0:6.1f} s] {name} ...", flush=True)
        kind = next((k for key, k in _KIND.items() if name.endswith(key)), "correctness")
        share = SHARES[kind] * self.args.budget_s * (3 if kind == "rate" else 1)
        try:
            with self.out.watch(name, share):
                self.result["parts"][name] = fn(self, *args)
            print(f"    {json.dumps(self.result['parts'][name], default=str)}", flush=True)
        except Exception as err:  # noqa: BLE001 - recorded whole; the next part still runs
            self.result["errors"][name] = text = self.out.error(name, err)
            print(f"    ERROR in {name}:\n{text}", file=sys.stderr, flush=True)
        self.result["seconds_per_part"][name] = round(time.perf_counter() - t0, 2)
        self.write()

    def write(self, *, finished: bool = False) -> None:
        self.result["seconds"] = time.perf_counter() - self.t0
        self.result["finished"] = finished
        parts = self.result["parts"].values()
        self.result["ok"] = not self.result["errors"] and all(p.get("ok", True) for p in parts)
        tmp = self.out.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.result, indent=2, default=str))
        tmp.replace(self.out.json)


def version(*distributions: str) -> str | None:
    """The installed version of the first of ``distributions`` found, or None; read from the
    installed metadata, never from a module (an imported module may be a stand-in, or fail)."""
    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def env(c: Check) -> dict:
    backend = c.backend("nvjpeg", threaded=False)
    try:
        measured, exif_error = backend.measure_applies_exif(), None  # under the backend's streams
    except Exception as err:  # noqa: BLE001 - a decoder that fails: recorded, the probes still run
        measured, exif_error = None, _first_line(err)
    out = {
        "device": (torch.cuda.get_device_name(c.device) if c.device.type == "cuda" else "cpu"),
        "backend_device": str(backend.device),
        "current_device": (torch.cuda.current_device() if c.device.type == "cuda" else None),
        "torch": version("torch"),
        "torchvision": version("torchvision"),
        "torchcodec": version("torchcodec"),
        "dali_version": version(*DALI_DISTRIBUTIONS),
        "decoder": backend.decoder.name,
        "decoder_applies_exif": measured,
        "decoder_error": exif_error,
        "documented_applies_exif": backend.decoder.applies_exif,
        "dali": dali_available(),
        "images": len(c.cache),
        "rotated": int((c.cache.samples["orientation"] > 1).sum()),
    }
    backend.close()
    out["probes"] = probe_decoders(c)
    out["ok"] = (
        exif_error is None
        and backend.decoder.applies_exif in (None, measured)
        and all(p["ok"] for p in out["probes"].values())
    )
    return out


def _first_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def probe_decoders(c: Check) -> dict:
    """One image through each nvJPEG entry point installed, called directly: torchvision's
    ``decode_jpeg([bytes], device=cuda:N)``, and TorchCodec's when it is installed. Whether it
    decoded, to which device, at which size (a sample without an EXIF rotation: its header's)."""
    import torchvision.io

    dev = c.decode_device
    s = c.cache.samples
    candidates = np.flatnonzero(c.cache.gpu_decodable() & (s["orientation"] <= 1))
    if not len(candidates):
        return {"torchvision": {"ok": False, "error": "no sample a GPU decoder takes"}}
    i = int(candidates[0])
    data, want = c.cache._bytes_tensor(i), [3, int(s["height"][i]), int(s["width"][i])]

    def tv():
        quiet_torchvision_deprecation()
        return torchvision.io.decode_jpeg([data], device=dev, mode=torchvision.io.ImageReadMode.RGB)

    def tc():
        from torchcodec.decoders import decode_jpeg

        return decode_jpeg([data], device=str(dev), mode="RGB")

    calls = {"torchvision": tv}
    if version("torchcodec") is not None:
        calls["torchcodec"] = tc
    out = {}
    for name, call in calls.items():
        try:
            (img,) = call()
            c.sync()
            out[name] = {
                "ok": normalize_device(img.device) == dev and list(img.shape) == want,
                "device": str(img.device),
                "shape": list(img.shape),
                "want": want,
                "asked": str(dev),
            }
        except Exception as err:  # noqa: BLE001 - recorded: the run fails on it
            out[name] = {"ok": False, "asked": str(dev), "error": _first_line(err)}
    return out


def correctness(c: Check, name: str) -> dict:
    out, deadline = {}, c.deadline("correctness")
    for label, tf in (("val", VAL), ("train", TRAIN)):
        backend = c.backend(name)
        to_gpu = gpu_allowed(c, backend)
        diffs, maxes, lost, kept, wrong = [], [], [], [], set()
        gpu_decoded = allowed = cpu_decoded = 0
        for k, (idx, plans, got) in enumerate(c.batches(backend, tf, batch=c.args.batch, seed=0)):
            ref = decode_batch(c.cache, idx, plans, stack=True)  # as drawn
            wrong |= _off_device(got.images, c.device_for(name))
            r = compare(ref, got)
            diffs += r["mean_abs_diff"]
            maxes.append(r["max_abs_diff"])
            lost += r["lost_vs_cpu"]
            kept += r["kept_not_cpu"]
            gpu_decoded += len(got.indices) - got.cpu_decoded
            allowed += int(to_gpu[got.indices].sum())
            cpu_decoded += got.cpu_decoded
            if k + 1 == c.args.correctness_batches or time.perf_counter() > deadline:
                break
        backend.close()
        out[label] = {
            "samples": len(diffs),
            "mean_abs_diff_max": max(diffs, default=0.0),
            "mean_abs_diff_median": float(np.median(diffs)) if diffs else 0.0,
            "max_abs_diff": max(maxes, default=0.0),
            "lost_vs_cpu": lost,
            "kept_not_cpu": kept,
            "kept_not_cpu_count": len(kept),
            "off_device": sorted(wrong),
            "gpu_decoded": gpu_decoded,
            "gpu_allowed": allowed,
            "cpu_decoded": cpu_decoded,
            "gpu_ok": 0 < gpu_decoded and allowed <= gpu_decoded,
        }
    out["ok"] = all(
        v["mean_abs_diff_max"] <= TOLERANCE
        and not v["lost_vs_cpu"]
        and v["samples"]
        and not v["off_device"]
        and v["gpu_ok"]
        for v in out.values()
    )
    return out


def gpu_allowed(c: Check, backend) -> np.ndarray:
    """Per sample, whether the backend sends it to its GPU decoder (the rest take the CPU path
    by design): the nvjpeg backend's own mask (it also sends progressive JPEGs to its CPU
    stage), else what :func:`gpucache.decode.gpu._fallback.split` gives a GPU decoder."""
    mask = getattr(backend, "gpu_mask", None)
    return np.asarray(mask if mask is not None else c.cache.gpu_decodable(), dtype=bool)


def _off_device(images, device: torch.device) -> set[str]:
    """Devices other than the backend's (normalised) that the images are on."""
    from gpucache.decode._device import normalize_device

    want = normalize_device(device)
    ims = [images] if isinstance(images, torch.Tensor) else images
    return {str(t.device) for t in ims if normalize_device(t.device) != want}


def compare(ref, got) -> dict:
    """One batch of a backend (``got``) against the CPU decode (``ref``) of the same indices and
    plans: per-image mean absolute difference on the samples both decoded, the samples the
    backend lost (the CPU decoded them) and those it kept that the CPU refused."""
    ref_idx, got_idx = ref.indices.tolist(), got.indices.tolist()
    pos = {i: p for p, i in enumerate(ref_idx)}
    mine = [p for p, i in enumerate(got_idx) if i in pos]
    rows = [pos[got_idx[p]] for p in mine]
    d = (got.images.cpu().float()[mine] - ref.images.float()[rows]).abs() if mine else None
    return {
        "mean_abs_diff": d.mean(dim=(1, 2, 3)).tolist() if d is not None else [],
        "max_abs_diff": d.max().item() if d is not None and d.numel() else 0.0,
        "lost_vs_cpu": sorted(set(ref_idx) - set(got_idx)),
        "kept_not_cpu": sorted(set(got_idx) - set(ref_idx)),
    }


def ordering(c: Check, name: str) -> dict:
    tf, deadline = TRAIN, c.deadline("ordering")
    ref_backend = c.backend(name, threaded=False)
    ref = []
    for k, (_, _, got) in enumerate(c.batches(ref_backend, tf, batch=c.args.batch, seed=2)):
        c.sync()
        ref.append(got.images.to(torch.int64).sum().item())
        if k + 1 == 8:
            break
    ref_backend.close()
    backend = c.backend(name)
    side = getattr(getattr(backend, "_streams", None), "side", None)  # CUDA nvjpeg only
    n = 64 if c.args.emulate else 4096  # emulated: the same calls, a CPU-sized matrix
    heavy = None
    if side is not None:
        with torch.cuda.stream(side):  # made on the stream that uses it: no other stream reads it
            heavy = torch.randn(n, n, device=backend.device)
    sums, done = [], 0
    while done < c.args.iterations and (not done or time.perf_counter() < deadline):
        for k, (_, _, got) in enumerate(c.batches(backend, tf, batch=c.args.batch, seed=2)):
            if side is not None:
                with torch.cuda.stream(side):  # a busy side stream exposes an early reuse
                    for _ in range(4):
                        heavy = torch.tanh(heavy @ heavy)
            sums.append((k, got.images.to(torch.int64).sum()))  # stays on the device
            done += 1
            if k + 1 == len(ref) or done == c.args.iterations:
                break
    backend.close()
    bad = sum(int(s.item()) != ref[k] for k, s in sums)  # one synchronisation, at the end
    return {
        "iterations": done,
        "mismatches": bad,
        "busy_side_stream": side is not None,
        "ok": bad == 0 and done > 0,
    }


TRANSFORM_MAX_DIFF = parts.TRANSFORM_MAX_DIFF  # batched against per-image transforms, levels


def transforms(c: Check) -> dict:
    """The nvjpeg backend's batched transforms (``stack=True``: the matrix products) against
    its per-image path (``stack=False``: ``apply_plan`` on each decoded image) on the same
    decoded batches and plans, with TF32 matmuls off and on: maximum difference and the share
    of values that differ. Then the synchronous backend inside a bfloat16 autocast region
    against outside it, which must be equal (autocast never reaches the pixels)."""
    deadline, out = c.deadline("transforms"), {}
    # emulated: one batch of 8 (the matrix products on CPU tensors cost about 0.1 s a photo)
    n_batches, batch = (1, min(8, c.args.batch)) if c.args.emulate else (2, c.args.batch)
    be = c.backend("nvjpeg", threaded=False, cache=c.data)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        for label, flag in (("tf32_off", False), ("tf32_on", True)):
            torch.backends.cuda.matmul.allow_tf32 = flag
            worst, differ, values, images = 0.0, 0, 0, 0
            batched = _take(c, be, n_batches, batch, stack=True, deadline=deadline)
            single = _take(c, be, len(batched), batch, stack=False, deadline=float("inf"))
            for k, (a, b) in enumerate(zip(batched, single, strict=True)):
                if not np.array_equal(a.indices, b.indices):
                    raise AssertionError(f"batch {k}: the two paths kept different samples")
                d = (a.images.float() - torch.stack(b.images).float()).abs()
                worst = max(worst, float(d.max().item()) if d.numel() else 0.0)
                differ += int((d > 0).sum().item())
                values, images = values + d.numel(), images + len(a.indices)
            out[label] = {
                "images": images,
                "max_abs_diff": worst,
                "share_differing": differ / values if values else None,
            }
        torch.backends.cuda.matmul.allow_tf32 = tf32
        out["autocast_bf16_max_abs_diff"] = _autocast_diff(c, be, batch)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        be.close()
    out["ok"] = (
        all(
            0 < out[k]["images"] and out[k]["max_abs_diff"] <= TRANSFORM_MAX_DIFF
            for k in ("tf32_off", "tf32_on")
        )
        and out["autocast_bf16_max_abs_diff"] == 0
    )
    return out


def _take(c: Check, be, n: int, batch: int, *, stack: bool, deadline: float) -> list:
    """The first ``n`` batches of the PHOTOS store (fewer past ``deadline``), the rest of the
    epoch dropped from the backend."""
    out = []
    for _, _, d in c.batches(be, TRAIN, batch=batch, seed=5, stack=stack):
        out.append(d)
        if len(out) == n or time.perf_counter() > deadline:
            break
    be.drain()
    return out


def _autocast_diff(c: Check, be, batch: int) -> float:
    """One batch of the synchronous backend inside ``torch.autocast(bfloat16)`` (the device's;
    the CPU's where the device is emulated on CPU tensors) against outside it."""
    idx = np.arange(min(batch, len(c.data)))
    s = c.data.samples
    plans = TRAIN.plan(
        s["height"][idx].astype(np.int64),
        s["width"][idx].astype(np.int64),
        np.random.default_rng(9),
    )
    be.submit(idx, plans, True)
    ref = be.get()
    with torch.autocast("cpu" if c.args.emulate else c.device.type, dtype=torch.bfloat16):
        be.submit(idx, plans, True)
        got = be.get()
    d = (got.images.float() - ref.images.float()).abs()
    return float(d.max().item()) if d.numel() else 0.0


def _rate(c: Check, batches, part: str) -> float:
    """Median images/s over epochs of ``batches()`` (a fresh iterator per epoch), warm-up first."""
    deadline, rates = c.deadline(part), []
    for epoch in range(1 + c.args.epochs):
        c.sync()
        t0, n = time.perf_counter(), 0
        for images in batches(epoch):
            n += len(NORMALIZE(images.to(c.device)))
        c.sync()
        if epoch:
            rates.append(n / (time.perf_counter() - t0))
        if time.perf_counter() > deadline and rates:
            break
    return float(np.median(rates))


def _backend_rates(c: Check, name: str) -> dict:
    """Images/s of a backend on the PHOTOS store (nvjpeg: threaded and synchronous; on CUDA also
    threaded at each of the decode stage's concurrencies other than its default)."""
    out, b = {}, c.args.batch
    runs: list[tuple[str, bool, int | None]] = [(f"gpucache {name}", True, None)]
    if name == "nvjpeg":
        runs = [("gpucache nvjpeg threaded", True, None), ("gpucache nvjpeg sync", False, None)]
        if not c.args.emulate:
            runs += [
                (f"gpucache nvjpeg threaded, {k} decoders", True, k)
                for k in gpu_check_decoders.CONCURRENCY
                if k != c.default_decoders
            ]
    for label, threaded, decoders in runs:
        be = c.backend(name, threaded=threaded, cache=c.data, decoders=decoders)
        out[label] = _rate(
            c,
            lambda e, be=be, b=b: (
                d.images for _, _, d in c.batches(be, TRAIN, batch=b, seed=e, shuffle=True)
            ),
            "rate",
        )
        be.close()
    return out


def dali_throughput(c: Check) -> dict:
    return {"img_s": _backend_rates(c, "dali"), "batch": c.args.batch, "photos": len(c.data)}


def throughput(c: Check) -> dict:
    probe = c.backend("nvjpeg", threaded=True, cache=c.data)
    c.default_decoders = probe.decoders  # the decode stage's concurrency for this decoder
    probe.close()
    out, b = _backend_rates(c, "nvjpeg"), c.args.batch
    out["torchvision per-image decode"] = _rate(c, lambda e: _per_image(c, e), "rate")
    workers = os.cpu_count() if not c.args.emulate else 1
    loader = GpuCachedLoader(
        c.data,
        batch_size=b,
        shuffle=True,
        seed=0,
        device="cpu",
        backend="cpu",
        num_workers=workers,
        transform=TRAIN,
    )
    out[f"gpucache cpu ({workers} workers)"] = _rate(
        c, lambda e: (x for x, _ in loader), "cpu rate"
    )
    loader.close()
    return {
        "img_s": out,
        "batch": b,
        "photos": len(c.data),
        "decoders_default": c.default_decoders,
    }


def _per_image(c: Check, epoch: int):
    """The usual GPU decode: torchvision decode_jpeg one image at a time on the current stream,
    then resized_crop (on the backends' indexed device: see :attr:`Check.decode_device`)."""
    import torchvision.io
    import torchvision.transforms.v2.functional as F

    rrc = T.RandomResizedCrop(224)
    rng = np.random.default_rng(epoch)
    cache = c.data
    order = rng.permutation(np.flatnonzero(cache.gpu_decodable()))
    device = c.decode_device
    quiet_torchvision_deprecation()  # torchvision >= 0.29's TorchCodec notice
    for start in range(0, len(order), c.args.batch):
        out = []
        for i in order[start : start + c.args.batch].tolist():
            try:
                img = torchvision.io.decode_jpeg(
                    cache._bytes_tensor(i), device=device, mode=torchvision.io.ImageReadMode.RGB
                )
            except RuntimeError:  # a corrupt sample: skipped, as a training loop would
                continue
            img = orient(img, cache.samples["orientation"][i])
            top, left, h, w = rrc.box(img.shape[1], img.shape[2], rng)
            out.append(F.resized_crop(img, top, left, h, w, [224, 224], antialias=True))
        yield torch.stack(out)


def overlap(c: Check) -> dict:
    device = torch.device("cpu") if c.args.emulate else c.device  # CPU-sized matmul steps
    r = measure_overlap(
        c.data,
        device,
        batch=c.args.batch,
        runs=c.args.overlap_runs,
        step_kind="matmul",
        deadline=c.deadline("overlap"),
    )
    return {k: v for k, v in r.items() if k != "all_s"}


def memory(c: Check, name: str) -> dict:
    """GPU memory after each epoch: torch's allocated and reserved, and the device's used memory
    (``mem_get_info``: also what nvJPEG, TorchCodec and DALI allocate outside torch's caching
    allocator); after two warm-up epochs none may grow by more than MEMORY_GROWTH_MIB (a leak, a
    stream pool that never gives back, a decoder rebuilt and leaked). It runs --memory-epochs
    epochs, stopping earlier (after five) only past three times its share: how many epochs it
    sees must not hang on the machine's speed, since a later epoch may draw a larger crop box."""
    device = c.device_for(name)
    if device.type != "cuda":
        return {"skipped": "GPU memory is measured on CUDA only"}
    backend = c.backend(name, cache=c.data)
    deadline = time.perf_counter() + 3 * SHARES["memory"] * c.args.budget_s
    allocated: list[float] = []
    reserved: list[float] = []
    used: list[float] = []
    for epoch in range(c.args.memory_epochs):
        for _ in c.batches(backend, TRAIN, batch=c.args.batch, seed=epoch, shuffle=True):
            pass
        c.sync()
        allocated.append(torch.cuda.memory_allocated(backend.device) / 2**20)
        reserved.append(torch.cuda.memory_reserved(backend.device) / 2**20)
        free, total = torch.cuda.mem_get_info(backend.device)
        used.append((total - free) / 2**20)
        if time.perf_counter() > deadline and epoch >= 4:
            break
    backend.close()
    return {
        "photos": len(c.data),
        "epochs": len(allocated),
        "allocated_mib": allocated,
        "reserved_mib": reserved,
        "device_used_mib": used,
        **memory_growth(allocated, reserved, used),
    }


MEMORY_GROWTH_MIB = {"allocated": 16.0, "reserved": 64.0, "used": 64.0}


def memory_growth(
    allocated: list[float], reserved: list[float], used: list[float] | None = None
) -> dict:
    """Growth after the two warm-up epochs of torch's allocated and reserved memory and of the
    device's used memory (``used``: from ``mem_get_info``); ok within the bounds."""
    if len(allocated) < 3:
        return {
            "growth_mib": None,
            "reserved_growth_mib": None,
            "used_growth_mib": None,
            "ok": False,
            "why": f"{len(allocated)} epochs measured; need 3 or more",
        }
    growth = max(allocated[2:]) - allocated[2]
    r_growth = max(reserved[2:]) - reserved[2]
    u_growth = max(used[2:]) - used[2] if used else None
    return {
        "growth_mib": growth,
        "reserved_growth_mib": r_growth,
        "used_growth_mib": u_growth,
        "ok": growth <= MEMORY_GROWTH_MIB["allocated"]
        and r_growth <= MEMORY_GROWTH_MIB["reserved"]
        and (u_growth is None or u_growth <= MEMORY_GROWTH_MIB["used"]),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "photos",
        nargs="?",
        help="a folder of real photos for the transforms, throughput, overlap and memory "
        "parts (ImageFolder layout or flat); without it, the synthetic photos",
    )
    ap.add_argument("--out", help="the one folder for every file the check writes")
    ap.add_argument("--json", help="the results (default: OUT/gpu_check.json)")
    ap.add_argument(
        "--max-photos",
        type=int,
        help="photos drawn at most for the data parts (2048; 32 emulated, of the synthetic ones)",
    )
    ap.add_argument(
        "--emulate",
        action="store_true",
        help="CPU only: the CUDA code paths on two emulated GPUs (EmulatedCuda)",
    )
    ap.add_argument(
        "--device",
        default="cuda",
        help="the device as a user passes it: cuda (the current GPU) or cuda:N",
    )
    ap.add_argument("--images", type=int, help="synthetic photos (512; 64 emulated)")
    ap.add_argument("--folder", help="an image folder instead of the synthetic photos")
    ap.add_argument("--batch", type=int, help="batch size (256; 16 emulated)")
    ap.add_argument(
        "--backends",
        default="nvjpeg,dali",
        help="GPU backends to check (dali only when importable)",
    )
    ap.add_argument(
        "--budget-s", type=float, help="time for all parts (120; 60 emulated); see SHARES"
    )
    ap.add_argument("--correctness-batches", type=int, default=4)
    ap.add_argument("--iterations", type=int, default=200, help="ordering-stress batches")
    ap.add_argument("--epochs", type=int, default=2, help="timed epochs per contender")
    ap.add_argument("--overlap-runs", type=int, default=3)
    ap.add_argument("--memory-epochs", type=int, help="memory part's epochs (12; 8 emulated)")
    ap.add_argument(
        "--masked",
        type=int,
        help="synthetic photos with masks for the mask parts (192; 16 emulated)",
    )
    ap.add_argument("--mask-batch", type=int, help="the mask parts' batch size (64; 8 emulated)")
    ap.add_argument("--skip", default="", help="parts to leave out, e.g. throughput,overlap")
    args = ap.parse_args(argv)
    for name, cuda, emulated in (
        ("images", 512, 64),
        ("batch", 256, 16),
        ("budget_s", 120.0, 60.0),
        ("max_photos", 2048, 32),
        ("memory_epochs", 12, 8),
        ("masked", 192, 16),
        ("mask_batch", 64, 8),
    ):
        if getattr(args, name) is None:
            setattr(args, name, emulated if args.emulate else cuda)
    if args.out is None and args.json is None:
        ap.error("name the output folder: --out OUT (or the results file: --json FILE)")
    json_path = Path(args.json) if args.json else None
    out = Outputs(Path(args.out) if args.out else Path(args.json).parent, json_path)
    c = Check(args, out)
    c.write()  # a file exists from the start, whatever happens next
    try:
        c.result["system"] = system(out)  # the real machine, before any emulation
    except Exception as err:  # noqa: BLE001 - recorded; the check still runs
        c.result["errors"]["system"] = out.error("system", err)
    c.write()
    if not args.emulate and not torch.cuda.is_available():
        c.result["errors"]["start"] = "CUDA is not available here"
        c.write(finished=True)
        print(
            "gpu_check: CUDA is not available here (use --emulate for the CPU run).",
            file=sys.stderr,
        )
        return 2
    with EmulatedCuda(devices=2) if args.emulate else contextlib.nullcontext():
        return _run(c)


def photo_store(root: str, limit: int) -> JpegCache:
    """At most ``limit`` photos of ``root`` (ImageFolder layout, or images in one folder),
    drawn at random (seed 0), in a store."""
    from gpucache.ingest._build import IMG_EXTENSIONS, scan_folder

    try:
        found, found_labels, classes = scan_folder(Path(root))
        paths, labels = list(found), list(np.asarray(found_labels).tolist())
    except FileNotFoundError:  # no class folders: the folder's own images
        paths = sorted(
            str(p) for p in Path(root).iterdir() if p.name.lower().endswith(IMG_EXTENSIONS)
        )
        labels, classes = [0] * len(paths), ["photos"]
    if not paths:
        raise FileNotFoundError(f"no images in {root}")
    pick = np.arange(len(paths))
    if len(paths) > limit:
        pick = np.sort(np.random.default_rng(0).choice(len(paths), limit, replace=False))
    return JpegCache.from_files(
        [paths[i] for i in pick.tolist()],
        [labels[i] for i in pick.tolist()],
        classes=classes,
        progress=False,
    )


def _run(c: Check) -> int:
    args = c.args
    try:
        root = args.folder or cached_jpeg_folder(args.images, seed=0)
        c.cache = JpegCache.from_folder(root, progress=False)
        c.data = c.cache
        if args.photos or len(c.cache) > args.max_photos:  # emulated: 32 of the 64
            c.data = photo_store(args.photos or str(root), args.max_photos)
        c.masked = parts.masked_store(args.masked, emulated=args.emulate)
    except Exception as err:  # noqa: BLE001 - recorded in the JSON, then the run stops
        c.result["errors"]["start"] = c.out.error("start", err)
        c.write(finished=True)
        raise
    c.result["photos_in_store"] = len(c.data)
    c.part("env", env)
    names = [n for n in args.backends.split(",") if n == "nvjpeg" or dali_available()]
    c.names = names
    if "nvjpeg" in names:  # first: a DALI that crashes the process costs only its own parts
        c.part("nvjpeg vs cpu", correctness, "nvjpeg")
        c.part("nvjpeg ordering", ordering, "nvjpeg")
        c.part("transforms", transforms)
        c.part("throughput", throughput)
        c.part("overlap", overlap)
        c.part("nvjpeg memory", memory, "nvjpeg")
        c.part("nvjpeg shapes", parts.shapes, "nvjpeg")
        c.part("nvjpeg fill", parts.fill, "nvjpeg")
        c.part("nvjpeg syncs", parts.syncs, "nvjpeg")
        c.part("device tier", gpu_check_tier.device_tier)
    c.part("decoders", gpu_check_decoders.decoders)
    if "dali" in names:
        c.part("dali vs cpu", correctness, "dali")
        c.part("dali ordering", ordering, "dali")
        c.part("dali throughput", dali_throughput)
        c.part("dali memory", memory, "dali")
        c.part("dali shapes", parts.shapes, "dali")
        c.part("dali fill", parts.fill, "dali")
        c.part("dali syncs", parts.syncs, "dali")
    c.write(finished=True)
    for name, seconds in c.result["seconds_per_part"].items():
        state = (
            "ERROR"
            if name in c.result["errors"]
            else "ok"
            if c.result["parts"][name].get("ok", True)
            else "FAIL"
        )
        print(f"  {name:22} {state:5} {seconds:7.1f} s")
    print(
        f"{'PASS' if c.result['ok'] else 'FAIL'} in {c.result['seconds']:.0f} s "
        f"({len(c.result['errors'])} part errors); results in {c.out.folder}"
    )
    return 0 if c.result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
