"""One-call GPU check: correctness, stream-ordering stress, throughput, GPU memory per epoch.

    PYTHONPATH=. python benchmarks/gpu_check.py --json gpu_check.json [--images 1024]

(a) each GPU backend against the CPU decode on the same samples and plans, within tolerance;
(b) 200 iterations of stream-ordering stress (batch checksums vs a synchronized reference while
    the consumer stream is kept busy);
(c) images/s of the ImageNet-style train pipeline at batch 256: nvjpeg, dali (when installed),
    torchvision's per-image GPU decode, and the cpu backend with all cores;
(d) GPU memory after each of 20 epochs.
Prints a table and writes JSON; exits 1 when a check fails, 2 without CUDA. Budget: < 8 min on one H200.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types
from pathlib import Path

try:  # the GPU machine may lack tqdm; the library only uses it for a progress bar
    import tqdm.auto  # noqa: F401
except ImportError:
    stub = types.ModuleType("tqdm.auto")
    stub.tqdm = lambda it=None, **kw: it
    sys.modules["tqdm"] = types.ModuleType("tqdm")
    sys.modules["tqdm.auto"] = stub

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpucache import GpuCachedLoader, JpegCache  # noqa: E402
from gpucache import transforms as T  # noqa: E402
from gpucache.decode import dali_available  # noqa: E402
from gpucache.decode.cpu import decode_batch  # noqa: E402
from gpucache.testing import cached_jpeg_folder  # noqa: E402

TOLERANCE = 3.0  # mean absolute difference in levels, decoder IDCT/upsampling differences
TRAIN = [T.RandomResizedCrop(224), T.RandomHorizontalFlip()]
VAL = [T.Resize(256), T.CenterCrop(224)]


def check_correctness(cache, backend: str) -> dict:
    worst = {}
    for name, tf in (("val", VAL), ("train", TRAIN)):
        loader = GpuCachedLoader(cache, batch_size=64, device="cuda", backend=backend, seed=0,
                                 transform=tf, return_metadata=True)
        diffs, maxes = [], []
        for b, (images, _, info) in enumerate(loader):
            idx = info.indices.numpy()
            ref = decode_batch(cache, idx, loader.plans(0, b, idx), on_error="skip", stack=True)
            d = (images.cpu().float() - ref.images.float()).abs()
            diffs += d.mean(dim=(1, 2, 3)).tolist()
            maxes.append(d.max().item())
            if b == 3:
                break
        loader.close()
        worst[name] = {"mean_abs_diff_max": max(diffs), "mean_abs_diff_median":
                       float(np.median(diffs)), "max_abs_diff": max(maxes)}
    worst["ok"] = all(v["mean_abs_diff_max"] <= TOLERANCE for k, v in worst.items() if k != "ok")
    return worst


def check_ordering(cache, backend: str, iterations: int = 200) -> dict:
    loader = GpuCachedLoader(cache, batch_size=32, device="cuda", backend=backend, seed=2,
                             transform=TRAIN)
    nb = min(len(loader), 8)
    ref = []
    for k, (x, _) in enumerate(loader):
        torch.cuda.synchronize()
        ref.append(x.to(torch.int64).sum().item())
        if k + 1 == nb:
            break
    heavy = torch.randn(4096, 4096, device="cuda")
    bad, done = 0, 0
    while done < iterations:
        loader.set_epoch(0)
        for k, (x, _) in enumerate(loader):
            for _ in range(3):
                heavy = heavy @ heavy / 64  # busy consumer stream: exposes a missing wait
            bad += x.to(torch.int64).sum().item() != ref[k]
            done += 1
            if k + 1 == nb or done == iterations:
                break
    loader.close()
    return {"iterations": done, "mismatches": bad, "ok": bad == 0}


def throughput(cache, backend: str, epochs: int = 2) -> float:
    loader = GpuCachedLoader(cache, batch_size=256, shuffle=True, drop_last=True, seed=0,
                             device="cuda" if backend != "cpu" else "cpu", backend=backend,
                             transform=TRAIN + [T.Normalize((0.5,) * 3, (0.25,) * 3)])
    for _ in loader:  # warm-up epoch: workers, pipelines, allocator
        pass
    rates = []
    for _ in range(epochs):
        t0, n = time.perf_counter(), 0
        for images, labels in loader:
            assert images.shape == (256, 3, 224, 224)
            n += len(labels)
        torch.cuda.synchronize()
        rates.append(n / (time.perf_counter() - t0))
    loader.close()
    return float(np.median(rates))


def torchvision_per_image(cache, epochs: int = 2) -> float:
    """The usual GPU decode: torchvision decode_jpeg one image at a time, then resized_crop."""
    import warnings

    import torchvision.transforms.v2.functional as F
    from torchvision.io import ImageReadMode, decode_jpeg

    warnings.filterwarnings("ignore", category=DeprecationWarning)
    gpu = np.flatnonzero(cache.gpu_decodable())[: (len(cache) // 256) * 256]
    rrc = T.RandomResizedCrop(224)
    rng = np.random.default_rng(0)
    rates = []
    for _ in range(epochs + 1):
        t0 = time.perf_counter()
        for start in range(0, len(gpu), 256):
            out = []
            for i in gpu[start:start + 256].tolist():
                img = decode_jpeg(cache._bytes_tensor(i), mode=ImageReadMode.RGB, device="cuda")
                top, left, h, w = rrc.box(img.shape[1], img.shape[2], rng)
                out.append(F.resized_crop(img, top, left, h, w, [224, 224], antialias=True))
            torch.stack(out)
        torch.cuda.synchronize()
        rates.append(len(gpu) / (time.perf_counter() - t0))
    return float(np.median(rates[1:]))


def memory_per_epoch(cache, backend: str, epochs: int = 20) -> dict:
    loader = GpuCachedLoader(cache, batch_size=256, device="cuda", backend=backend, seed=0,
                             transform=TRAIN)
    allocated, reserved = [], []
    for _ in range(epochs):
        for _ in loader:
            pass
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated() / 2**20)
        reserved.append(torch.cuda.memory_reserved() / 2**20)
    loader.close()
    growth = max(allocated[2:]) - allocated[2]
    return {"allocated_mib": allocated, "reserved_mib": reserved, "growth_mib": growth,
            "ok": growth <= 16}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=1024)
    ap.add_argument("--json", default="gpu_check.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: CUDA is not available here; nothing to check.", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    cache = JpegCache.from_folder(cached_jpeg_folder(args.images, seed=0), progress=False)
    backends = ["nvjpeg"] + (["dali"] if dali_available() else [])
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "images": len(cache), "checks": {},
              "throughput_img_s": {}, "memory": {}}
    import torchvision

    result["torchvision"] = torchvision.__version__
    for b in backends:
        result["checks"][f"{b} vs cpu"] = check_correctness(cache, b)
        result["checks"][f"{b} ordering"] = check_ordering(cache, b)
    for b in backends:
        result["throughput_img_s"][f"gpucache {b}"] = throughput(cache, b)
    result["throughput_img_s"]["torchvision per-image GPU decode"] = torchvision_per_image(cache)
    result["throughput_img_s"][f"gpucache cpu ({os.cpu_count()} workers)"] = throughput(cache, "cpu",
                                                                                      epochs=1)
    for b in backends:
        result["memory"][b] = memory_per_epoch(cache, b)
    result["seconds"] = time.perf_counter() - t_start
    ok = all(c["ok"] for c in result["checks"].values()) and all(
        m["ok"] for m in result["memory"].values())
    result["ok"] = ok
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"{result['gpu']}, torch {result['torch']}, torchvision {result['torchvision']}, "
          f"{result['date']}, {len(cache)} synthetic images")
    print(f"{'check':32} {'result':>40}")
    for name, c in result["checks"].items():
        summary = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in c.items()}
        print(f"{name:32} {json.dumps(summary)}")
    print(f"\n{'pipeline (train, batch 256)':40} {'img/s':>10}")
    for name, rate in result["throughput_img_s"].items():
        print(f"{name:40} {rate:10.0f}")
    for b, m in result["memory"].items():
        print(f"\n{b} GPU memory allocated per epoch (MiB): "
              + " ".join(f"{v:.0f}" for v in m["allocated_mib"]) + f"; growth {m['growth_mib']:.1f}")
    print(f"\n{'PASS' if ok else 'FAIL'} in {result['seconds']:.0f} s; JSON in {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
