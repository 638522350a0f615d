"""The GPU path's host cost: ops a batch, host time an image, and pixels against the per-image path.

    PYTHONPATH=. python benchmarks/batched_transforms.py [--photos DIR] [--rounds 5] [--json F]

Measurements of RandomResizedCrop(224) + RandomHorizontalFlip + Normalize, side by side for
the per-image path (``apply_plan`` on each decoded image, then a stack: what the nvjpeg backend ran
before its batched transforms) and the batched one (:func:`gpucache.transforms._resample.resample`):

1. **ops a batch** at batch 64, 128 and 256: every aten op dispatched in every thread (views and
   the decoder's own calls excluded; each is at least one kernel launch on CUDA) while the nvjpeg
   backend decodes and transforms a batch on the emulated GPU
   (:class:`~tests.support.emulated_cuda.EmulatedCuda`) and ``Normalize`` runs on it, as the
   loader does, and the chunks the batch was cut into (:func:`plan_chunks`);
2. **host time an image**: the batched path's NumPy part, measured on the photos' real sizes and
   plans (median of ``--rounds``), and for both paths a model of the whole host cost: that NumPy
   part + ops an image × ``LAUNCH_US`` (5 µs, the low end of a CUDA launch's host cost; no GPU
   here to time launches);
3. **pixels**: both paths on the decoded photos (CPU tensors), against the per-image path's
   float arithmetic (what CUDA runs) and the CPU backend's fixed-point uint8 resize: largest
   difference in levels and the share of differing values;
4. **candidates** for the batched resize, on CPU tensors at batch 64 (``--skip-candidates`` skips
   it): milliseconds a batch and agreement with the per-image float path for the per-image path
   itself, the two batched matrix products (:func:`resample`), and torchvision's ``roi_align``
   (one op: each output pixel the mean of ``sampling_ratio``² bilinear samples in its bin, on the
   batch zero-padded to its largest photo; the adaptive ratio, ``-1``, and 2);
5. **arithmetic**: the two matrix products' GFLOP a batch over ``--draws`` batches drawn at random
   with their plans (host arithmetic only, :func:`flops`), and their useful share (each image's
   own crop box over the padded ones), cut as :func:`plan_chunks` cuts and as one chunk padded to
   its largest box;
6. **memory** (``--memory-epochs``, 0 skips it): the loader over the photos at batch 256 on an
   emulated 141 GiB GPU (an H200's size): the caching allocator's reserved and allocated memory
   after each epoch.

The photos: ``--photos`` (an ImageFolder tree or a flat folder of JPEGs; default: 397 hymenoptera
photos when ``../shared`` has them, else 256 synthetic photo-size JPEGs).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._record import timed, write_json  # noqa: E402
from gpucache import GpuCachedLoader, JpegCache  # noqa: E402
from gpucache import transforms as T  # noqa: E402
from gpucache.decode._apply import apply_plan  # noqa: E402
from gpucache.decode._core import decode_batch  # noqa: E402
from gpucache.decode._options import DecodeOptions  # noqa: E402
from gpucache.decode._sample import decode_sample  # noqa: E402
from gpucache.decode.gpu._batched import make_decoder, torchvision_decoder  # noqa: E402
from gpucache.decode.gpu._nvjpeg import NvjpegBackend  # noqa: E402
from gpucache.testing import cached_jpeg_folder  # noqa: E402
from gpucache.transforms._chunks import BUDGET_BYTES, flops, plan_chunks  # noqa: E402
from gpucache.transforms._orientation import orient  # noqa: E402
from gpucache.transforms._resample import host_plan, resample  # noqa: E402
from tests.support.emulated_cuda import EmulatedCuda  # noqa: E402

GEOMETRY = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip()])
NORMALIZE = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "hymenoptera"


class OpCounter(TorchDispatchMode):
    """Counts aten ops dispatched (views excluded) while ``active`` in this thread."""

    def __init__(self, counts: dict, lock: threading.Lock, paused: threading.local):
        super().__init__()
        self.counts, self.lock, self.paused = counts, lock, paused

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not getattr(self.paused, "on", False) and not func.is_view:
            name = str(func.overloadpacket)
            with self.lock:
                self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


class CountOps:
    """``with CountOps() as c:`` counts ops in the calling thread and every thread started
    inside; ``c.pause()`` wraps a callable whose ops are not counted (the decoder's own)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._lock, self._paused = threading.Lock(), threading.local()
        self._saved = threading.Thread.run

    def __enter__(self) -> CountOps:
        make = lambda: OpCounter(self.counts, self._lock, self._paused)  # noqa: E731
        run = self._saved

        def run_counted(thread):
            with make():
                run(thread)

        threading.Thread.run = run_counted  # type: ignore[method-assign]
        self._mode = make()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        threading.Thread.run = self._saved  # type: ignore[method-assign]

    def pause(self, fn):
        def paused(*args, **kwargs):
            self._paused.on = True
            try:
                return fn(*args, **kwargs)
            finally:
                self._paused.on = False

        return paused

    def reset(self) -> None:
        with self._lock:
            self.counts.clear()

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def photos(path: str | None) -> JpegCache:
    root = Path(path) if path else SHARED if SHARED.is_dir() else None
    if root is None:
        root = cached_jpeg_folder(256, seed=3)
    return JpegCache.from_folder(root, progress=False, on_error="skip")


def _plans(cache: JpegCache, idx: np.ndarray, seed: int) -> np.ndarray:
    s = cache.samples
    return GEOMETRY.plan(
        s["height"][idx].astype(np.int64),
        s["width"][idx].astype(np.int64),
        np.random.default_rng(seed),
    )


def count_ops(cache: JpegCache, batch: int, *, per_image: bool, batches: int = 3) -> dict:
    """Ops a batch on the emulated GPU, decoder excluded (median of ``batches`` after one
    warm-up batch, which makes Normalize's constants)."""
    jpeg = np.flatnonzero(cache.gpu_decodable() & (cache.samples["kind"] == 1))
    batches += 1
    idx_all = np.resize(jpeg, batch * batches)
    totals, by_op, chunks = [], {}, []
    with EmulatedCuda(devices=1), CountOps() as counter:
        dev = torch.device("cuda", 0)
        tv = torchvision_decoder(dev)
        decoder = make_decoder("counted", dev, counter.pause(tv.decode), applies_exif=False)
        backend = NvjpegBackend(cache, device=dev, decoder=decoder)
        for b in range(batches):
            idx = idx_all[b * batch : (b + 1) * batch]
            plans = _plans(cache, idx, b)
            counter.reset()
            if per_image:
                data = [cache._bytes_tensor(int(i)) for i in idx.tolist()]
                streams = backend._streams
                with streams.on_side():
                    with streams.decoding():
                        imgs = decoder.decode(data)
                    streams.adopt(imgs)
                    o = cache.samples["orientation"]
                    out = torch.stack(
                        [
                            apply_plan(orient(im, o[i]), p).to(dev)
                            for im, i, p in zip(imgs, idx.tolist(), plans)
                        ]
                    )
                    done = streams.record()
                streams.hand_over(done, [out])
            else:
                backend.submit(idx, plans, True)
                out = backend.get().images
            NORMALIZE(out)
            if b:
                totals.append(counter.total)
                elems = cache.samples["height"][idx].astype(np.int64) * cache.samples["width"][idx]
                chunks.append(len(plan_chunks(plans, elems * 3)))
            by_op = dict(counter.counts)
        backend.close()
    return {
        "ops_per_batch": int(statistics.median(totals)),
        "ops_per_image": statistics.median(totals) / batch,
        "chunks": int(statistics.median(chunks)),
        "by_op": dict(sorted(by_op.items(), key=lambda kv: -kv[1])[:8]),
    }


#: Host time a kernel launch costs on CUDA (dispatch + launch), the figure the model uses.
LAUNCH_US = 5.0


def _median_ms(fn, rounds: int):
    """(median milliseconds of ``rounds`` calls after one warm-up, the last result)."""
    times, out = timed(fn, rounds)
    return statistics.median(times) * 1e3, out


def host_time(cache: JpegCache, batch: int, rounds: int) -> dict:
    """Host µs an image: the batched path's NumPy part measured (:func:`host_plan`: the chunks,
    the plans' address parts and filter windows for the photos' real sizes; median of
    ``rounds``), and each
    path's modelled total = that + ops an image × ``LAUNCH_US`` (the per-image path has no NumPy
    part: its host cost is its launches)."""
    idx = np.resize(np.arange(len(cache)), batch)
    s = cache.samples
    shapes = np.stack([s["height"][idx], s["width"][idx]], axis=1).astype(np.int64)
    strides = np.stack(
        [shapes[:, 0] * shapes[:, 1], shapes[:, 1], np.ones(batch, np.int64)], axis=1
    )
    plans = _plans(cache, idx, 0)
    orient = np.ones(batch, dtype=np.int64)
    ms, _ = _median_ms(lambda: host_plan(shapes, strides, plans, orient, BUDGET_BYTES), rounds)
    return {"numpy_us_per_image": ms / batch * 1e3}


def arithmetic(cache: JpegCache, batch: int, draws: int, budget: int = BUDGET_BYTES) -> dict:
    """Matrix-product arithmetic a batch (:func:`flops`, both products) over ``draws`` batches
    drawn at random from the photos with their plans: padded GFLOP a batch (median, p95), the
    useful share (each image's own box over the padded boxes, summed over the draws) and the
    chunks a batch, as :func:`plan_chunks` cuts it and as one chunk (the batch padded to its
    largest box)."""
    s, rng = cache.samples, np.random.default_rng(0)
    out: dict = {}
    for name in ("chunked", "one chunk"):
        padded, useful, chunks = [], 0.0, []
        for d in range(draws):
            idx = rng.choice(len(cache), batch, replace=batch > len(cache))
            plans = _plans(cache, idx, d)
            elems = s["height"][idx].astype(np.int64) * s["width"][idx] * 3
            oh, ow = int(plans[0, 8]), int(plans[0, 9])
            if name == "one chunk":
                boxes = [(len(plans), int(plans[:, 2].max()), int(plans[:, 3].max()))]
            else:
                boxes = [(len(c.rows), *c.box) for c in plan_chunks(plans, elems, budget)]
            padded.append(sum(flops(m, h, w, oh, ow) for m, h, w in boxes) / 1e9)
            useful += float(flops(1, plans[:, 2], plans[:, 3], oh, ow).sum()) / 1e9
            chunks.append(len(boxes))
        out[name] = {
            "gflop_per_batch": statistics.median(padded),
            "gflop_p95": float(np.percentile(padded, 95)),
            "useful_share": useful / sum(padded),
            "chunks_median": statistics.median(chunks),
            "chunks_max": max(chunks),
        }
    return {"batch": batch, "draws": draws, "budget_mib": budget / 2**20, **out}


#: The memory measurement's device: an H200's 141 GiB.
H200_BYTES = 141 * 2**30


def memory(cache: JpegCache, batch: int, epochs: int) -> dict:
    """GPU memory the loader holds: RandomResizedCrop(224) + flip + Normalize on the nvjpeg
    backend over ``epochs`` shuffled epochs of the photos on an emulated 141 GiB device; the
    caching allocator's reserved and allocated bytes after each epoch (the emulated allocator
    reuses whole freed blocks, best fit, and never returns one: its reserved figure only grows)."""
    reserved, allocated = [], []
    with EmulatedCuda(devices=1, total_memory=H200_BYTES):
        loader = GpuCachedLoader(
            cache,
            batch_size=batch,
            shuffle=True,
            seed=0,
            device="cuda",
            backend="nvjpeg",
            transform=[*GEOMETRY.transforms, NORMALIZE],
        )
        with loader:
            for _ in range(epochs):  # each pass plays the next epoch
                for images, _labels in loader:
                    del images
                reserved.append(torch.cuda.memory_reserved() / 2**20)
                allocated.append(torch.cuda.memory_allocated() / 2**20)
    return {
        "batch": batch,
        "epochs": epochs,
        "device_gib": H200_BYTES / 2**30,
        "reserved_mib": reserved,
        "allocated_mib": allocated,
    }


def float_plan(img: torch.Tensor, plan) -> torch.Tensor:
    """apply_plan's arithmetic on a CUDA device (float resize, rounded), on a CPU tensor."""
    t1, l1, h1, w1, rh, rw, t2, l2, h2, w2, flip = (int(v) for v in plan)
    x = img[:, t1 : t1 + h1, l1 : l1 + w1]
    if (rh, rw) != (h1, w1):
        x = F.interpolate(x[None].float(), size=(rh, rw), mode="bilinear", antialias=True)[0]
        x = x.round_().clamp_(0, 255).to(torch.uint8)
    if (t2, l2, h2, w2) != (0, 0, rh, rw):
        x = F.pad(x, (max(0, -l2), max(0, l2 + w2 - rw), max(0, -t2), max(0, t2 + h2 - rh)))
        x = x[:, max(t2, 0) : max(t2, 0) + h2, max(l2, 0) : max(l2, 0) + w2]
    return x.flip(-1) if flip else x


def pixels(cache: JpegCache) -> dict:
    """The batched path against both per-image arithmetics on every photo, 4 draws each."""
    out: dict[str, list] = {"float": [], "uint8": []}
    idx = np.arange(len(cache))
    for seed in range(4):
        plans = _plans(cache, idx, seed)
        stored = [decode_sample(cache, int(i)) for i in idx.tolist()]  # EXIF applied
        got = resample(stored, plans)
        ref_float = torch.stack([float_plan(im, p) for im, p in zip(stored, plans)])
        ref_uint8 = decode_batch(
            cache, idx, plans, DecodeOptions(on_error="raise"), stack=True
        ).images
        for name, ref in (("float", ref_float), ("uint8", ref_uint8)):
            d = (got.int() - ref.int()).abs()
            out[name].append((int(d.max()), float((d > 0).float().mean()), float(d.float().mean())))
    return {
        name: {
            "max_levels": max(r[0] for r in rows),
            "share_differing": max(r[1] for r in rows),
            "mean_levels": max(r[2] for r in rows),
        }
        for name, rows in out.items()
    }


def roi_align_batch(stored: list[torch.Tensor], plans: np.ndarray, ratio: int) -> torch.Tensor:
    """The plans as one ``roi_align`` over the batch zero-padded to its largest photo: each plan's
    second crop mapped back through the resize to a box in the photo, a flip as reversed columns."""
    from torchvision.ops import roi_align

    h = max(int(im.shape[1]) for im in stored)
    w = max(int(im.shape[2]) for im in stored)
    x = torch.zeros(len(stored), 3, h, w)
    for k, im in enumerate(stored):
        x[k, :, : im.shape[1], : im.shape[2]] = im
    p = plans.astype(np.float64)
    sy, sx = p[:, 2] / p[:, 4], p[:, 3] / p[:, 5]  # source pixels an output pixel
    boxes = np.stack(
        [
            np.arange(len(p)),
            p[:, 1] + p[:, 7] * sx,
            p[:, 0] + p[:, 6] * sy,
            p[:, 1] + (p[:, 7] + p[:, 9]) * sx,
            p[:, 0] + (p[:, 6] + p[:, 8]) * sy,
        ],
        axis=1,
    )
    out = roi_align(
        x,
        torch.from_numpy(boxes).float(),
        (int(plans[0, 8]), int(plans[0, 9])),
        sampling_ratio=ratio,
        aligned=True,
    )
    flip = torch.from_numpy(plans[:, 10].astype(bool))[:, None, None, None]
    return torch.where(flip, out.flip(-1), out).round_().clamp_(0, 255).to(torch.uint8)


def candidates(cache: JpegCache, batch: int, rounds: int) -> dict:
    """Each way to run a batch's plans on CPU tensors: ms a batch (median of ``rounds``) and its
    pixels against the per-image float path (what the per-image path runs on CUDA)."""
    idx = np.resize(np.arange(len(cache)), batch)
    plans = _plans(cache, idx, 0)
    stored = [decode_sample(cache, int(i)) for i in idx.tolist()]  # EXIF applied
    ways = {
        "per-image float": lambda: torch.stack([float_plan(im, p) for im, p in zip(stored, plans)]),
        "batched matmuls": lambda: resample(stored, plans),
        "roi_align ratio -1": lambda: roi_align_batch(stored, plans, -1),
        "roi_align ratio 2": lambda: roi_align_batch(stored, plans, 2),
    }
    out, ref = {}, None
    for name, fn in ways.items():
        ms, got = _median_ms(fn, rounds)
        ref = got if ref is None else ref
        d = (got.int() - ref.int()).abs()
        out[name] = {
            "ms_per_batch": ms,
            "max_levels": int(d.max()),
            "share_differing": float((d > 0).float().mean()),
            "share_over_2": float((d > 2).float().mean()),
            "mean_levels": float(d.float().mean()),
        }
    return {"batch": batch, "ways": out}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--photos", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--draws", type=int, default=200, help="batches drawn for the arithmetic")
    ap.add_argument("--memory-epochs", type=int, default=4, help="0 skips the memory part")
    ap.add_argument("--skip-pixels", action="store_true")
    ap.add_argument("--skip-candidates", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cache = photos(args.photos)
    result: dict = {"photos": len(cache), "ops": {}, "host_us_per_image": {}}
    print(f"{len(cache)} photos; RandomResizedCrop(224) + flip + Normalize")
    print(
        f"{'batch':>6} {'path':>10} {'ops/batch':>10} {'ops/image':>10} {'chunks':>7} "
        f"{'numpy us/img':>13} {'model us/img':>13}"
    )
    for batch in args.batches:
        numpy_us = host_time(cache, batch, args.rounds)["numpy_us_per_image"]
        for path in ("per_image", "batched"):
            ops = count_ops(cache, batch, per_image=path == "per_image")
            prep = numpy_us if path == "batched" else 0.0
            model = prep + ops["ops_per_image"] * LAUNCH_US
            result["ops"].setdefault(str(batch), {})[path] = ops
            result["host_us_per_image"].setdefault(str(batch), {})[path] = {
                "numpy": prep,
                "model": model,
            }
            chunks = ops["chunks"] if path == "batched" else "-"
            print(
                f"{batch:>6} {path:>10} {ops['ops_per_batch']:>10} "
                f"{ops['ops_per_image']:>10.2f} {chunks:>7} {prep:>13.1f} {model:>13.1f}",
                flush=True,
            )
    print(f"matrix-product arithmetic, {args.draws} batches drawn at random:")
    result["arithmetic"] = {}
    for batch in args.batches:
        r = result["arithmetic"][str(batch)] = arithmetic(cache, batch, args.draws)
        for name in ("one chunk", "chunked"):
            a = r[name]
            print(
                f"{batch:>6} {name:>10}: {a['gflop_per_batch']:7.1f} GFLOP a batch (p95 "
                f"{a['gflop_p95']:.1f}), {100 * a['useful_share']:.0f}% useful, chunks "
                f"{a['chunks_median']:g} (max {a['chunks_max']})",
                flush=True,
            )
    if args.memory_epochs:
        m = result["memory"] = memory(cache, 256, args.memory_epochs)
        print(
            f"emulated {m['device_gib']:.0f} GiB GPU, batch 256, reserved MiB after each epoch: "
            + ", ".join(f"{v:.0f}" for v in m["reserved_mib"])
            + "; allocated: "
            + ", ".join(f"{v:.0f}" for v in m["allocated_mib"]),
            flush=True,
        )
    if not args.skip_pixels:
        result["pixels"] = pixels(cache)
        for name, r in result["pixels"].items():
            print(
                f"batched vs per-image {name:>5}: max {r['max_levels']} levels, "
                f"{100 * r['share_differing']:.3f}% of values differ, mean {r['mean_levels']:.4f}"
            )
    if not args.skip_candidates:
        result["candidates"] = candidates(cache, 64, args.rounds)
        print("batch 64 on CPU tensors, against the per-image float path:")
        for name, r in result["candidates"]["ways"].items():
            print(
                f"  {name:>20}: {r['ms_per_batch']:7.1f} ms a batch, max {r['max_levels']} "
                f"levels, {100 * r['share_differing']:.2f}% differ, "
                f"{100 * r['share_over_2']:.2f}% by more than 2"
            )
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
