"""Where the CPU train pipeline's time goes, per image on one core, and what the known levers buy.

    python benchmarks/cpu_levers.py SRC [--images 200] [--rounds 5]

Single-threaded, interleaved rounds, medians of the process's CPU time (``time.process_time``, so
other load on a shared machine inflates it far less than wall time); every variant is checked (output shape, and that the
alternative decoders give the same pixels or the stated difference). Rows:
- pil: what DataLoader + ImageFolder + PIL + torchvision v2 RandomResizedCrop runs per image;
- gpucache full: libjpeg-turbo decode (torchcodec) + the plan (crop, uint8 antialiased resize, flip);
- gpucache ROI: decode_batch, which decodes only the crop box (gpucache's compiled libjpeg-turbo
  region decoder; nvImageCodec's CPU backend as well when both are there);
- gpucache restart-marker ROI: the same on a restart-marker store (only the crop's segments decoded);
- decode only: the share of the full path's time that is full-frame JPEG decoding;
- simplejpeg, simplejpeg fast: another libjpeg-turbo binding, accurate and fast-DCT/fast-upsample;
- 1/2-scale decode: libjpeg-turbo DCT scaling, the upper bound of what reduced-size decoding saves;
- gpucache ... scaled decode: ``exact=False``, crops >= 2x their output decoded at 1/2-1/8 scale.
simplejpeg rows are skipped when it is not installed (it is not a gpucache dependency).
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path
from unittest import mock

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks._record
from benchmarks._record import run_line  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", help="ImageFolder root")
    ap.add_argument("--images", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    print(run_line(), flush=True)
    torch.set_num_threads(1)
    import torchvision.transforms.v2 as v2
    from PIL import Image

    from gpucache import JpegCache
    from gpucache import transforms as T
    from gpucache.decode import _roi, _roi_rst
    from gpucache.decode._apply import apply_plan
    from gpucache.decode._core import decode_batch
    from gpucache.decode._options import DecodeOptions
    from gpucache.decode._sample import decode_sample
    from gpucache.ingest._build import restart_store

    cache = JpegCache.from_folder(args.src, progress=False)
    ok = np.flatnonzero(cache.gpu_decodable() & (cache.samples["orientation"] == 1))
    idx = np.random.default_rng(0).choice(ok, min(args.images, len(ok)), replace=False)
    s = cache.samples
    plans = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip()]).plan(
        s["height"][idx].astype(np.int64),
        s["width"][idx].astype(np.int64),
        np.random.default_rng(0),
    )
    pil_t = v2.Compose(
        [v2.RandomResizedCrop(224, antialias=True), v2.RandomHorizontalFlip(), v2.PILToTensor()]
    )

    def pil():
        for i in idx:
            assert pil_t(Image.open(io.BytesIO(cache[i])).convert("RGB")).shape == (3, 224, 224)

    def ours():
        for i, p in zip(idx, plans):
            assert apply_plan(decode_sample(cache, i), p).shape == (3, 224, 224)

    def decode_only():
        for i in idx:
            decode_sample(cache, i)

    def no_c(run):
        def wrapped():
            with mock.patch.object(_roi, "_c_ok", lambda: False):  # the nvImageCodec route
                run()

        return wrapped

    def batch(store, exact=True):
        def run():
            out = decode_batch(
                store, idx, plans, DecodeOptions(on_error="raise", exact=exact), stack=True
            )
            assert out.images.shape == (len(idx), 3, 224, 224)

        return run

    rows = {"pil (DataLoader+PIL per-image work)": pil, "gpucache full decode + plan": ours}
    ref = torch.stack([apply_plan(decode_sample(cache, i), p) for i, p in zip(idx, plans)])
    if _roi.route() is not None:  # checked: ROI output is the full path's, bit for bit
        got = decode_batch(cache, idx, plans, DecodeOptions(on_error="raise"), stack=True)
        assert torch.equal(got.images, ref) and got.roi_decoded > 0
        rows[f"gpucache ROI decode + plan ({_roi.route()})"] = batch(cache)
        if _roi.route() == "libjpeg-turbo":  # reduced-size decode (not bit-exact: see docs)
            rows["gpucache ROI + scaled decode (exact=False)"] = batch(cache, exact=False)
        if _roi.route() == "libjpeg-turbo" and _roi._nvimgcodec is not None:
            rows["gpucache ROI decode + plan (nvimgcodec)"] = no_c(batch(cache))
        if _roi_rst.transcoder_available():
            rst = restart_store(cache)
            print(f"restart-marker store: {rst.nbytes / cache.nbytes - 1:+.1%} bytes")
            got = decode_batch(rst, idx, plans, DecodeOptions(on_error="raise"), stack=True)
            assert torch.equal(got.images, ref) and got.roi_decoded > 0
            rows["gpucache restart-marker ROI + plan"] = batch(rst)
            rows["gpucache restart-marker ROI + scaled decode"] = batch(rst, exact=False)
    rows["gpucache full decode only"] = decode_only
    try:
        import simplejpeg
    except ImportError:
        simplejpeg = None
    if simplejpeg is not None:
        first = simplejpeg.decode_jpeg(cache[idx[0]], colorspace="RGB")
        assert np.array_equal(first, decode_sample(cache, idx[0]).permute(1, 2, 0).numpy())

        def simple(fast=False):
            for i, p in zip(idx, plans):
                a = simplejpeg.decode_jpeg(
                    cache[i], colorspace="RGB", fastdct=fast, fastupsample=fast
                )
                assert apply_plan(torch.from_numpy(a).permute(2, 0, 1), p).shape == (3, 224, 224)

        def half():
            for i in idx:
                h, w = int(s["height"][i]), int(s["width"][i])
                simplejpeg.decode_jpeg(
                    cache[i], colorspace="RGB", min_height=-(-h // 2), min_width=-(-w // 2)
                )

        rows.update(
            {
                "simplejpeg decode + plan": simple,
                "simplejpeg fast DCT/upsampling + plan": lambda: simple(True),
                "simplejpeg decode only": lambda: simple_decode(simplejpeg, cache, idx),
                "simplejpeg 1/2-scale decode only": half,
            }
        )
    times: dict[str, list[float]] = {k: [] for k in rows}
    for _ in range(args.rounds):
        for name, f in rows.items():
            t0 = time.process_time()
            f()
            times[name].append((time.process_time() - t0) / len(idx) * 1e3)
    base = np.median(times[next(iter(rows))])
    print(
        f"{len(idx)} images from {args.src}, one core, CPU time, median of {args.rounds} "
        "interleaved rounds"
    )
    print(f"{'variant':42} {'ms/image':>9} {'img/s':>7} {'vs pil':>7}")
    for name, t in times.items():
        m = float(np.median(t))
        print(f"{name:42} {m:9.2f} {1e3 / m:7.0f} {base / m:7.2f}x")
    k = [_scale(p) for p in plans]
    print(
        f"RandomResizedCrop(224) samples whose crop allows a 1/2-scale decode: "
        f"{sum(x > 1 for x in k)} of {len(k)}"
    )


def simple_decode(simplejpeg, cache, idx) -> None:
    for i in idx:
        simplejpeg.decode_jpeg(cache[i], colorspace="RGB")


def _scale(plan) -> int:
    """Largest power-of-2 DCT scale whose output still covers the crop at the output size."""
    k = 1
    while k < 8 and plan[2] / (2 * k) >= plan[4] and plan[3] / (2 * k) >= plan[5]:
        k *= 2
    return k


if __name__ == "__main__":
    main()
