"""Reduced-size (DCT-scaled) decode: pixel difference against exact decode, and CPU time.

    python benchmarks/scaled_decode.py [--photos DIR] [--images 60] [--rounds 3] [--out JSON]

On real photos (``DIR``, an ImageFolder; ../shared/data/hymenoptera by default) and on 2000 x 1500
mosaics of them (4 x 4 photos resized to 500 x 375, JPEG quality 90, 4:2:0), every sample is run
through a training plan (RandomResizedCrop(224) + flip) and an eval plan (Resize(256) +
CenterCrop(224)) twice: ``exact=True`` (bit-exact with a full decode + the plan) and ``exact=False``
(a crop after the resize is cut before it, and boxes >= 2x the resize target each way decode at
1/2, 1/4 or 1/8). For each scale used it reports
how many samples took it and the absolute difference in levels (mean over pixels, the worst
image's mean, and max),
against the exact output. CPU time per image (``time.process_time``, single thread, medians of
interleaved rounds) for both. Results go to ``--out`` as JSON and are printed as a table.
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image


def mosaics(photos: list[Path], n: int, out: Path) -> list[Path]:
    made = []
    for k in range(n):
        canvas = Image.new("RGB", (2000, 1500))
        for j in range(16):
            with Image.open(photos[(16 * k + j) % len(photos)]) as im:
                canvas.paste(im.convert("RGB").resize((500, 375)), (500 * (j % 4), 375 * (j // 4)))
        p = out / f"mosaic{k:03d}.jpg"
        canvas.save(p, "JPEG", quality=90)
        made.append(p)
    return made


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = Path(__file__).resolve()
    ap.add_argument("--photos", type=Path,
                    default=here.parents[2] / "shared" / "data" / "hymenoptera")
    ap.add_argument("--images", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=here.parent / "results" / "scaled_decode.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from gpucache import JpegCache
    from gpucache import transforms as T
    from gpucache.decode._core import crop_before_resize, decode_batch, reduced_scale

    photos = sorted(args.photos.rglob("*.jpg"))
    pick = photos[::max(1, len(photos) // args.images)][:args.images]
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "load": open("/proc/loadavg")
                     .read().split()[:3], "sets": {}}
    with tempfile.TemporaryDirectory() as tmp:
        sets = {"photos": pick, "mosaics 2000x1500": mosaics(photos, args.images // 2, Path(tmp))}
        for name, files in sets.items():
            cache = JpegCache.from_files(files, progress=False)
            s, idx = cache.samples, np.arange(len(cache))
            hw = (s["height"].astype(np.int64), s["width"].astype(np.int64))
            for mode, t in (("train", T.Compose([T.RandomResizedCrop(224),
                                                   T.RandomHorizontalFlip()])),
                            ("eval", T.Compose([T.Resize(256), T.CenterCrop(224)]))):
                plans = t.plan(*hw, np.random.default_rng(0))
                boxes = [crop_before_resize(p)[2:6] for p in plans.tolist()]  # as decoded
                scales = np.asarray([reduced_scale(*b) for b in boxes])
                want = decode_batch(cache, idx, plans, on_error="raise", stack=True).images
                got = decode_batch(cache, idx, plans, on_error="raise", stack=True,
                                   exact=False).images
                diff = (got.int() - want.int()).abs()
                per = {}
                for d in (1, 2, 4, 8):
                    sel = torch.from_numpy(scales == d)
                    if sel.any():
                        per[f"1/{d}"] = {"samples": int(sel.sum()),
                                         "mean": round(float(diff[sel].float().mean()), 3),
                                         "worst_image_mean": round(float(
                                             diff[sel].float().mean(dim=(1, 2, 3)).max()), 3),
                                         "p99": float(diff[sel].float().quantile(0.99))
                                         if diff[sel].numel() < 16_000_000 else None,
                                         "max": int(diff[sel].max())}
                times = {True: [], False: []}
                for _ in range(args.rounds):
                    for exact in (True, False):
                        t0 = time.process_time()
                        decode_batch(cache, idx, plans, on_error="raise", stack=True, exact=exact)
                        times[exact].append((time.process_time() - t0) / len(idx) * 1e3)
                row = {"per_scale": per, "ms_exact": round(float(np.median(times[True])), 2),
                       "ms_scaled": round(float(np.median(times[False])), 2)}
                row["speedup"] = round(row["ms_exact"] / row["ms_scaled"], 2)
                results["sets"][f"{name} {mode}"] = row
                print(f"{name:18s} {mode:5s} exact {row['ms_exact']:7.2f} ms  scaled "
                      f"{row['ms_scaled']:7.2f} ms  x{row['speedup']:.2f}  "
                      + "  ".join(f"{k}: n={v['samples']} mean {v['mean']} "
                                  f"(worst image {v['worst_image_mean']}) max {v['max']}"
                                  for k, v in per.items()), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
