"""The DALI graph of backend="dali", and the per-sample rows it is fed.

Per sample::

    decoders.image (whole image, EXIF not applied) -> slice (crop1, mapped to the stored pixels)
    -> transpose (if the store's orientation swaps the axes) -> flip (if it flips)
    -> resize (antialiased linear) to (rh, rw) -> slice (crop2, ``fill`` padding outside the image)
    -> crop_mirror_normalize (flip; uint8 CHW out)

Two choices keep DALI out of decisions the other backends make differently:

- **Orientation is the store's.** The decoder runs with ``adjust_orientation=False`` and the
  orientation recorded at build (``samples["orientation"]``, the rule libjpeg-turbo's decoders
  follow, read by :mod:`gpucache.ingest._sniff`) is applied in the graph, with the table every
  backend uses (:data:`gpucache.transforms._orientation.ORIENT`). nvImageCodec reads EXIF by
  rules of its own (it takes an Exif APP1 after an XMP one, and ignores one without the ``Exif\\0\\0`` prefix
  or with a 65535-entry IFD, where libjpeg-turbo does the opposite), which on square images turned
  pictures silently.
- **The whole image is decoded, then sliced.** The region decode of ``decoders.image_slice``
  (``device="mixed"``) goes through nvImageCodec's sub-code-stream ROI path, which in nvImageCodec
  0.9 fails with ``INTERNAL_ERROR`` on A100 and kills the process with SIGSEGV on H100 and B200
  (NVIDIA/nvImageCodec#55). ``decoders.image`` never asks for a region.

Only the decoder's device (``"mixed"`` on CUDA, ``"cpu"`` otherwise) and its GPU-only options
differ between the CPU and the GPU graph; every later operator follows its input's device.
Written against DALI 2.4.0 and nvImageCodec 0.9.0 (``nvidia-dali-cuda120``,
``nvidia-nvimgcodec-cu12``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from nvidia.dali import fn, types
from nvidia.dali.data_node import DataNode
from nvidia.dali.pipeline import Pipeline, pipeline_def

from ...base._plan import AFTER_BOX1, Col
from ...transforms._orientation import steps_of

#: The row fed per sample (int32): crop1 on the stored pixels, the orientation's three steps, then
#: the plan's resize, crop2 and flip (see gpucache.transforms).
ROW = (
    "top1",
    "left1",
    "height1",
    "width1",
    "transpose",
    "flip_v",
    "flip_h",
    "rh",
    "rw",
    "top2",
    "left2",
    "height2",
    "width2",
    "mirror",
)
_PIXELS: dict[str, Any] = dict(axis_names="HW", normalized_anchor=False, normalized_shape=False)


def rows(
    plans: np.ndarray, orientation: np.ndarray, height: np.ndarray, width: np.ndarray
) -> np.ndarray:
    """The graph's rows for ``plans`` (N x 11) of samples whose store records give ``orientation``
    and the ``height`` x ``width`` as displayed (orientation applied).

    crop1 is a box on the displayed image; the graph cuts it from the stored pixels before
    orienting, so it is moved there: un-flipped, then un-transposed (``_roi.coded_box``,
    vectorized). Orientations outside 1-8 mean 1, as everywhere in gpucache."""
    plans = np.asarray(plans, dtype=np.int64)
    steps = steps_of(orientation)
    transpose, flip_v, flip_h = steps[:, 0], steps[:, 1], steps[:, 2]
    top, left, h, w = (plans[:, c] for c in (Col.TOP1, Col.LEFT1, Col.HEIGHT1, Col.WIDTH1))
    top = np.where(flip_v, np.asarray(height) - top - h, top)
    left = np.where(flip_h, np.asarray(width) - left - w, left)
    box = np.where(
        transpose[:, None], np.stack([left, top, w, h], 1), np.stack([top, left, h, w], 1)
    )
    out = np.concatenate([box, steps.astype(np.int64), plans[:, AFTER_BOX1]], axis=1)
    return np.ascontiguousarray(out, dtype=np.int32)


@pipeline_def(enable_conditionals=True)
def _graph(gpu: bool, hw_decoder_load: float, fill: int) -> DataNode:
    enc = fn.external_source(name="enc", dtype=types.DALIDataType.UINT8, ndim=1, no_copy=True)
    row = fn.external_source(name="plan", dtype=types.DALIDataType.INT32, ndim=1)
    decoder: dict[str, Any] = (
        dict(device="mixed", hw_decoder_load=hw_decoder_load, jpeg_fancy_upsampling=True)
        if gpu
        else dict(device="cpu")
    )
    img = fn.decoders.image(
        enc, output_type=types.DALIImageType.RGB, adjust_orientation=False, **decoder
    )
    img = fn.slice(img, row[0:2], row[2:4], **_PIXELS)
    if row[4] != 0:  # split and merge by sample: only the samples that need it are copied
        # the layout stays "HWC": both branches must merge with the same one
        img = fn.transpose(img, perm=[1, 0, 2], transpose_layout=False)
    if (row[5] | row[6]) != 0:
        img = fn.flip(img, vertical=row[5], horizontal=row[6])
    resized = fn.resize(
        img,
        resize_y=fn.cast(row[7], dtype=types.DALIDataType.FLOAT),
        resize_x=fn.cast(row[8], dtype=types.DALIDataType.FLOAT),
        antialias=True,
        interp_type=types.DALIInterpType.INTERP_LINEAR,
    )
    # one input, one DataNode out: DALI's stub for resize returns a union of its forms
    img = fn.slice(
        resized,  # type: ignore[arg-type]
        row[9:11],
        row[11:13],
        out_of_bounds_policy="pad",
        fill_values=fill,
        **_PIXELS,
    )
    return fn.crop_mirror_normalize(
        img, mirror=row[13], dtype=types.DALIDataType.UINT8, output_layout="CHW"
    )


def define(
    *,
    gpu: bool,
    device_id: int | None,
    batch_size: int,
    num_threads: int,
    seed: int,
    hw_decoder_load: float,
    fill: int = 0,
) -> Pipeline:
    """The graph as a pipeline, not yet built; ``fill`` is the value where a plan pads. ``gpu=True`` with ``device_id=None`` defines (and
    serializes) the GPU graph without a GPU, which is how it is checked where there is none."""
    pipe = _graph(
        gpu=gpu,
        hw_decoder_load=hw_decoder_load,
        fill=fill,
        batch_size=batch_size,
        num_threads=num_threads,
        device_id=device_id,
        seed=seed,
        prefetch_queue_depth=1,
        exec_dynamic=True,  # lets outputs be bound to the consumer's stream
    )
    return pipe
