"""``exact=False`` against ``exact=True``: per-image pixel difference, and CPU time.

    python benchmarks/scaled_decode.py [--photos DIR] [--images 0] [--mosaics 40] [--seeds 3]
        [--rounds 3] [--variants 2:24:0.05,1:24:inf,1:0:inf] [--hd 1920x1080:16,4000x3000:6]
        [--out JSON]

On real photos (``DIR``, an ImageFolder; ../shared/data/hymenoptera by default; ``--images 0``
takes every JPEG) and on 2000 x 1500 mosaics of them (4 x 4 photos resized to 500 x 375, JPEG
quality 90, 4:2:0), every sample runs through an eval plan (Resize(256) + CenterCrop(224)) and
two training plans (RandomResizedCrop(224) and RandomResizedCrop(32), + flip; ``--seeds``
draws each), once with ``exact=True`` (bit-exact with a full decode + the plan) and once per
variant with ``exact=False``. A variant ``m:c:s`` sets, in ``gpucache.decode._scaled``, the DCT
scale's margin (the box must keep m scaled pixels per output pixel: ``SCALE_MARGIN``), the context
an edge may look through for one on the scale's grid (c output pixels, ``_CONTEXT``; 0: a crop
after a resize is not cut, and training boxes' edges round to the nearest scaled pixel), and the
most an edge may shift the samples before the next finer scale is taken (s output pixels,
``_MAX_SHIFT``; inf: never). The first variant is the library's; ``1:24:inf`` is the rule
before 2026-12-02 for eval, ``1:0:inf`` for training.

``--hd WxH:N,...`` measures generated HD photos instead (N of each size, photo-like images of
``gpucache.testing.make_jpeg_bytes``, quality 90, 4:2:0, each its own seed): the sets where the
photo is much larger than the output and the DCT scale decides the speed.

Reported per set, plan and variant: how many samples took each scale; the distribution over
samples of the mean absolute difference (levels) against the exact output (median, p90, p99,
max) with the worst samples named (file, size, scale); CPU ms per sample
(``time.process_time``, one thread, median of interleaved rounds over the whole set) exact and
``exact=False``. Results go to ``--out`` as JSON and are printed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # benchmarks._record
from benchmarks._record import run_info, run_line, write_json  # noqa: E402


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


def hd(spec: str, out: Path) -> list[Path]:
    """``WxH:N``: N generated photo-like JPEGs of W x H (quality 90, 4:2:0), seeds 0..N-1."""
    from gpucache.testing import make_jpeg_bytes

    size, n = spec.split(":")
    w, h = (int(x) for x in size.split("x"))
    made = []
    for k in range(int(n)):
        p = out / f"hd{w}x{h}-{k:03d}.jpg"
        p.write_bytes(make_jpeg_bytes(w, h, seed=k, quality=90))
        made.append(p)
    return made


def _variant(spec: str) -> tuple[float, int, float]:
    m, c, *shift = spec.split(":")
    return float(m), int(c), float(shift[0]) if shift else 0.05


def _name(v: tuple[float, int, float]) -> str:
    return f"{v[0]:g}:{v[1]}:{v[2]:g}"


def _set_variant(margin: float, context: int, shift: float) -> None:
    from gpucache.decode import _scaled

    _scaled.SCALE_MARGIN, _scaled._CONTEXT, _scaled._MAX_SHIFT = margin, context, shift
    _scaled._cut.cache_clear()


def _timed(cache, idx, plans, exact: bool) -> tuple[torch.Tensor, float]:
    from gpucache.decode._core import decode_batch
    from gpucache.decode._options import DecodeOptions

    t0 = time.process_time()
    out = decode_batch(
        cache, idx, plans, DecodeOptions(on_error="raise", exact=exact), stack=True
    ).images
    return out, (time.process_time() - t0) / len(idx) * 1e3


def run_plan(cache, idx, plans, variants, rounds: int) -> dict:
    """The rows of one set and plan: each variant's difference distribution and times."""
    from gpucache.decode._scaled import fast_plan

    s = cache.samples
    want, _ = _timed(cache, idx, plans, True)
    rows, times = {}, {"exact": []}
    for v in variants:
        _set_variant(*v)
        got, _ = _timed(cache, idx, plans, False)
        per = (got.int() - want.int()).abs().float().mean(dim=(1, 2, 3)).numpy()
        scales = np.asarray(
            [
                fast_plan(p, int(s["height"][i]), int(s["width"][i]), scalable=True)[1]
                for p, i in zip(plans.tolist(), idx)
            ]
        )
        worst = np.argsort(per)[::-1][:5]
        q = np.percentile(per, [50, 90, 99, 100])
        rows[_name(v)] = {
            "scales": {
                f"1/{d}": int((scales == d).sum()) for d in (1, 2, 4, 8) if (scales == d).any()
            },
            "median": round(float(q[0]), 3),
            "p90": round(float(q[1]), 3),
            "p99": round(float(q[2]), 3),
            "max": round(float(q[3]), 3),
            "over_1.5": int((per > 1.5).sum()),
            "worst": [
                {
                    "file": Path(cache.paths[idx[k]]).name,
                    "mean": round(float(per[k]), 3),
                    "size": [int(s["height"][idx[k]]), int(s["width"][idx[k]])],
                    "scale": f"1/{scales[k]}",
                }
                for k in worst
            ],
        }
        times[_name(v)] = []
    for _ in range(rounds):  # interleaved, so load changes hit every variant alike
        times["exact"].append(_timed(cache, idx, plans, True)[1])
        for v in variants:
            _set_variant(*v)
            times[_name(v)].append(_timed(cache, idx, plans, False)[1])
    ms = {k: round(float(np.median(t)), 3) for k, t in times.items()}
    for k, row in rows.items():
        row["ms"] = ms[k]
        row["speedup"] = round(ms["exact"] / ms[k], 2)
    _set_variant(*variants[0])
    return {"ms_exact": ms["exact"], "variants": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = Path(__file__).resolve()
    ap.add_argument(
        "--photos", type=Path, default=here.parents[2] / "shared" / "data" / "hymenoptera"
    )
    ap.add_argument("--images", type=int, default=0, help="photos to take (0: all)")
    ap.add_argument("--mosaics", type=int, default=40)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default="2:24:0.05,1:24:inf,1:0:inf")
    ap.add_argument("--hd", help="WxH:N,... generated HD photos instead of photos and mosaics")
    ap.add_argument("--out", type=Path, default=here.parent / "results" / "scaled_decode.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from gpucache import JpegCache
    from gpucache import transforms as T
    from gpucache.decode import _scaled

    variants = [_variant(v) for v in args.variants.split(",")]
    photos = sorted(p for p in args.photos.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg"))
    if not photos:
        raise SystemExit(f"no JPEG under {args.photos}; give an ImageFolder with --photos")
    pick = (
        photos if args.images <= 0 else photos[:: max(1, len(photos) // args.images)][: args.images]
    )
    run = run_info()
    print(run_line(), flush=True)
    results: dict = {
        "load": open("/proc/loadavg").read().split()[:3],
        "library_variant": _name((_scaled.SCALE_MARGIN, _scaled._CONTEXT, _scaled._MAX_SHIFT)),
        "seeds": args.seeds,
        "sets": {},
    }
    plans_made = {
        "eval": T.Compose([T.Resize(256), T.CenterCrop(224)]),
        "RandomResizedCrop(224)": T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip()]),
        "RandomResizedCrop(32)": T.Compose([T.RandomResizedCrop(32), T.RandomHorizontalFlip()]),
    }
    with tempfile.TemporaryDirectory() as tmp:
        if args.hd:
            sets = {f"HD {spec.split(':')[0]}": hd(spec, Path(tmp)) for spec in args.hd.split(",")}
        else:
            sets = {
                "photos": pick,
                "mosaics 2000x1500": mosaics(photos, args.mosaics, Path(tmp)),
            }
        for name, files in sets.items():
            cache = JpegCache.from_files(files, progress=False)
            s = cache.samples
            for mode, t in plans_made.items():
                seeds = 1 if mode == "eval" else args.seeds  # eval plans draw nothing
                idx = np.tile(np.arange(len(cache)), seeds)
                hw = (s["height"][idx].astype(np.int64), s["width"][idx].astype(np.int64))
                plans = t.plan(*hw, np.random.default_rng(0))
                row = run_plan(cache, idx, plans, variants, args.rounds)
                results["sets"][f"{name} {mode}"] = row
                for v, r in row["variants"].items():
                    print(
                        f"{name:17s} {mode:22s} {v:5s} {r['scales']}  per-sample mean |diff| "
                        f"median {r['median']} p90 {r['p90']} p99 {r['p99']} max {r['max']} "
                        f"({r['worst'][0]['file']} {r['worst'][0]['size']} at "
                        f"{r['worst'][0]['scale']})  ms {row['ms_exact']} -> {r['ms']} "
                        f"x{r['speedup']}",
                        flush=True,
                    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, results, run=run)


if __name__ == "__main__":
    main()
