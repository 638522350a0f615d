"""The device check's part on the device tier (for ``gpu_check.py``).

(p) **device tier**: the data store's decoded tier (``decoded=256``; 64 emulated) held on the
    GPU (``device_budget=0.5`` of its free memory), RandomResizedCrop 224 + flip: the first
    batches against the same loader on the CPU (the cpu backend cutting the same tier's pixels:
    the batched resample's float filter against the CPU's fixed-point one, at most one level
    apart), the tier's device bytes against its size, the device memory the loader's process
    has allocated, host syncs a batch on the loader's thread (emulated: every synchronisation
    the emulation models; on CUDA: torch's sync debug mode), and images/s (median epoch after a
    warm-up) beside the raw tier's nvjpeg loader on the same photos.
"""

from __future__ import annotations

import time
import warnings

import numpy as np
import torch

from benchmarks.gpu_check_parts import HostSyncs
from gpucache import GpuCachedLoader
from gpucache import transforms as T

#: Largest difference in levels between the device tier's batch and the cpu backend's on the
#: same tier (the batched resample rounds a float filter; the CPU's kernel is fixed-point).
MAX_DIFF = 1


def _loader(c, side: int, **kw) -> GpuCachedLoader:
    return GpuCachedLoader(
        c.data,
        batch_size=c.args.batch,
        shuffle=True,
        seed=0,
        decoded=side,
        transform=[T.RandomResizedCrop(224), T.RandomHorizontalFlip()],
        **kw,
    )


def _rate(c, loader: GpuCachedLoader, deadline: float) -> float:
    rates = []
    for epoch in range(1 + c.args.epochs):
        c.sync()
        t0, n = time.perf_counter(), 0
        for x, _ in loader:
            n += len(x)
        c.sync()
        if epoch:
            rates.append(n / (time.perf_counter() - t0))
        if time.perf_counter() > deadline and rates:
            break
    return float(np.median(rates))


def device_tier(c) -> dict:
    side = 64 if c.args.emulate else 256
    deadline = c.deadline("tier")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a tier that does not fit says so: recorded below
        cpu = _loader(c, side, device="cpu", backend="cpu", num_workers=0)
        gpu = _loader(c, side, device=c.device, device_budget=0.5)
    out: dict = {"tier": gpu.tier, "reason": gpu.tier_reason, "side": side}
    with cpu, gpu:
        worst, means = 0, []
        for (x, y), (rx, ry), _ in zip(gpu, cpu, range(2)):
            assert torch.equal(y.cpu(), ry), "labels differ"
            d = (x.cpu().int() - rx.int()).abs()
            worst, means = max(worst, int(d.max())), [*means, float(d.float().mean())]
        held = getattr(gpu._backend, "device_bytes", 0)
        out.update(
            max_diff=worst,
            mean_diff=float(np.mean(means)) if means else None,
            tier_mib=gpu._tier.pixels.nbytes / 2**20 if gpu._tier.pixels is not None else 0.0,
            device_tier_mib=held / 2**20,
            allocated_mib=torch.cuda.memory_allocated(c.device) / 2**20,
            host_syncs_per_batch=_syncs_per_batch(gpu),
            img_s=_rate(c, gpu, deadline),
        )
    raw = GpuCachedLoader(
        c.data,
        batch_size=c.args.batch,
        shuffle=True,
        seed=0,
        device=c.device,
        transform=[T.RandomResizedCrop(224), T.RandomHorizontalFlip()],
    )
    with raw:
        out["raw_nvjpeg_img_s"] = _rate(c, raw, deadline + 5)
    loop = out["host_syncs_per_batch"].get("MainThread", 0.0)
    out["ok"] = (
        out["tier"] == "device"
        and worst <= MAX_DIFF
        and held == out["tier_mib"] * 2**20
        and not loop
    )
    return out


def _syncs_per_batch(loader: GpuCachedLoader) -> dict:
    """Host synchronisations a batch over one epoch, by thread (the loader runs on this one)."""
    with HostSyncs() as syncs:
        n = sum(1 for _ in loader)
    return {k: v / max(1, n) for k, v in sorted(syncs.by_thread.items())}
