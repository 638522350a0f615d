"""A batch decoded on the CPU: :func:`decode_batch`, which the cpu backend's workers (and its inline
decode) and the GPU backends' CPU fallback run. Each sample is decoded (:mod:`._sample`; only its
crop box where it can be) or cut from the decoded tier, then sent through its plan
(:mod:`._apply`), its mask beside it (:mod:`._masks`); the batch steps that act on each sample
alone run here too, the first ones fused into the batch's output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ..base._plan import BOX1
from ..ingest._sniff import JPEG_KINDS
from ..store._decoded import IN_TIER
from ..store._limits import check_pixels
from ..store._oom import raise_if_out_of_memory
from ..store._store import Store
from ..transforms._generator import batch_generator
from ..transforms._steps import apply_steps, elementwise_into, elementwise_prefix
from . import _roi, _roi_rst
from ._apply import finish_plan
from ._masks import MaskOptions
from ._options import DEFAULTS, DecodeOptions
from ._outcome import Decoded, failure, out_size, warned_reason
from ._sample import ROI_KINDS, Record, decode_box
from ._scaled import fast_plan
from ._timing import ROUTES, TIMED, stage_clock, stage_range, touch_pages


def decode_batch(
    cache: Store,
    indices: np.ndarray,
    plans: np.ndarray,
    options: DecodeOptions = DEFAULTS,
    *,
    stack: bool,
    key: Sequence[int] = (),
    alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
) -> Decoded:
    """Decode and transform ``indices`` on the CPU as ``options`` say (the loader's
    :class:`DecodeOptions`, whole: the cpu backend's workers, its inline decode and the GPU
    backends' CPU fallback all decode through here); failed samples are left out, or raise
    (``options.on_error``).

    A JPEG whose plan crops is decoded only inside the crop box when ROI decode is available
    (:mod:`._roi`; same output, less work), from its restart segments in a restart-marker store
    (:mod:`._roi_rst`); anything else is decoded in full, then cropped. ``options.exact=False`` lets a
    JPEG whose plan shrinks its box enough decode at 1/2, 1/4 or 1/8 scale (DCT scaling), and
    cuts a crop that follows a resize before it (:func:`._scaled.fast_plan`); neither is
    bit-exact: within the tolerance docs/guides/backends.md states.

    ``options.steps`` are batch steps that act on each sample alone (:func:`gpucache.transforms.
    per_sample_prefix`), run here on the batch as the loop's process would, drawing from the
    generator of the batch's ``key`` (:func:`gpucache.transforms.batch_generator`); the
    generator's state after them comes back in ``Decoded.rng_state``, for the steps that follow.
    The leading ones that map each pixel alone (ToDtype, Normalize) run on each stacked sample as
    soon as it is resized, straight into the batch's output (:func:`fused_steps`; one pass to
    float, the same values as on the batch).

    ``alloc(shape, dtype)`` makes the stacked batch's tensor (``torch.empty`` by default; a cpu
    worker's puts it in a memory file it can send whole, :mod:`.cpu._batch_files`).

    ``options.fill`` is the image value where a plan pads. With ``options.masks`` each sample's
    mask is decoded beside its image and sent through the sample's plan as drawn (:mod:`._masks`;
    nearest neighbour, ``options.mask_fill`` where it pads); a mask that fails fails its sample.

    ``options.pixels``: the loader's decoded tier (:mod:`gpucache.store._decoded`): a sample held there
    is not decoded but cut from its pixels (its plan drawn for the tier's size; the time counts
    as ``read``); one the tier marks as decoded from the store is decoded here as without it.

    The result carries the seconds each stage took (``Decoded.times``): ``read`` touches one byte
    a page of the sample's bytes, so that a store read from disk is seen there and not in decode.
    """
    on_error, steps, pixels = options.on_error, options.steps, options.pixels
    masks = MaskOptions.of(options)
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
        Record,
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
        elif not options.exact:  # the scale only where the compiled decoder takes the sample
            plan, denom = fast_plan(
                plan,
                s.height,
                s.width,
                orientation=s.orientation,
                scalable=regions.get(s.components) is _roi._c_region
                and kind in ROI_KINDS
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
                    x, used_roi, scale = decode_box(cache, s, plan, regions, denom, mismatched)
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
                y = finish_plan(x, plan, options.fill)
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


def _stack_masks(
    masks: list[torch.Tensor], plans: np.ndarray, dtype: torch.dtype, stack: bool
) -> torch.Tensor | list[torch.Tensor]:
    if not stack:
        return masks
    return torch.stack(masks) if masks else torch.empty((0, *out_size(plans)), dtype=dtype)


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
