"""The decoded tier (``GpuCachedLoader(decoded=S)``) on real photos: its build rate, its size per
image, the epoch rate against the raw tier and DataLoader + ImageFolder + PIL, the eval
pipeline's difference from the raw exact decode, and memory under spawn workers.

    PYTHONPATH=. python benchmarks/decoded_tier.py [SRC] [--side 256] [--rounds 3]
        [--epochs 4] [--workers 2] [--copies 2] [--json out.json]

SRC is an ImageFolder tree (default: ../shared/data/hymenoptera, 397 photos, most about
500 x 375, 4:4:4). Four parts, each checked as it is timed:

1. **build**: a store of SRC saved in a fresh node cache folder, then the tier built there
   (``decoded=S``, ``cache_dir=``, the build's own threads: one a usable core): images/s,
   pixel bytes an image against the store's encoded bytes; a second loader reopens it (ms).
2. **epochs**: ``--rounds`` interleaved runs of ``gpucache bench SRC --contenders
   pil,cpu-file-fork,cpu-decoded-fork --decoded S --workers W --no-memory --epochs N`` (train:
   RandomResizedCrop 224 + flip, uint8, batch 64, fork): each round's ratios side by side from
   one run (each contender's median epoch), then the medians over rounds.
3. **eval difference**: ``Resize(S) + CenterCrop(224)`` from the tier against the raw tier with
   ``exact=True`` (labels and order equal; per-image max and mean difference), and
   ``Resize(224) + CenterCrop(224)`` (a second resize, what a crop of the reduced image pays).
4. **spawn memory**: SRC linked ``--copies`` times (about 104 MB of pixels a copy at S = 256),
   a store file, the tier in a node cache folder, 2 spawn workers, RandomResizedCrop 224 + flip,
   two epochs: each worker's private memory (``Private_Dirty``) and the loop process's PSS
   before the first epoch and after the second, on the raw tier and on the decoded tier (a
   spawn worker's interpreter and torch hold the same private memory on both: the difference
   is what the tier costs a worker).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks._record import run_info, run_line, write_json  # noqa: E402

SHARED = ROOT.parent / "shared" / "data" / "hymenoptera"
MiB = 2**20


def _store(src: str, folder: Path):
    from gpucache import JpegCache

    folder.mkdir(parents=True, exist_ok=True)
    return JpegCache.open(JpegCache.from_folder(src, progress=False).save(folder / "s.gpucache"))


def build(src: str, side: int, tmp: Path) -> dict:
    from gpucache import GpuCachedLoader

    cache = _store(src, tmp)
    node = tmp / "node"
    t0 = time.perf_counter()
    loader = GpuCachedLoader(cache, batch_size=64, num_workers=0, decoded=side, cache_dir=node)
    took = time.perf_counter() - t0
    pixels = loader._tier.pixels
    assert loader.tier == "decoded" and pixels.path is not None and pixels.verify()
    t1 = time.perf_counter()
    again = GpuCachedLoader(cache, batch_size=64, num_workers=0, decoded=side, cache_dir=node)
    reopen = time.perf_counter() - t1
    assert again._tier.pixels.path == pixels.path
    n = len(cache)
    return {
        "images": n,
        "build_s": took,
        "build_img_s": n / took,
        "reopen_ms": reopen * 1e3,
        "tier_bytes": pixels.nbytes,
        "tier_bytes_per_image": pixels.nbytes / n,
        "store_bytes_per_image": cache.nbytes / n,
        "decoded_from_store": int((pixels.status != 0).sum()),
    }


def epochs(src: str, side: int, args, tmp: Path) -> dict:
    runs = []
    for r in range(args.rounds):
        out = tmp / f"bench-{r}.json"
        names = ["pil", "cpu-file-fork", "cpu-decoded-fork"]
        cmd = [sys.executable, "-m", "gpucache", "bench", src, "--contenders"]
        cmd += [",".join(names if r % 2 == 0 else names[::-1]), "--decoded", str(side)]
        cmd += ["--workers", str(args.workers), "--no-memory", "--epochs", str(args.epochs)]
        cmd += ["--json", str(out)]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
        report = json.loads(out.read_text())
        rates = {c["name"]: c["summary"]["img_s"] for c in report["main"]["contenders"]}
        row = {
            "round": r,
            "img_s": rates,
            "raw_x_pil": rates["cpu-file-fork"] / rates["pil"],
            "decoded_x_pil": rates["cpu-decoded-fork"] / rates["pil"],
            "decoded_x_raw": rates["cpu-decoded-fork"] / rates["cpu-file-fork"],
            "load_average": report["machine"].get("load_average", [None])[0],
        }
        runs.append(row)
        print(
            f"round {r}: DataLoader+PIL {rates['pil']:.0f} img/s, raw tier "
            f"{rates['cpu-file-fork']:.0f} ({row['raw_x_pil']:.2f}x), decoded tier "
            f"{rates['cpu-decoded-fork']:.0f} ({row['decoded_x_pil']:.2f}x); load "
            f"{row['load_average']}",
            flush=True,
        )
    med = {
        k: statistics.median(r[k] for r in runs) for k in runs[0] if k.endswith(("_pil", "_raw"))
    }
    return {"rounds": runs, "median": med}


def difference(src: str, side: int, tmp: Path) -> dict:
    import torch

    from gpucache import GpuCachedLoader
    from gpucache import transforms as T

    cache = _store(src, tmp)
    out = {}
    for name, tf in (
        (f"Resize({side}) + CenterCrop(224)", [T.Resize(side), T.CenterCrop(224)]),
        ("Resize(224) + CenterCrop(224)", [T.Resize(224), T.CenterCrop(224)]),
    ):
        kw = dict(batch_size=64, num_workers=0, device="cpu", transform=tf)
        with (
            GpuCachedLoader(cache, decoded=side, **kw) as tier,
            GpuCachedLoader(cache, exact=True, **kw) as raw,
        ):
            maxes, means = [], []
            for (x, y), (rx, ry) in zip(tier, raw, strict=True):
                assert torch.equal(y, ry)  # same labels, same order
                d = (x.int() - rx.int()).abs()
                maxes += d.amax(dim=(1, 2, 3)).tolist()
                means += d.float().mean(dim=(1, 2, 3)).tolist()
        out[name] = {
            "max_level": max(maxes),
            "mean_level": statistics.fmean(means),
            "worst_image_mean": max(means),
        }
        print(f"{name}: max {max(maxes)} levels, mean {statistics.fmean(means):.3f}", flush=True)
    return out


def spawn_memory(src: str, side: int, copies: int, tmp: Path) -> dict:
    from gpucache import GpuCachedLoader, JpegCache
    from gpucache import transforms as T
    from gpucache.testing._memory import pss

    paths, labels = [], []
    root = Path(src)
    for k in range(copies):  # the same photos under other names: a larger data set
        for p in sorted(root.rglob("*")):
            if p.is_file():
                link = tmp / "linked" / f"{k}" / p.relative_to(root)
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(p)
                paths.append(str(link))
                labels.append(0 if "ants" in p.parts else 1)
    store = JpegCache.from_files(paths, labels, classes=["ants", "bees"], progress=False)
    cache = JpegCache.open(store.save(tmp / "linked.gpucache"))
    del store
    out = {"images": len(cache)}
    for name, side_or_none in (("raw", None), ("decoded", side)):
        made = pss(os.getpid(), without_libraries=True)
        loader = GpuCachedLoader(
            cache,
            batch_size=64,
            shuffle=True,
            num_workers=2,
            multiprocessing_context="spawn",
            decoded=side_or_none,
            cache_dir=tmp / "node-spawn",
            transform=[T.RandomResizedCrop(224), T.RandomHorizontalFlip()],
        )
        assert loader.tier == name
        before = pss(os.getpid(), without_libraries=True)
        seen = 0
        for _ in range(2):
            for _x, y in loader:
                seen += len(y)
        after = pss(os.getpid(), without_libraries=True)
        assert seen == 2 * len(cache)
        private = loader.stats.worker_private
        out[name] = {
            "tier_mib": 0.0 if loader._tier.pixels is None else loader._tier.pixels.nbytes / MiB,
            "worker_private_mib": [round(v / MiB, 1) for _, v in sorted(private.items())],
            "worker_pss_mib": [
                round(pss(p, without_libraries=True) / MiB, 1) for p in loader.worker_pids
            ],
            "loop_pss_before_loader_mib": made / MiB,
            "loop_pss_before_mib": before / MiB,
            "loop_growth_mib": (after - before) / MiB,
        }
        loader.close()
    raw, dec = out["raw"], out["decoded"]
    out["worker_private_beyond_raw_mib"] = [
        round(d - r, 1) for d, r in zip(dec["worker_private_mib"], raw["worker_private_mib"])
    ]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src", nargs="?", default=str(SHARED))
    p.add_argument("--side", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--copies", type=int, default=2)
    p.add_argument("--parts", default="build,epochs,difference,memory")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    run = run_info()
    print(run_line(), flush=True)
    result: dict = {"src": args.src, "side": args.side, "workers": args.workers}
    parts = args.parts.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        if "build" in parts:
            result["build"] = b = build(args.src, args.side, t / "b")
            print(
                f"build: {b['images']} images in {b['build_s']:.2f} s ({b['build_img_s']:.0f} "
                f"img/s), {b['tier_bytes_per_image'] / 1e3:.0f} kB an image (store "
                f"{b['store_bytes_per_image'] / 1e3:.0f} kB), reopened in {b['reopen_ms']:.0f} ms",
                flush=True,
            )
        if "epochs" in parts:
            result["epochs"] = e = epochs(args.src, args.side, args, t)
            print("medians:", {k: round(v, 2) for k, v in e["median"].items()}, flush=True)
        if "difference" in parts:
            result["difference"] = difference(args.src, args.side, t / "d")
        if "memory" in parts:
            result["spawn_memory"] = m = spawn_memory(args.src, args.side, args.copies, t)
            print(json.dumps(m, indent=1), flush=True)
    if args.json:
        write_json(args.json, result, run=run)


if __name__ == "__main__":
    main()
