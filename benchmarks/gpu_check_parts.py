"""The device check's parts on output shapes, masks and fill (for ``gpu_check.py``).

(s) **shapes**: each GPU backend with masks, batched, against the cpu decode
    (:func:`gpucache.decode._core.decode_batch`) and, for nvjpeg, against its per-image path, on
    outputs taller than wide, wider than tall and square (:data:`SIZES`), every sample flipped
    (``RandomHorizontalFlip(p=1)``): the images' mean and largest difference, the masks' share of
    values that differ, and the *alignment IoU* of each image with its mask. The photos are
    synthetic: a bright ellipse off the centre on a dark textured ground, its mask the ellipse
    (:func:`masked_folder`), so an image thresholded at mid-grey should be its mask; a flip or a
    crop that moves the pixels and not the mask (or the other way round) drops the IoU far below
    the cpu decode's.
(f) **fill**: ``Letterbox`` onto both non-square sizes through the loader with ``fill`` and
    ``mask_fill`` not 0: every padded value is the fill, the rest matches the cpu loader, and the
    host syncs the loader's thread made (see below).
(y) **syncs**: the loader's second epoch with masks, ``RandomResizedCrop((224, 160))`` and a
    flip: host synchronisations a batch, by thread (the loader's own, the backend's transform
    thread: both must be 0; the decoding threads wait for their allocation stream by design).

The decoders part is :mod:`benchmarks.gpu_check_decoders`. Host syncs are counted by the emulation (every synchronisation it models, by thread) or, on
CUDA, by torch's sync debug mode (``torch.cuda.set_sync_debug_mode("warn")``: the synchronising
calls torch makes, ``.item()``, ``.cpu()``, blocking and pageable copies, ``synchronize()``; not
those a decoder makes inside its own C++).
"""

from __future__ import annotations

import collections
import tempfile
import threading
import warnings
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

from gpucache import GpuCachedLoader, JpegCache
from gpucache import transforms as T
from gpucache.decode._core import decode_batch
from gpucache.decode._options import DecodeOptions
from gpucache.testing import natural_image
from tests.support.emulated_cuda import EmulatedCuda

#: Output sizes (H, W): taller than wide, wider than tall, square.
SIZES = ((224, 160), (160, 224), (224, 224))
FILL, MASK_FILL = 114, 255  # neither 0: a fill left at zero shows
#: Least mean alignment IoU over a size's samples, and how far a sample's may fall short of the
#: cpu decode's (the synthetic ellipses: about 0.95 when aligned; a shift of a quarter of the
#: width takes it under 0.6).
IOU_MEAN, IOU_GAP = 0.8, 0.05
#: Share of mask values that may differ from the cpu decode's (nearest neighbour on the same
#: sample grid: none expected).
MASK_SHARE = 0.001
TOLERANCE = 3.0  # mean absolute difference in levels, decoder IDCT/upsampling differences
#: Batched against per-image transforms, levels: what the manual states (the float filter both
#: run, in different orders of arithmetic).
TRANSFORM_MAX_DIFF = 1.0


# ------------------------------------------------------------------ data
def masked_folder(n: int, *, sides: tuple[int, int] = (200, 420), seed: int = 0) -> Path:
    """``n`` synthetic photos with masks (``images/``, ``masks/``), made once into the temporary
    folder and reused: a bright textured ellipse off the centre (mask 1) on a dark textured
    ground (mask 0), JPEG quality 92, 4:2:0; each side drawn from ``sides`` (both
    orientations)."""
    lo, hi = sides
    root = Path(tempfile.gettempdir()) / f"gpucache-gpu-check-masked-{n}-{lo}-{hi}-{seed}"
    done = root / "done"
    if done.exists():
        return root
    images, masks = root / "images", root / "masks"
    images.mkdir(parents=True, exist_ok=True)
    masks.mkdir(exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(n):
        w, h = (int(v) for v in rng.integers(lo, hi + 1, 2))
        texture = natural_image(w, h, seed=seed * 1000 + i).astype(np.float32)
        mask = Image.new("L", (w, h), 0)
        cx = w * rng.uniform(0.28, 0.4) if i % 2 else w * rng.uniform(0.6, 0.72)
        cy, rx, ry = h * rng.uniform(0.35, 0.65), w * rng.uniform(0.15, 0.25), h * 0.25
        ImageDraw.Draw(mask).ellipse((cx - rx, cy - ry, cx + rx, cy + ry), fill=1)
        inside = np.asarray(mask, dtype=bool)[..., None]
        pixels = np.where(inside, 175 + texture * 0.3, texture * 0.3).clip(0, 255)
        name = f"m{i:04d}"
        Image.fromarray(pixels.astype(np.uint8)).save(images / f"{name}.jpg", quality=92)
        mask.save(masks / f"{name}.png")
    done.write_text("")
    return root


def masked_store(n: int, *, emulated: bool) -> JpegCache:
    """The mask parts' store: photo-size under CUDA; smaller emulated, where the batched
    transforms run on CPU tensors."""
    root = masked_folder(n, sides=(120, 240) if emulated else (200, 420))
    return JpegCache.from_folder(root / "images", masks=root / "masks", progress=False)


# ------------------------------------------------------------------ host syncs
class HostSyncs:
    """``with HostSyncs() as s:`` -> ``s.by_thread``: host synchronisations made inside, by
    thread name (a pool's ``_N`` suffix dropped): the emulation's record of them, or on CUDA
    those torch's sync debug mode warns about."""

    def __init__(self) -> None:
        self.by_thread: collections.Counter[str] = collections.Counter()
        self._emu: EmulatedCuda | None = None
        self._start = 0

    @staticmethod
    def _group(name: str) -> str:
        head, _, tail = name.rpartition("_")
        return head if head and tail.isdigit() else name

    def __enter__(self) -> HostSyncs:
        self._emu = EmulatedCuda._active
        if self._emu is not None:
            self._start = len(self._emu.host_syncs)
            return self
        if torch.cuda.is_available():
            self._mode = torch.cuda.get_sync_debug_mode()
            self._warnings = warnings.catch_warnings()
            self._warnings.__enter__()
            warnings.simplefilter("always")
            shown = warnings.showwarning

            def show(message, category, filename, lineno, file=None, line=None):
                if "synchroniz" in str(message):
                    self.by_thread[self._group(threading.current_thread().name)] += 1
                else:
                    shown(message, category, filename, lineno, file, line)

            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        if self._emu is not None:
            for h in self._emu.host_syncs[self._start :]:
                self.by_thread[self._group(h.thread)] += 1
            return
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode(self._mode)
            self._warnings.__exit__(*exc)


# ------------------------------------------------------------------ (s) shapes
def _iou(images: torch.Tensor, masks: torch.Tensor) -> list[float]:
    """Per sample, the IoU of the image thresholded at mid-grey with its mask's ellipse (padding,
    ``MASK_FILL``, left out); NaN where neither has a pixel."""
    pred = images.float().mean(dim=1) > 128
    inside, valid = masks == 1, masks != MASK_FILL
    inter = (pred & inside & valid).sum(dim=(1, 2)).float()
    union = ((pred | inside) & valid).sum(dim=(1, 2)).float()
    return (inter / union.clamp(min=1)).masked_fill(union == 0, float("nan")).tolist()


def shapes(c, name: str) -> dict:
    """See the module doc, (s)."""
    cache, out = c.masked, {}
    opts = DecodeOptions(masks=True, mask_fill=MASK_FILL)
    for h, w in SIZES:
        tf = T.Compose([T.RandomResizedCrop((h, w), scale=(0.4, 1.0)), T.RandomHorizontalFlip(1.0)])
        b = c.args.mask_batch
        be = c.backend(name, cache=cache, options=opts, batch=b)
        batched = list(c.batches(be, tf, batch=b, seed=11))
        be.close()
        single = None
        if name == "nvjpeg":
            be = c.backend(name, cache=cache, options=opts)
            single = [d for *_, d in c.batches(be, tf, batch=b, seed=11, stack=False)]
            be.close()
        means, worst, mask_diff, values, gpu_iou, cpu_iou = [], 0.0, 0, 0, [], []
        per_image_max, per_image_masks, lost = 0.0, 0, []
        for k, (idx, plans, got) in enumerate(batched):
            ref = decode_batch(cache, idx, plans, opts, stack=True)
            if not np.array_equal(ref.indices, got.indices):
                lost += sorted(set(ref.indices.tolist()) ^ set(got.indices.tolist()))
                continue
            images, masks = got.images.cpu(), got.masks.cpu()
            d = (images.float() - ref.images.float()).abs()
            means += d.mean(dim=(1, 2, 3)).tolist()
            worst = max(worst, float(d.max()))
            mask_diff += int((masks != ref.masks).sum())
            values += masks.numel()
            gpu_iou += _iou(images, masks)
            cpu_iou += _iou(ref.images, ref.masks)
            if single is not None:
                one = single[k]
                per_image_max = max(
                    per_image_max,
                    float((torch.stack(one.images).cpu().float() - images.float()).abs().max()),
                )
                per_image_masks += int((torch.stack(one.masks).cpu() != masks).sum())
        g, r = np.asarray(gpu_iou), np.asarray(cpu_iou)
        both = ~(np.isnan(g) | np.isnan(r))
        res = {
            "samples": len(means),
            "mean_abs_diff_max": max(means, default=0.0),
            "max_abs_diff": worst,
            "mask_share_differing": mask_diff / values if values else None,
            "iou_mean": float(g[both].mean()) if both.any() else None,
            "iou_cpu_mean": float(r[both].mean()) if both.any() else None,
            "iou_gap_max": float((r[both] - g[both]).max()) if both.any() else None,
            "lost_or_extra": lost,
        }
        ok = (
            res["samples"] > 0
            and not lost
            and res["mean_abs_diff_max"] <= TOLERANCE
            and res["mask_share_differing"] is not None
            and res["mask_share_differing"] <= MASK_SHARE
            and res["iou_mean"] is not None
            and res["iou_mean"] >= IOU_MEAN
            and res["iou_gap_max"] <= IOU_GAP
        )
        if single is not None:
            res["batched_vs_per_image_max_abs_diff"] = per_image_max
            res["batched_vs_per_image_mask_values_differing"] = per_image_masks
            ok = ok and per_image_max <= TRANSFORM_MAX_DIFF and per_image_masks == 0
        res["ok"] = bool(ok)
        out[f"{h}x{w}"] = res
    out["ok"] = all(v["ok"] for v in out.values())
    return out


# ------------------------------------------------------------------ (f), (y) the loader
def _epoch(c, name: str, transform, **kw) -> tuple[list, dict]:
    """The second epoch of the loader on the masked store (batches kept as they came, on the
    device), and the host syncs made while it ran, by thread: the first epoch started the
    backend (its threads, streams and EXIF probe), the second is the steady state whole."""
    device = c.device_for(name)
    with GpuCachedLoader(
        c.masked,
        batch_size=c.args.mask_batch,
        device=device,
        backend=name,
        transform=transform,
        seed=0,
        **kw,
    ) as loader:
        for _ in loader:  # the backend and its threads start: not the steady state
            pass
        with HostSyncs() as syncs:
            batches = list(loader)
    return batches, dict(syncs.by_thread)


def _cpu_epoch(c, transform, **kw) -> list:
    with GpuCachedLoader(
        c.masked,
        batch_size=c.args.mask_batch,
        device="cpu",
        backend="cpu",
        num_workers=0,
        transform=transform,
        seed=0,
        **kw,
    ) as loader:
        return list(loader)


def _per_batch(syncs: dict, batches: int) -> dict:
    return {k: v / max(1, batches) for k, v in sorted(syncs.items())}


def fill(c, name: str) -> dict:
    """See the module doc, (f)."""
    out: dict = {}
    for size in SIZES[:2]:
        tf = [T.Letterbox(size)]
        kw = {"fill": FILL, "mask_fill": MASK_FILL}
        got, syncs = _epoch(c, name, tf, **kw)
        ref = _cpu_epoch(c, tf, **kw)
        padded = wrong_fill = wrong_mask = 0
        means = []
        for (x, m), (rx, rm) in zip(got, ref, strict=True):
            x, m = x.cpu(), m.cpu()
            pad = rm == MASK_FILL  # where the plan pads (the synthetic masks hold 0 and 1)
            padded += int(pad.sum())
            wrong_fill += int(((x != FILL).any(dim=1) & pad).sum())
            wrong_mask += int((m != MASK_FILL)[pad].sum())
            means += (x.float() - rx.float()).abs().mean(dim=(1, 2, 3)).tolist()
        loop = syncs.get("MainThread", 0)
        out[f"{size[0]}x{size[1]}"] = res = {
            "padded_pixels": padded,
            "fill_pixels_wrong": wrong_fill,
            "mask_fill_wrong": wrong_mask,
            "mean_abs_diff_max": max(means, default=0.0),
            "host_syncs_per_batch": _per_batch(syncs, len(got)),
        }
        res["ok"] = (
            padded > 0
            and wrong_fill == 0
            and wrong_mask == 0
            and res["mean_abs_diff_max"] <= TOLERANCE
            and loop == 0
        )
    out["ok"] = all(v["ok"] for v in out.values())
    return out


def syncs(c, name: str) -> dict:
    """See the module doc, (y)."""
    tf = [T.RandomResizedCrop(SIZES[0]), T.RandomHorizontalFlip(1.0)]
    got, counted = _epoch(c, name, tf, mask_fill=MASK_FILL)
    per = _per_batch(counted, len(got))
    loop = per.get("MainThread", 0.0)
    transform = per.get("gpucache-nvjpeg-transform", 0.0)
    return {
        "batches": len(got),
        "masks": all(m.dim() == 3 for _, m in got),
        "host_syncs_per_batch": per,
        "ok": len(got) > 0 and loop == 0 and transform == 0,
    }
