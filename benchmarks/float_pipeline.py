"""One pass to float or two: what a worker's decode of a batch costs when the batch ends in
Normalize (float32), in one process, one core, on real photos.

    PYTHONPATH=. python benchmarks/float_pipeline.py [SRC] [--rounds 7] [--pipeline train]
        [--json out.json]

SRC is an ImageFolder tree (default: ../shared/data/hymenoptera when present, else 400 generated
photos). The store is built in memory; batches of 64 with the pipeline's plans (train:
RandomResizedCrop 224 + flip; val: Resize 256 + CenterCrop 224), each decoded by
``decode_batch`` (what a cpu worker runs) as:

- ``uint8``: no batch steps (the uint8 pipeline, for reference);
- ``two-pass``: Normalize on the stacked uint8 batch after the decode (``fused_steps`` patched
  to 0): the worker's way without the fold;
- ``one-pass``: Normalize on each sample as soon as it is resized, straight into the float
  batch (the library's way).

Then, per image on the same crops, the resize itself: uint8 resize then Normalize (the two ways
above share it) against a float resize with no rounding to uint8 between (``float-resize``), the
other one-pass way; its values differ from the uint8 path's by the rounding, stated below.

Rounds alternate the modes (the order flips every round); medians of per-batch times. Every
output is checked: one-pass equals two-pass exactly (or the largest difference is printed).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks._record import run_info, run_line, write_json  # noqa: E402

SHARED = ROOT.parent / "shared" / "data" / "hymenoptera"
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def main() -> None:
    import numpy as np
    import torch
    import torch.nn.functional as F

    from gpucache import JpegCache
    from gpucache import transforms as T
    from gpucache.base._plan import AFTER_BOX1
    from gpucache.decode import _apply, _core, _sample
    from gpucache.decode._options import DecodeOptions
    from gpucache.testing import make_jpeg_folder

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src", nargs="?")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--pipeline", choices=("train", "val"), default="train")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    run = run_info()
    print(run_line(), flush=True)
    torch.set_num_threads(1)  # as in a worker
    src = args.src or (str(SHARED) if SHARED.is_dir() else None)
    if src is None:
        src = str(make_jpeg_folder(Path(tempfile.mkdtemp()) / "photos", n=400))
    cache = JpegCache.from_folder(src, progress=False)
    geo = (
        [T.RandomResizedCrop(224), T.RandomHorizontalFlip()]
        if args.pipeline == "train"
        else [T.Resize(256), T.CenterCrop(224)]
    )
    compose = T.Compose(geo)
    norm = T.Normalize(MEAN, STD)
    n = len(cache)
    batches = []
    for b, start in enumerate(range(0, n - args.batch + 1, args.batch)):
        idx = np.arange(start, start + args.batch)
        s = cache.samples
        rng = np.random.default_rng([0, b])
        plans = compose.plan(
            s["height"][idx].astype(np.int64), s["width"][idx].astype(np.int64), rng
        )
        batches.append((idx, plans))

    def run_mode(mode: str) -> tuple[float, list]:
        steps = () if mode == "uint8" else (norm,)
        patch = (
            mock.patch.object(_core, "fused_steps", lambda st: 0) if mode == "two-pass" else None
        )
        outs = []
        with patch if patch is not None else _nothing():
            t0 = time.perf_counter()
            for b, (idx, plans) in enumerate(batches):
                d = _core.decode_batch(
                    cache, idx, plans, DecodeOptions(steps=tuple(steps)), stack=True, key=(0, 0, b)
                )
                outs.append(d.images)
            took = time.perf_counter() - t0
        return took / len(batches), outs

    modes = ["uint8", "two-pass", "one-pass"]
    times: dict[str, list[float]] = {m: [] for m in modes}
    run_mode("one-pass")  # warm-up: page cache, decoder's self-check
    last: dict[str, list] = {}
    for r in range(args.rounds):
        for m in modes if r % 2 == 0 else modes[::-1]:
            t, last[m] = run_mode(m)
            times[m].append(t)
    diff = max(float((a - b).abs().max()) for a, b in zip(last["one-pass"], last["two-pass"]))
    ref = max(float((norm(u) - f).abs().max()) for u, f in zip(last["uint8"], last["one-pass"]))
    res = {m: statistics.median(v) * 1e3 for m, v in times.items()}

    # the resize alone, per image: uint8 resize + Normalize against a float resize + Normalize
    crops = []
    for idx, plans in batches[:2]:
        for i, plan in zip(idx.tolist(), plans.tolist()):
            img = _sample.decode_sample(cache, i)
            t1, l1, h1, w1 = plan[:4]
            crops.append((img[:, t1 : t1 + h1, l1 : l1 + w1].contiguous(), plan))
    scale = (1 / 255) / torch.tensor(STD).view(3, 1, 1)
    bias = -torch.tensor(MEAN).view(3, 1, 1) / torch.tensor(STD).view(3, 1, 1)
    out = torch.empty((len(crops), 3, 224, 224))

    def uint8_resize():
        for k, (x, rest) in enumerate(crops):
            y = _apply.finish_plan(x, rest)
            torch.addcmul(bias, y, scale, out=out[k])

    def float_resize():
        for k, (x, rest) in enumerate(crops):
            rh, rw, t2, l2, h2, w2, flip = rest[AFTER_BOX1]
            y = F.interpolate(x[None].float(), size=(rh, rw), mode="bilinear", antialias=True)[0]
            y = y[:, t2 : t2 + h2, l2 : l2 + w2]
            y = y.flip(-1) if flip else y
            torch.addcmul(bias, y, scale, out=out[k])

    per: dict[str, list[float]] = {"uint8-resize": [], "float-resize": []}
    fns = {"uint8-resize": uint8_resize, "float-resize": float_resize}
    uint8_resize()
    a = out.clone()
    float_resize()
    rounding = float((out - a).abs().max() / scale.min())  # in uint8 levels
    for r in range(args.rounds):
        for name in list(fns) if r % 2 == 0 else list(fns)[::-1]:
            t0 = time.perf_counter()
            fns[name]()
            per[name].append((time.perf_counter() - t0) / len(crops))
    res_img = {k: statistics.median(v) * 1e3 for k, v in per.items()}

    print(
        f"{cache.nbytes / 2**20:.0f} MiB, {n} photos from {src}; {args.pipeline} pipeline, "
        f"{len(batches)} batches of {args.batch}, {args.rounds} rounds (median ms a batch):"
    )
    for m in modes:
        print(f"  {m:<9} {res[m]:8.1f} ms a batch")
    print(
        f"  one-pass saves {res['two-pass'] - res['one-pass']:.1f} ms a batch "
        f"({1 - res['one-pass'] / res['two-pass']:.1%} of two-pass); largest difference "
        f"one-pass vs two-pass: {diff:g}; Normalize of the uint8 batch vs one-pass: {ref:g}"
    )
    print(
        f"  per image: uint8 resize + Normalize {res_img['uint8-resize']:.2f} ms, float resize "
        f"+ Normalize {res_img['float-resize']:.2f} ms; they differ by up to {rounding:.2f} "
        "uint8 levels (the rounding)"
    )
    if args.json:
        write_json(
            args.json,
            {
                "photos": n,
                "src": src,
                "pipeline": args.pipeline,
                "batch": args.batch,
                "rounds": args.rounds,
                "ms_a_batch": res,
                "ms_a_batch_rounds": {m: [t * 1e3 for t in v] for m, v in times.items()},
                "one_vs_two_pass_max_abs_diff": diff,
                "ms_an_image_resize": res_img,
                "float_resize_levels_max": rounding,
            },
            run=run,
        )


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    main()
