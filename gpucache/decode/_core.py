"""CPU decoding: libjpeg-turbo ``decode_jpeg`` for JPEG, PIL for the other formats; a JPEG whose plan
crops is decoded only inside the crop box (:mod:`._roi`, :mod:`._roi_rst`; same pixels), and with
``exact=False`` at a reduced DCT scale when the plan shrinks the box enough (:mod:`._scaled`;
close to, not the same as, the exact pixels; docs/guides/backends.md). libjpeg's warnings about
corrupt data come back per sample (``Decoded.warned``).

Also the per-sample executor of a geometric plan (crop, antialiased bilinear resize on uint8, crop,
flip), and :func:`decode_batch`, which the worker processes and the GPU backends' CPU fallback share.
"""

from __future__ import annotations

import contextlib
import io
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from .._errors import SampleError
from ..base._plan import AFTER_BOX1, BOX1, Col
from ..ingest._pixels import eight_bit
from ..ingest._sniff import JPEG_KINDS, Kind
from ..store._decoded import IN_TIER, DecodedPixels
from ..store._limits import check_pixels
from ..store._oom import raise_if_out_of_memory
from ..transforms._generator import batch_generator
from ..transforms._steps import apply_steps, elementwise_into, elementwise_prefix
from . import _masks, _roi, _roi_rst
from ._jpeg import (  # noqa: F401 - the full JPEG decode, shared with the region decoder's check
    TV_DEPRECATION,
    decode_jpeg,
    jpeg_decoder_name,
    quiet_torchvision_deprecation,
)
from ._options import DecodeOptions
from ._scaled import fast_plan

_ROI_KINDS = (Kind.JPEG, Kind.JPEG_PROGRESSIVE)  # not arithmetic-coded


def decode_pil(data: np.ndarray) -> torch.Tensor:
    """PNG, GIF (first frame), WebP, BMP, TIFF, PNM -> RGB uint8 CHW, EXIF orientation applied,
    16-bit samples scaled to 8 bits (:func:`gpucache.ingest._pixels.eight_bit`)."""
    from PIL import Image, ImageOps

    # numpy's stubs give ndarray the buffer protocol only from Python 3.12 on (numpy#26783)
    with Image.open(io.BytesIO(data)) as im:  # type: ignore[arg-type]
        rgb = eight_bit(ImageOps.exif_transpose(im)).convert("RGB")
    return torch.from_numpy(np.asarray(rgb).copy()).permute(2, 0, 1)


def decode_sample(cache, i: int) -> torch.Tensor:
    """Sample ``i`` of ``cache`` as RGB uint8 CHW (refused before decoding if over the pixel budget)."""
    check_pixels(cache, i)
    return _decode_full(cache, i, cache.samples["kind"][i])


def _decode_full(cache, i: int, kind: int) -> torch.Tensor:
    """Sample ``i`` decoded in full (libjpeg-turbo for JPEG, PIL otherwise); budget not checked."""
    if kind in JPEG_KINDS:
        return decode_jpeg(cache._bytes_tensor(i))
    return decode_pil(cache[i])


def apply_plan(img: torch.Tensor, plan) -> torch.Tensor:
    """Run one sample's plan (see :mod:`gpucache.transforms`) on a decoded CHW uint8 image.

    Device-agnostic: the GPU backends run this same function on CUDA tensors."""
    t1, l1, h1, w1, rh, rw, t2, l2, h2, w2, flip = (int(v) for v in plan)
    return finish_plan(img[:, t1 : t1 + h1, l1 : l1 + w1], rh, rw, t2, l2, h2, w2, flip)


def finish_plan(
    x: torch.Tensor,
    rh: int,
    rw: int,
    t2: int,
    l2: int,
    h2: int,
    w2: int,
    flip: int,
    fill: int = 0,
) -> torch.Tensor:
    """The plan after its first crop: resize ``x`` to (rh, rw), crop (padded with ``fill``
    where the crop leaves the image), flip."""
    h1, w1 = x.shape[-2:]
    if (rh, rw) != (h1, w1):
        if x.device.type == "cpu":  # uint8 in, uint8 out: torch's vectorized CPU kernel
            x = F.interpolate(x[None], size=(rh, rw), mode="bilinear", antialias=True)[0]
        else:  # the same filter in float on other devices, rounded back to uint8
            x = (
                F.interpolate(x[None].float(), size=(rh, rw), mode="bilinear", antialias=True)[0]
                .round_()
                .clamp_(0, 255)
                .to(torch.uint8)
            )
    if (t2, l2, h2, w2) != (0, 0, rh, rw):
        if t2 < 0 or l2 < 0 or t2 + h2 > rh or l2 + w2 > rw:  # crop larger than image: zero pad
            pads = (max(0, -l2), max(0, l2 + w2 - rw), max(0, -t2), max(0, t2 + h2 - rh))
            x = F.pad(x, pads, value=fill)
            t2, l2 = max(t2, 0), max(l2, 0)
        x = x[:, t2 : t2 + h2, l2 : l2 + w2]
    if flip:
        x = x.flip(-1)
    return x


def no_autocast(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Autocast off on ``device``'s type and the CPU's: the batched resize's float matrix
    products (and :func:`finish_plan`'s float filter) keep float32 inside a caller's
    ``torch.autocast`` region, which would otherwise run them in bfloat16 or float16 and move
    pixels by a level or two. Autocast is per thread: the GPU backends' own threads never see it,
    a synchronous backend runs on the caller's."""
    stack = contextlib.ExitStack()
    for kind in dict.fromkeys((device.type, "cpu")):
        if torch.amp.is_autocast_available(kind):  # not for "meta", say
            stack.enter_context(torch.autocast(kind, enabled=False))
    return stack


@dataclass
class Decoded:
    """One decoded batch: ``images`` (stacked when every output has one size) for ``indices``."""

    images: torch.Tensor | list[torch.Tensor]
    indices: np.ndarray  # store indices of the images, in batch order
    failed: list[tuple[int, str]] = field(default_factory=list)  # (store index, reason)
    cpu_decoded: int = 0  # samples that took the CPU path (GPU backends' fallback)
    roi_decoded: int = 0  # of those, JPEGs decoded only inside their crop box (see ._roi)
    warned: list[tuple[int, str]] = field(default_factory=list)  # kept, but libjpeg warned
    #: seconds spent on this batch by stage ("read", "decode", "resize", "collate") and by decode
    #: route ("region", "scaled", "full", "fallback"); see gpucache/loader/_stats.py
    times: dict[str, float] = field(default_factory=dict)
    routes: dict[str, int] = field(default_factory=dict)  # images decoded by each route
    busy: float = 0.0  # seconds its producer (a worker, a thread) was busy on it
    worker: int = -1  # the worker that made it (-1: the loader's process)
    #: kept, but decoded without the restart interval the store records (its bytes do not match)
    mismatched: list[tuple[int, str]] = field(default_factory=list)
    #: the batch generator's state after the batch steps run with the decode (``steps=``), for
    #: the steps that follow in the loop's process; None when none ran
    rng_state: bytes | None = None
    #: each kept sample's mask through its plan (``masks=True``): (N, H, W), or a list of (H, W)
    masks: torch.Tensor | list[torch.Tensor] | None = None


def describe(cache, i: int, err: BaseException) -> str:
    return (
        f"sample {i} ({cache.paths[i]}) could not be decoded: {type(err).__name__}: "
        f"{str(err).splitlines()[0] if str(err) else ''}"
    )


def check_size(cache, i: int, img: torch.Tensor) -> torch.Tensor:
    """``img`` if it has the size the header promised (plans were drawn for that size)."""
    expected = (int(cache.samples["height"][i]), int(cache.samples["width"][i]))
    if tuple(img.shape[1:]) != expected:
        raise ValueError(
            f"decoded size {tuple(img.shape[1:])} differs from the header's {expected}"
        )
    return img


#: ``on_error`` values: "skip" and "raise" act on samples that fail to decode; "skip_warned" also
#: leaves out samples whose decode libjpeg warned about (corrupt data it decoded anyway).
ON_ERROR = ("skip", "raise", "skip_warned")


def warned_reason(cache, i: int, warning: str) -> str:
    return f"sample {i} ({cache.paths[i]}) has corrupt JPEG data (decoded anyway): {warning}"


def failure(cache, i: int, err: Exception, on_error: str) -> str:
    """The loader's policy for a sample that failed: raise ``SampleError``, or return the reason."""
    if on_error == "raise":
        raise SampleError(describe(cache, i, err)) from err
    return describe(cache, i, err)


def out_size(plans: np.ndarray) -> tuple[int, int]:
    """Output (height, width) of a fixed-size batch's plans: the shape of an empty batch."""
    return (int(plans[0, Col.HEIGHT2]), int(plans[0, Col.WIDTH2])) if len(plans) else (0, 0)


class _Sample(NamedTuple):
    """What decoding one sample needs of its store record (read once a batch, as Python ints)."""

    i: int  # store index
    kind: int
    components: int
    precision: int
    orientation: int
    height: int
    width: int
    restart: int  # restart interval in MCUs (0: none)


def _decode_box(
    cache,
    s: _Sample,
    plan: list[int],
    regions: dict,
    denom: int,
    mismatched: list[tuple[int, str]],
) -> tuple[torch.Tensor, bool, int]:
    """Sample ``s.i`` cropped to the plan's first crop box; True if only the box was decoded;
    the DCT scale denominator it was decoded at. A sample whose bytes do not match its restart
    interval (``s.restart``) is decoded without it and noted in ``mismatched``.

    With ``denom`` > 1 (``exact=False``, :func:`._scaled.fast_plan`) the box is decoded at
    1/``denom`` DCT scale (compiled decoder only), so the result is smaller than the box."""
    i, height, width = s.i, s.height, s.width
    t1, l1, h1, w1 = plan[BOX1]
    box = (t1, l1, h1, w1)
    region = regions.get(s.components)
    if (
        region is not None
        and s.kind in _ROI_KINDS
        and s.precision == 8
        and 0 <= t1
        and 0 <= l1
        and t1 + h1 <= height
        and l1 + w1 <= width
    ):
        denom = denom if region is _roi._c_region else 1
        kw = dict(orientation=s.orientation, height=height, width=width, region=region)
        whole = (h1, w1) == (height, width)
        if whole and denom == 1:  # no crop: whole, but through the compiled decoder,
            if region is not _roi._c_region:  # which reports libjpeg's warnings per sample
                return _decode_full(cache, i, s.kind), False, 1
            return _roi.decode_crop(cache[i], (0, 0, height, width), **kw), False, 1
        try:
            x = None
            if s.restart:
                try:
                    x = _roi_rst.decode_crop(cache[i], s.restart, box, denom=denom, **kw)
                except _roi_rst.IntervalMismatch as err:  # decoded as a plain store would
                    why = _roi_rst.mismatch_reason(s.restart, err)
                    mismatched.append((i, f"sample {i} ({cache.paths[i]}): {why}"))
            if x is None:
                x = _roi.decode_crop(cache[i], box, denom=denom, **kw)
        except _roi.ScaleRefused:  # sampling factors it does not scale: the exact path
            if mismatched and mismatched[-1][0] == i:
                s = s._replace(restart=0)
            return _decode_box(cache, s, plan, regions, 1, mismatched)
        return x, not whole, denom
    img = check_size(cache, i, _decode_full(cache, i, s.kind))
    return img[:, t1 : t1 + h1, l1 : l1 + w1], False, 1


def decode_batch(
    cache,
    indices: np.ndarray,
    plans: np.ndarray,
    *,
    on_error: str,
    stack: bool,
    exact: bool = True,
    steps: Sequence[Any] = (),
    key: Sequence[int] = (),
    alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
    masks: MaskOptions | None = None,
    fill: int = 0,
    pixels: DecodedPixels | None = None,
) -> Decoded:
    """Decode and transform ``indices`` on the CPU; failed samples are left out (or raise).

    A JPEG whose plan crops is decoded only inside the crop box when ROI decode is available
    (:mod:`._roi`; same output, less work), from its restart segments in a restart-marker store
    (:mod:`._roi_rst`); anything else is decoded in full, then cropped. ``exact=False`` lets a
    JPEG whose plan shrinks its box enough decode at 1/2, 1/4 or 1/8 scale (DCT scaling), and
    cuts a crop that follows a resize before it (:func:`._scaled.fast_plan`); neither is
    bit-exact: within the tolerance docs/guides/backends.md states.

    ``steps`` are batch steps that act on each sample alone (:func:`gpucache.transforms.
    per_sample_prefix`), run here on the batch as the loop's process would, drawing from the
    generator of the batch's ``key`` (:func:`gpucache.transforms.batch_generator`); the
    generator's state after them comes back in ``Decoded.rng_state``, for the steps that follow.
    The leading ones that map each pixel alone (ToDtype, Normalize) run on each stacked sample as
    soon as it is resized, straight into the batch's output (:func:`fused_steps`; one pass to
    float, the same values as on the batch).

    ``alloc(shape, dtype)`` makes the stacked batch's tensor (``torch.empty`` by default; a cpu
    worker's puts it in a memory file it can send whole, :mod:`._shared`).

    ``fill`` is the image value where a plan pads. ``masks`` (fill, dtype): each sample's mask is decoded beside its image and sent through
    the sample's plan as drawn (:mod:`._masks`; nearest neighbour, ``fill`` where it pads); a
    mask that fails fails its sample.

    ``pixels``: the loader's decoded tier (:mod:`gpucache.store._decoded`): a sample held there
    is not decoded but cut from its pixels (its plan drawn for the tier's size; the time counts
    as ``read``); one the tier marks as decoded from the store is decoded here as without it.

    The result carries the seconds each stage took (``Decoded.times``): ``read`` touches one byte
    a page of the sample's bytes, so that a store read from disk is seen there and not in decode.
    """
    clock = stage_clock
    profiled = torch.autograd._profiler_enabled()
    started = clock()
    images, kept, failed, warned, roi = [], [], [], [], 0
    mask_out: list[torch.Tensor] = []
    mismatched: list[tuple[int, str]] = []
    read = decoded = resized = stepped = 0.0
    fused = tuple(steps[: fused_steps(steps)]) if stack else ()
    empty = alloc or _torch_empty
    buf: torch.Tensor | None = None  # the batch's output, when the fused steps fill it
    route_s = dict.fromkeys(ROUTES, 0.0)
    route_n = dict.fromkeys(ROUTES, 0)
    data, offsets = cache._data, cache._offsets
    indices = np.asarray(indices, dtype=np.int64)
    rec = cache.samples[indices]  # one gather per batch, not numpy scalars per sample
    intervals = _roi_rst.intervals(cache)
    restart = intervals[indices].tolist() if intervals is not None else [0] * len(indices)
    regions = {c: _roi.region_decoder(c) for c in (1, 3, 4)}  # by component count
    if regions[3] is None:
        _roi.notice_once()
    samples = map(
        _Sample,
        indices.tolist(),
        rec["kind"].tolist(),
        rec["components"].tolist(),
        rec["precision"].tolist(),
        rec["orientation"].tolist(),
        rec["height"].tolist(),
        rec["width"].tolist(),
        restart,
    )
    # 0 where the decoded tier holds the sample's pixels (1: decoded from the store)
    status = pixels.status[indices].tolist() if pixels is not None else [1] * len(indices)
    for s, plan, held in zip(samples, np.asarray(plans).tolist(), status):
        i, kind = s.i, s.kind
        drawn = plan  # the plan as drawn, for the mask (fast_plan may change the image's)
        denom = 1
        tier_size = None  # the sample's size in the decoded tier, where it is held there
        if held == IN_TIER and pixels is not None:
            tier_size = (int(pixels.heights[i]), int(pixels.widths[i]))
        elif not exact:  # the scale only where the compiled decoder takes the sample
            plan, denom = fast_plan(
                plan,
                s.height,
                s.width,
                orientation=s.orientation,
                scalable=regions.get(s.components) is _roi._c_region
                and kind in _ROI_KINDS
                and s.precision == 8,
            )
        t0 = clock()
        if TIMED and tier_size is None:
            touch_pages(data[offsets[i] : offsets[i + 1]])
        t1 = clock()
        read += t1 - t0
        try:
            if tier_size is not None:  # no decode: the plan's first crop of the tier's pixels
                assert pixels is not None
                t1_, l1_, h1_, w1_ = plan[BOX1]
                x, used_roi = pixels.image(i)[:, t1_ : t1_ + h1_, l1_ : l1_ + w1_], False
                t2 = clock()
                read += t2 - t1
            else:
                check_pixels(cache, i)
                _roi.take_warning()
                with stage_range("gpucache.decode", profiled):
                    x, used_roi, scale = _decode_box(cache, s, plan, regions, denom, mismatched)
                t2 = clock()
                route = (
                    "fallback"
                    if kind not in JPEG_KINDS
                    else "scaled"
                    if scale > 1
                    else "region"
                    if used_roi
                    else "full"
                )
                route_s[route] += t2 - t1
                route_n[route] += 1
                decoded += t2 - t1
                note = _roi.take_warning()
                if note is not None:
                    warned.append((i, warned_reason(cache, i, note)))
                    if on_error == "skip_warned":
                        failed.append((i, f"{warned[-1][1]}; left out (on_error='skip_warned')"))
                        continue
            with stage_range("gpucache.resize", profiled):
                rh, rw, top2, left2, h2, w2, flip = plan[AFTER_BOX1]
                y = finish_plan(x, rh, rw, top2, left2, h2, w2, flip, fill)
                if masks is not None:
                    mask_out.append(masks.apply(cache, i, drawn, tier_size))
                images.append(y)
            resized += clock() - t2
            kept.append(i)
            roi += used_roi
        except Exception as err:  # a bad sample is reported, never fatal unless asked
            # the machine's problem, not the sample's: never skipped
            raise_if_out_of_memory(err, f"while decoding sample {i} ({cache.paths[i]})")
            failed.append((i, failure(cache, i, err, on_error)))
        else:
            if fused:  # into the batch's output while the sample is in the cache
                t4 = clock()
                with stage_range("gpucache.steps", profiled):
                    y = images.pop()
                    if buf is None:  # the steps keep the shape (NCHW); the dtype is the last's
                        buf = empty((len(indices), *y.shape), fused[-1].dtype)
                    k = len(kept) - 1
                    elementwise_into(fused, y[None], buf[k : k + 1])
                stepped += clock() - t4
    t3 = clock()
    out: torch.Tensor | list[torch.Tensor] = images
    if stack:
        with stage_range("gpucache.collate", profiled):
            empty_batch = torch.empty((0, 3, *out_size(plans)), dtype=torch.uint8)
            if fused:
                out = buf[: len(kept)] if buf is not None else _run_each(fused, empty_batch)
            else:
                out = (
                    torch.stack(images, out=empty((len(images), *images[0].shape), torch.uint8))
                    if images
                    else empty_batch
                )
    t4 = clock()
    rng_state = None
    if steps:
        with stage_range("gpucache.steps", profiled):
            generator = batch_generator(*key)
            rest = [("pixel", t) for t in steps[len(fused) :]]
            out = apply_steps(rest, out, None, generator)[0]
            rng_state = generator.get_state().numpy().tobytes()
    end = clock()
    times = {
        "read": read,
        "decode": decoded,
        "resize": resized,
        "collate": t4 - t3,
        "steps": stepped + end - t4,
    }
    times.update(route_s)
    return Decoded(
        out,
        np.asarray(kept, dtype=np.int64),
        failed,
        len(kept),
        roi,
        warned,
        times=times,
        routes=route_n,
        busy=end - started,
        mismatched=mismatched,
        rng_state=rng_state,
        masks=None if masks is None else _stack_masks(mask_out, plans, masks.dtype, stack),
    )


def decode_task(
    cache,
    indices: np.ndarray,
    plans: np.ndarray,
    stack: bool,
    key: tuple[int, ...],
    options: DecodeOptions,
    alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
) -> Decoded:
    """One task of the cpu backend (a worker's, or its inline decode): :func:`decode_batch` with
    the loader's decode options, the batch's ``key`` and where its batch tensor goes."""
    return decode_batch(
        cache,
        indices,
        plans,
        on_error=options.on_error,
        stack=stack,
        exact=options.exact,
        steps=options.steps,
        key=key,
        alloc=alloc,
        masks=MaskOptions.of(options),
        fill=options.fill,
        pixels=options.pixels,
    )


def _stack_masks(
    masks: list[torch.Tensor], plans: np.ndarray, dtype: torch.dtype, stack: bool
) -> torch.Tensor | list[torch.Tensor]:
    if not stack:
        return masks
    return torch.stack(masks) if masks else torch.empty((0, *out_size(plans)), dtype=dtype)


class MaskOptions(NamedTuple):
    """What :func:`decode_batch` needs to bring masks along (from :class:`DecodeOptions`)."""

    fill: int  # mask value where a plan pads
    dtype: torch.dtype

    @classmethod
    def of(cls, options: DecodeOptions) -> MaskOptions | None:
        if not options.masks:
            return None
        return cls(options.mask_fill, getattr(torch, options.mask_dtype))

    def apply(
        self, cache, i: int, plan: Sequence[int], size: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """Sample ``i``'s mask through ``plan``; ``size``: the image's size in the decoded tier,
        to which the mask is first resized (nearest neighbour, the image's scale)."""
        mask = _masks.decode_one(cache, i, self.dtype)
        if size is not None and tuple(mask.shape) != size:
            h, w = mask.shape
            scaled = [0, 0, h, w, size[0], size[1], 0, 0, size[0], size[1], 0]
            mask = _masks.apply_mask_plan(mask, scaled, self.fill)
        return _masks.apply_mask_plan(mask, plan, self.fill)


def fused_steps(steps: Sequence[Any]) -> int:
    """How many leading ``steps`` :func:`decode_batch` runs on each sample as it is resized (the
    rest run on the batch): :func:`gpucache.transforms.elementwise_prefix`.
    ``benchmarks/float_pipeline.py`` patches it to 0 to time the two-pass way."""
    return elementwise_prefix(steps)


def _torch_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def _run_each(steps: Sequence[Any], x: torch.Tensor) -> torch.Tensor:
    for t in steps:
        x = t(x)
    return x


#: Per-stage timings on (``GPUCACHE_TIMINGS=0`` in the environment turns them off, in the
#: workers too, which inherit it; ``benchmarks/stats_overhead.py`` measures what they cost).
TIMED = os.environ.get("GPUCACHE_TIMINGS", "1") != "0"


def _no_clock() -> float:
    return 0.0


#: the clock every stage timing reads: ``time.perf_counter``, or 0 with the timings off
stage_clock = time.perf_counter if TIMED else _no_clock


def stage_range(name: str, profiled: bool) -> contextlib.AbstractContextManager[object]:
    """A ``torch.profiler`` range named ``name`` while a profiler runs (its trace then shows the
    stage), nothing otherwise; ``profiled`` is ``torch.autograd._profiler_enabled()``."""
    return torch.profiler.record_function(name) if profiled else contextlib.nullcontext()


#: decode routes, as ``Decoded.times`` and ``.routes`` name them: only the crop box decoded,
#: decoded at a reduced DCT scale, the whole image decoded, another format (PIL) or a GPU
#: backend's CPU fallback
ROUTES = ("region", "scaled", "full", "fallback")


def touch_pages(view: np.ndarray) -> None:
    """Read one byte of every page of ``view``: a page not in memory is read in here."""
    if len(view):
        np.bitwise_or.reduce(view[::4096])
