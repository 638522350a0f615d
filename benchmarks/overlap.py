"""Does decode of batch k+1 overlap the training step on batch k? nvjpeg backend, threaded vs sync.

    PYTHONPATH=. python benchmarks/overlap.py [--images 192] [--batch 32] [--runs 5] [--device cpu]
        [--step matmul|sleep] [--ahead 3]

The same NvjpegBackend code runs on a CPU device here (torch's batched CPU decode_jpeg) and on CUDA
(nvJPEG); the training step is a torch matmul (it releases the GIL, as a real step does), or with
``--step sleep`` a wait, as a host thread waits on its GPU (needs no free core). Per run:
``decode`` = an epoch with no training, ``train`` = the same number of steps with no decoding,
``sync`` = an epoch with ``threaded=False`` (decode in submit, on the training thread), ``threaded``
= the background thread. Expected: sync ~ decode + train, threaded ~ max(decode, train). Medians of
``--runs`` runs, side by side. ``torch.set_num_threads(1)``: one core trains, one decodes.
``--ahead``: batches in flight, as the loader keeps them (default: its ``GPU_IN_FLIGHT``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._record import run_line  # noqa: E402
from gpucache import JpegCache  # noqa: E402
from gpucache import transforms as T  # noqa: E402
from gpucache.decode._base import GPU_IN_FLIGHT  # noqa: E402
from gpucache.decode.gpu._nvjpeg import NvjpegBackend  # noqa: E402
from gpucache.testing import cached_jpeg_folder  # noqa: E402

TRAIN = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip()])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def epoch(backend, cache, batches, step, device: torch.device, ahead: int = GPU_IN_FLIGHT) -> float:
    """Seconds for one epoch as the loader drives a backend (``ahead`` batches in flight)."""
    s = cache.samples
    plans = [
        TRAIN.plan(
            s["height"][b].astype(np.int64),
            s["width"][b].astype(np.int64),
            np.random.default_rng(k),
        )
        for k, b in enumerate(batches)
    ]
    sync(device)
    t0, submitted = time.perf_counter(), 0
    for b in range(len(batches)):
        while submitted < len(batches) and submitted < b + ahead:
            backend.submit(batches[submitted], plans[submitted], True)
            submitted += 1
        out = backend.get()
        assert len(out.indices) + len(out.failed) == len(batches[b])
        if step is not None:
            step(out.images)
    sync(device)
    return time.perf_counter() - t0


def make_step(device: torch.device, seconds: float, kind: str = "matmul"):
    """A training step calibrated to take about ``seconds``: torch matmuls (they need a core of
    their own to overlap), or ``sleep``, a step that waits on an accelerator the way a training
    loop's host thread waits on its GPU (it needs no core)."""
    n = 4096 if device.type == "cuda" else 1024  # a few large ops, not many tiny ones
    a = torch.randn(n, n, device=device) / n**0.5
    if kind == "sleep":
        return lambda images=None: time.sleep(seconds)

    def run(n: int, images=None) -> None:
        x = a
        for _ in range(n):
            x = torch.tanh(x @ a)
        if images is not None:
            x.sum().add_(images.float().mean())

    run(3)
    sync(device)
    t0 = time.perf_counter()
    run(20)
    sync(device)
    n = max(1, round(seconds / ((time.perf_counter() - t0) / 20)))
    return lambda images=None: run(n, images)


def measure(
    cache,
    device: torch.device,
    *,
    batch: int,
    runs: int,
    train_ratio: float = 1.0,
    step_kind: str = "matmul",
    deadline: float = float("inf"),
    ahead: int = GPU_IN_FLIGHT,
) -> dict:
    """Median epoch seconds of decode alone, train alone, sync and threaded; ratios."""
    batches = [np.arange(k, min(k + batch, len(cache))) for k in range(0, len(cache), batch)]
    backends = {
        m: NvjpegBackend(cache, device=device, threaded=m == "threaded")
        for m in ("sync", "threaded")
    }
    epoch(backends["sync"], cache, batches, None, device)  # warm-up: decoder, allocator
    per_batch = epoch(backends["sync"], cache, batches, None, device) / len(batches)
    step = make_step(device, per_batch * train_ratio, step_kind)
    times: dict[str, list[float]] = {"decode": [], "train": [], "sync": [], "threaded": []}
    for _ in range(runs):
        times["decode"].append(epoch(backends["sync"], cache, batches, None, device))
        sync(device)
        t0 = time.perf_counter()
        for _ in batches:
            step()
        sync(device)
        times["train"].append(time.perf_counter() - t0)
        for mode, be in backends.items():
            times[mode].append(epoch(be, cache, batches, step, device, ahead))
        if time.perf_counter() > deadline:
            break
    for be in backends.values():
        be.close()
    control = _parallel_control(step, len(batches), device) if step_kind == "matmul" else None
    med = {k: statistics.median(v) for k, v in times.items()}
    bound = max(med["decode"], med["train"])
    return {
        "runs": len(times["sync"]),
        "batches": len(batches),
        "batch": batch,
        "step": step_kind,
        "ahead": ahead,
        "median_s": med,
        "all_s": times,
        "threaded_over_max": med["threaded"] / bound,
        "sync_over_sum": med["sync"] / (med["decode"] + med["train"]),
        "speedup_threaded_vs_sync": med["sync"] / med["threaded"],
        "parallel_control": control,
    }


def _parallel_control(step, n: int, device: torch.device) -> float:
    """Time of ``n`` steps in each of two threads / ``n`` steps in one: 1.0 when this process
    gets a second core, 2.0 when it does not (then CPU work cannot overlap, whatever the code)."""
    import threading

    def steps() -> None:
        for _ in range(n):
            step()
        sync(device)

    t0 = time.perf_counter()
    steps()
    one = time.perf_counter() - t0
    t0 = time.perf_counter()
    threads = [threading.Thread(target=steps) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return (time.perf_counter() - t0) / one


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=192)
    ap.add_argument("--folder", help="an image folder instead of the synthetic photos")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument(
        "--train-ratio", type=float, default=1.0, help="training step time / decode time per batch"
    )
    ap.add_argument(
        "--step",
        choices=("matmul", "sleep"),
        default="matmul",
        help="training step: torch matmuls (need a free core), or a GPU-like wait",
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--ahead",
        type=int,
        default=GPU_IN_FLIGHT,
        help=f"batches in flight (the loader's: {GPU_IN_FLIGHT})",
    )
    args = ap.parse_args()
    print(run_line(), flush=True)
    torch.set_num_threads(1)
    folder = args.folder or cached_jpeg_folder(args.images, seed=0)
    cache = JpegCache.from_folder(folder, progress=False)
    device = torch.device(args.device)
    r = measure(
        cache,
        device,
        batch=args.batch,
        runs=args.runs,
        train_ratio=args.train_ratio,
        step_kind=args.step,
        ahead=args.ahead,
    )
    m = r["median_s"]
    print(
        f"{len(cache)} images ({folder}), batch {args.batch}, device {device}, "
        f"{os.cpu_count()} cores (load average {os.getloadavg()[0]:.1f}), torch threads 1, "
        f"step {args.step}, {args.ahead} batches in flight, medians of {r['runs']} runs"
    )
    print(f"{'epoch':28} {'seconds':>8}")
    for name, label in (
        ("decode", "decode only"),
        ("train", "train only"),
        ("sync", "sync (decode in submit)"),
        ("threaded", "threaded (background)"),
    ):
        print(f"{label:28} {m[name]:8.3f}")
    print(f"sync / (decode + train)      {r['sync_over_sum']:8.2f}")
    print(f"threaded / max(decode, train) {r['threaded_over_max']:7.2f}")
    print(f"speedup threaded vs sync     {r['speedup_threaded_vs_sync']:8.2f}x")
    if r["parallel_control"] is not None:
        print(
            f"control: 2 threads of steps / 1 {r['parallel_control']:7.2f} (1.0: a free core for "
            "the decode thread; 2.0: none, so CPU work cannot overlap)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
