"""The nvjpeg backend's pixels against the cpu backend's on every output shape, flipped.

    PYTHONPATH=. python benchmarks/output_shapes.py [--photos DIR] [--count 64] [--json F]

RandomResizedCrop(size) + RandomHorizontalFlip(p=1) on real photos, sizes taller than wide,
wider than tall and square, batch 16: the nvjpeg backend on the emulated GPU
(:class:`~tests.support.emulated_cuda.EmulatedCuda`: CPU tensors that see devices and streams;
its batched decode is libjpeg-turbo's, so the difference is the batched float resample's alone)
against the cpu backend with ``exact=True`` (the same decode, the fixed-point per-image resize).
Reported per size: the mean and largest absolute difference in levels over every value. A flip
mirrored over the wrong span shows as tens of levels on average.

The photos: ``--photos`` (an ImageFolder tree or a flat folder of JPEGs; default: the
hymenoptera photos when ``../shared`` has them, else synthetic photo-size JPEGs).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from gpucache import GpuCachedLoader, JpegCache
from gpucache import transforms as T
from gpucache.testing import make_jpeg_folder
from tests.support.emulated_cuda import EmulatedCuda

SIZES = [(224, 160), (160, 224), (224, 224)]
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "hymenoptera"


def _store(photos: str | None, count: int, tmp: Path) -> JpegCache:
    root = Path(photos) if photos else SHARED if SHARED.is_dir() else None
    if root is None:
        root = make_jpeg_folder(tmp / "photos", n=count)
    files = sorted(p for p in root.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg"))[:count]
    return JpegCache.from_files(files, progress=False)


def measure(cache: JpegCache, size: tuple[int, int]) -> dict[str, float]:
    kw = dict(
        batch_size=16,
        seed=0,
        exact=True,
        transform=[T.RandomResizedCrop(size), T.RandomHorizontalFlip(1.0)],
    )
    with GpuCachedLoader(cache, device="cpu", backend="cpu", num_workers=0, **kw) as cpu:
        ref = [x for x, _ in cpu]
    with EmulatedCuda(devices=1):
        with GpuCachedLoader(cache, device="cuda", backend="nvjpeg", **kw) as gpu:
            got = [x.cpu() for x, _ in gpu]
    d = torch.cat([(g.int() - r.int()).abs().flatten() for g, r in zip(got, ref, strict=True)])
    return {"mean": float(d.float().mean()), "max": int(d.max()), "images": sum(map(len, got))}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--photos", default=None)
    ap.add_argument("--count", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        cache = _store(args.photos, args.count, Path(tmp))
        result = {f"{h}x{w}": measure(cache, (h, w)) for h, w in SIZES}
    for name, r in result.items():
        print(f"{name} (H x W): mean {r['mean']:.3f}, max {r['max']} levels, {r['images']} images")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
