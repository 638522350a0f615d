"""The loader's tiers: where a batch's pixels come from.

- ``raw``: the store's encoded bytes, decoded every batch (the default).
- ``decoded`` (``decoded=S``): every image decoded once and resized so its short side (or, with
  ``decoded_side="long"``, its long side) is ``S``, held once per node as one packed uint8
  buffer (:mod:`gpucache.store._decoded`): a file in the node cache that every rank and worker
  maps read-only (no copy a process, no ``/dev/shm``), reused by later runs while the store,
  ``S`` and the decoder are the same; in anonymous memory when no file is needed (fork workers
  or ``num_workers=0``, one process, no cache folder) or none can be written there.
- ``device`` (``decoded=S`` + ``device_budget=`` on CUDA): those pixels uploaded once a process
  to the GPU, every batch gathered and transformed there.

Choosing never fails a run: a tier that does not fit its budget, or whose file cannot be
written (full disk, ``RLIMIT_FSIZE``, a read-only folder), falls back (device -> decoded ->
raw) with one warning that names the bytes it needs and the fix; ``loader.tier_reason`` keeps
it. Under several ranks one rank of the node builds (the node lock, as for the store) while the
others wait, then all map the same file (:mod:`._tier_file`); :mod:`._tier_build` decodes and
writes the pixels, :mod:`._tier_key` names the file.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..base._plan import Col
from ..node._dir import default_dir
from ..store import _decoded
from ..store._decoded import FROM_STORE, DecodedPixels
from ..store._store import Store
from . import _tier_build, _tier_file
from ._tier_file import Target
from ._tier_key import decoder_version, tier_key

log = logging.getLogger(__name__)

#: The default ``decoded_budget``: this share of the node's available memory (``MemAvailable``)
#: when the loader is made.
DEFAULT_SHARE = 0.5
_NODE_STORE = re.compile(r"[0-9a-f]{32}\.gpucache")


@dataclass(frozen=True)
class TierRequest:
    """What the loader's arguments ask for (checked)."""

    side: int | None = None
    mode: str = "short"
    budget: int | None = None
    device_budget: int | float | None = None
    cache_dir: str | os.PathLike[str] | None = None


def request(
    *,
    decoded: int | None,
    decoded_side: str,
    decoded_budget: int | None,
    device_budget: int | float | None,
    cache_dir: str | os.PathLike[str] | None,
) -> TierRequest:
    if decoded is not None and (
        isinstance(decoded, bool) or not isinstance(decoded, int) or decoded < 1
    ):
        raise ValueError(
            f"decoded should be a side in pixels (an integer >= 1), got {decoded!r}; for "
            "example decoded=256 for RandomResizedCrop(224), or None for no decoded tier."
        )
    if decoded_side not in ("short", "long"):
        raise ValueError(
            f"decoded_side must be 'short' (Resize/RandomResizedCrop pipelines) or 'long' "
            f"(letterbox pipelines), got {decoded_side!r}."
        )
    if decoded_budget is not None and (
        isinstance(decoded_budget, bool)
        or not isinstance(decoded_budget, int)
        or decoded_budget < 0
    ):
        raise ValueError(
            f"decoded_budget should be bytes (an integer >= 0), got {decoded_budget!r}; None "
            f"takes {DEFAULT_SHARE:.0%} of the node's available memory."
        )
    if device_budget is not None and (
        isinstance(device_budget, bool)
        or not isinstance(device_budget, (int, float))
        or device_budget < 0
        or (isinstance(device_budget, float) and device_budget > 1)
    ):
        raise ValueError(
            "device_budget should be bytes (an int), a share of the GPU's free memory (a float "
            f"in [0, 1]), or None (no device tier), got {device_budget!r}."
        )
    return TierRequest(decoded, decoded_side, decoded_budget, device_budget, cache_dir)


@dataclass
class Tier:
    """The tier a loader runs on, and what it needs to run."""

    name: str = "raw"
    reason: str | None = None
    pixels: DecodedPixels | None = None
    #: each sample's size its plans are drawn for (the tier's; the store's where the sample is
    #: decoded from the store)
    heights: np.ndarray | None = None
    widths: np.ndarray | None = None
    side: int = 0
    mode: str = "short"

    def describe(self) -> str:
        """The ``tier`` line of ``loader.stats``."""
        if self.pixels is None:
            return "raw (JPEGs decoded every batch)" + (f"; {self.reason}" if self.reason else "")
        p = self.pixels
        where = f"file {p.path}" if p.path is not None else "anonymous memory"
        what = (
            f"{self.name} ({self.mode} side {self.side}, {len(p):,} images, "
            f"{p.nbytes / 2**20:,.1f} MiB in {where}"
            + (", uploaded to the GPU)" if self.name == "device" else ")")
        )
        return what + (f"; {self.reason}" if self.reason else "")


def default_budget() -> int:
    """:data:`DEFAULT_SHARE` of the node's available memory, in bytes."""
    import psutil

    return int(psutil.virtual_memory().available * DEFAULT_SHARE)


def choose(
    cache: Store,
    req: TierRequest,
    *,
    device: torch.device,
    private_ok: bool,
    several: bool,
) -> Tier:
    """The tier for ``cache`` under ``req``. ``private_ok``: the pixels may live in this
    process's anonymous memory (fork workers or none, and one rank of its node); ``several``:
    this process is one of several ranks."""
    if req.side is None:
        return Tier()
    s = cache.samples
    th, tw = _tier_build.tier_sizes(s["height"], s["width"], req.side, req.mode)
    lay = _decoded.layout(th, tw)
    need = lay.size
    asked = f"decoded={req.side}" + ("" if req.mode == "short" else ", decoded_side='long'")
    budget = default_budget() if req.budget is None else req.budget
    if need > budget:
        stated = (
            f"decoded_budget={budget:,}"
            if req.budget is not None
            else f"the default budget ({DEFAULT_SHARE:.0%} of available memory: {budget:,} bytes)"
        )
        return _fall(
            f"{asked} needs {need:,} bytes ({need / 2**20:,.1f} MiB) for {len(cache):,} images, "
            f"more than {stated}; the raw tier is used (JPEGs decoded every batch). Fix: raise "
            f"decoded_budget= to at least {need:,}, lower decoded=, or free memory",
        )
    key, digest = tier_key(cache, req.side, req.mode)
    target = Target(th, tw, req.side, req.mode, digest, decoder_version(short=True))
    folder = _folder(cache, req, private_ok and not several)
    pixels, why = None, None
    if folder is not None:
        pixels, why = _tier_file.once_per_node(
            folder,
            key,
            target,
            lambda fd, progress: _tier_build.into_file(fd, cache, target, progress),
        )
    if pixels is None and private_ok and not several:
        pixels = _tier_build.into_memory(cache, target)
    if pixels is None:
        return _fall(
            f"{asked} needs a {need:,}-byte file ({need / 2**20:,.1f} MiB) that every process "
            f"maps, and {why}; the raw tier is used (JPEGs decoded every batch). Fix: pass the "
            "loader cache_dir= a writable folder with room on a local disk, raise the file-size "
            "limit (ulimit -f), or use fork workers (multiprocessing_context='fork') or "
            "num_workers=0, which can hold the pixels in memory",
        )
    reason = None
    if why is not None:  # held in memory instead of the file it could not write
        reason = f"{why}; held in this process's memory instead (fork workers share it)"
        _warn(f"gpucache: {asked}: {reason}")
    heights = np.where(pixels.status == FROM_STORE, s["height"], pixels.heights).astype(np.int64)
    widths = np.where(pixels.status == FROM_STORE, s["width"], pixels.widths).astype(np.int64)
    tier = Tier("decoded", reason, pixels, heights, widths, req.side, req.mode)
    if req.device_budget is not None and device.type == "cuda":
        room = _device_room(req.device_budget, device)
        if pixels.nbytes <= room:
            tier.name = "device"
        else:
            tier.reason = (
                f"the device tier needs {pixels.nbytes:,} bytes of GPU memory, more than "
                f"device_budget allows ({room:,}); the pixels stay on the host. Fix: raise "
                "device_budget= or lower decoded="
            )
            _warn(f"gpucache: {tier.reason}")
    return tier


def _fall(reason: str) -> Tier:
    _warn(f"gpucache: {reason}.")
    return Tier("raw", reason)


def _warn(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=4)


def _device_room(budget: int | float, device: torch.device) -> int:
    if isinstance(budget, float):
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * budget)
    return int(budget)


def _folder(cache: Store, req: TierRequest, private_ok: bool) -> Path | None:
    """Where the tier's file goes: ``cache_dir=``, else the node cache folder the store was
    built in, else (when a file is needed) the default node cache folder; None: memory."""
    if req.cache_dir is not None:
        return Path(req.cache_dir)
    path = cache.path
    if path is not None and _NODE_STORE.fullmatch(path.name):
        return path.parent
    return None if private_ok else default_dir()


def store_plans(tier: Tier, indices: np.ndarray, plans: np.ndarray, cache: Store) -> np.ndarray:
    """``plans`` (drawn for the tier's sizes) in the coordinates of the store's images, for
    ``BatchInfo.plans``: the first crop scaled by each image's factor (float64), so
    ``transforms.map_boxes`` maps the store's boxes exactly (the tier's resize from the
    store's size is exact in continuous coordinates)."""
    if tier.pixels is None:
        return plans
    p = tier.pixels
    held = p.status[indices] == _decoded.IN_TIER
    s = cache.samples[indices]
    sy = np.where(held, s["height"] / np.maximum(p.heights[indices], 1), 1.0)
    sx = np.where(held, s["width"] / np.maximum(p.widths[indices], 1), 1.0)
    out = plans.astype(np.float64)
    out[:, Col.TOP1] *= sy
    out[:, Col.HEIGHT1] *= sy
    out[:, Col.LEFT1] *= sx
    out[:, Col.WIDTH1] *= sx
    return out
