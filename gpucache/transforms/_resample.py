"""A whole batch's geometric plans in a constant number of tensor ops, on any device.

The per-image executor (:func:`gpucache.decode._core.apply_plan`) crops, resizes, crops again and
flips one image at a time: five to seven ops an image, each a kernel launch on CUDA. Here the
batch takes the same plans in about a dozen ops whatever its size, because every step of a plan
is linear and separable:

1. **gather**: the images (each contiguous, any sizes) are joined into one flat buffer (one
   ``cat``), and one advanced-indexing op reads every image's first crop box into a padded
   ``(N, Hc, 3, Wc)`` batch. The addresses are the sum of three small broadcast index tensors
   (row, channel, column part) over an overlapping ``as_strided`` view, so no per-pixel index is
   ever built; EXIF orientation (transpose, flips) is folded into those parts, so a decoder that
   skips the tag costs nothing extra;
2. **resize, second crop, flip** as two batched matrix products ``A @ X @ Bᵀ``: ``A`` (N, OH, Hc)
   and ``B`` (N, OW, Wc) hold, per output row and column, the antialiased bilinear filter taps
   torch's ``interpolate(mode="bilinear", antialias=True)`` uses; the second crop picks rows of
   them (rows outside the resized image are zero: the zero padding), a flip reverses them, and
   padded rows and columns of ``X`` get zero weight;
3. **round, clamp, uint8** into an (N, 3, OH, OW) batch.

The filter taps are computed on the host (NumPy, vectorised over the batch) and cross in one
copy (pinned, ``non_blocking``, on CUDA) with the index parts; dense ``A``/``B`` are made on the
device by one ``scatter_add_`` each. The result equals the per-image float path up to float
rounding (at most one level, in a few pixels) and the CPU's fixed-point uint8 path within one
level (measured in ``benchmarks/batched_resize.py``).

A batch whose padded float input would exceed ``budget_bytes`` is split into chunks of images
sorted by crop size (each chunk a constant number of ops), so an outlier image does not inflate
the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

#: EXIF Orientation (1-8) -> (transpose, flip rows, flip columns), applied in that order to the
#: stored pixels to give the displayed image (the same table as the decoders' ``orient``).
ORIENT = {1: (False, False, False), 2: (False, False, True), 3: (False, True, True),
          4: (False, True, False), 5: (True, False, False), 6: (True, False, True),
          7: (True, True, True), 8: (True, True, False)}

#: Padded input held at once (bytes: 3 channels, uint8 gathered + float32 = 15 an output-box
#: pixel); a larger batch is split into chunks.
BUDGET_BYTES = 1 << 30


def aa_taps(in_size: np.ndarray, out_size: np.ndarray, positions: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray]:
    """Antialiased bilinear taps of output ``positions`` (N, M) of a resize ``in_size`` ->
    ``out_size`` (N each): ``(first input index (N, M), weights (N, M, K))``, as torch's
    ``_upsample_bilinear2d_aa`` computes them (support = the scale when shrinking, else 1; a
    triangle filter normalised per output). Positions outside ``[0, out_size)`` get no taps."""
    in_size = in_size.astype(np.float64)[:, None]
    out_size = out_size.astype(np.float64)[:, None]
    scale = in_size / out_size
    support = np.where(scale >= 1.0, scale, 1.0)
    invscale = np.where(scale >= 1.0, 1.0 / scale, 1.0)
    center = scale * (positions + 0.5)
    xmin = np.maximum(np.trunc(center - support + 0.5), 0)
    xmax = np.minimum(np.trunc(center + support + 0.5), in_size)
    size = np.maximum(xmax - xmin, 0)
    k = int(size.max()) if size.size else 1
    j = np.arange(max(k, 1), dtype=np.float64)
    w = np.maximum(0.0, 1.0 - np.abs((j + xmin[..., None] - center[..., None] + 0.5)
                                     * invscale[..., None]))
    w[j >= size[..., None]] = 0.0
    inside = (positions >= 0) & (positions < out_size)
    w[~inside] = 0.0
    total = w.sum(-1, keepdims=True)
    w = np.divide(w, total, out=np.zeros_like(w), where=total != 0)
    return xmin.astype(np.int64), w.astype(np.float32)


def _axis(length: np.ndarray, resized: np.ndarray, start2: np.ndarray, out: int,
          flip: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Scatter indices and weights (N, out, K) of one axis: resize ``length`` -> ``resized``,
    then take ``out`` positions from ``start2`` (reversed where ``flip``); indices are within the
    crop box ``[0, length)``."""
    o = np.arange(out)[None, :]
    pos = np.where(flip[:, None], start2[:, None] + out - 1 - o, start2[:, None] + o)
    start, w = aa_taps(length, resized, pos)
    idx = start[..., None] + np.arange(w.shape[-1])[None, None, :]
    idx = np.minimum(idx, (length - 1)[:, None, None])  # taps past the edge carry weight 0
    return idx, w


def _gather_parts(shapes: np.ndarray, strides: np.ndarray, plans: np.ndarray, orient: np.ndarray,
                  bases: np.ndarray, hc: int, wc: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row (N, Hc), channel (N, 3) and column (N, Wc) address parts of every image's first crop
    box in the flat buffer (element strides (channel, row, column) per image), displayed under
    its orientation (clamped inside the box)."""
    hs, ws = shapes[:, 0], shapes[:, 1]
    sc, sr, sx = strides[:, 0:1], strides[:, 1:2], strides[:, 2:3]
    table = np.array([ORIENT.get(int(o), ORIENT[1]) for o in range(9)], dtype=bool)
    o = np.where((orient >= 1) & (orient <= 8), orient, 1)
    transpose, flip_r, flip_c = table[o, 0], table[o, 1], table[o, 2]
    hd = np.where(transpose, ws, hs)  # displayed size
    wd = np.where(transpose, hs, ws)
    t1, l1, h1, w1 = plans[:, 0], plans[:, 1], plans[:, 2], plans[:, 3]
    y = t1[:, None] + np.minimum(np.arange(hc)[None, :], (h1 - 1)[:, None])
    x = l1[:, None] + np.minimum(np.arange(wc)[None, :], (w1 - 1)[:, None])
    y = np.where(flip_r[:, None], (hd - 1)[:, None] - y, y)  # a row of T(S) after its flips
    x = np.where(flip_c[:, None], (wd - 1)[:, None] - x, x)
    rows = np.where(transpose[:, None], y * sx, y * sr)  # T(S)[y, x] = S[x, y]
    cols = np.where(transpose[:, None], x * sr, x * sx)
    chans = bases[:, None] + np.arange(3)[None, :] * sc
    return rows, chans, cols


class _Tail:
    """A zero tail per device, appended to the flat buffer so the strided view stays in bounds
    (grown, never shrunk; made once on the stream that first uses it, never written after)."""

    def __init__(self) -> None:
        self._by_device: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device, n: int) -> torch.Tensor:
        t = self._by_device.get(device)
        if t is None or t.numel() < n:
            t = self._by_device[device] = torch.zeros(max(n, 1 << 16), dtype=torch.uint8,
                                                      device=device)
        return t[:n]


_TAIL = _Tail()


def _upload(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """The arrays on ``device`` in one copy (pinned and ``non_blocking`` on CUDA): views of one
    uploaded byte buffer, each 8-byte aligned."""
    sizes = [a.nbytes for a in arrays]
    padded = [(s + 7) // 8 * 8 for s in sizes]
    blob = np.zeros(sum(padded), dtype=np.uint8)
    offset = 0
    for a, p in zip(arrays, padded):
        blob[offset:offset + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
        offset += p
    host = torch.from_numpy(blob)
    if device.type == "cuda":
        host = host.pin_memory()
    dev = host.to(device, non_blocking=True)
    out, offset = [], 0
    for a, p in zip(arrays, padded):
        dtype = torch.float32 if a.dtype == np.float32 else torch.int64
        out.append(dev[offset:offset + a.nbytes].view(dtype).view(a.shape))
        offset += p
    return out


def resample(images: Sequence[torch.Tensor], plans: np.ndarray, *,
             orientations: np.ndarray | None = None,
             budget_bytes: int = BUDGET_BYTES) -> torch.Tensor:
    """Run every image's plan (crop, antialiased bilinear resize, zero-padded crop, flip) on a
    batch whose plans share one output size: ``(N, 3, OH, OW)`` uint8 on the images' device.

    ``images``: RGB uint8 (3, H, W) tensors as *stored* (before EXIF orientation), on one device;
    ``orientations``: each image's EXIF orientation (1-8; None: all 1, e.g. a decoder that
    applied it). ``plans``: the (N, 11) plans of :mod:`gpucache.transforms`, in displayed
    coordinates. Device-agnostic: the same function runs on CPU tensors in CI."""
    plans = np.asarray(plans, dtype=np.int64).reshape(-1, 11)
    n = len(images)
    if n != len(plans):
        raise ValueError(f"resample: {n} images but {len(plans)} plans; give one plan an image.")
    if n == 0:
        raise ValueError("resample: an empty batch has no device; handle it before calling.")
    oh, ow = int(plans[0, 8]), int(plans[0, 9])
    if not (np.all(plans[:, 8] == oh) and np.all(plans[:, 9] == ow)):
        raise ValueError("resample: the plans give several output sizes; a batch tensor needs "
                         "one (use the per-image path for variable sizes).")
    orient = (np.ones(n, dtype=np.int64) if orientations is None
              else np.asarray(orientations, dtype=np.int64).reshape(n))
    device = images[0].device
    area = plans[:, 2] * plans[:, 3]
    if n > 1 and int(plans[:, 2].max()) * int(plans[:, 3].max()) * 15 * n > budget_bytes:
        order = np.argsort(area, kind="stable")
        chunks, start, acc_h, acc_w = [], 0, 0, 0
        for k, i in enumerate(order.tolist()):
            acc_h, acc_w = max(acc_h, int(plans[i, 2])), max(acc_w, int(plans[i, 3]))
            if k > start and acc_h * acc_w * 15 * (k + 1 - start) > budget_bytes:
                chunks.append(order[start:k])
                start, acc_h, acc_w = k, int(plans[i, 2]), int(plans[i, 3])
        chunks.append(order[start:])
        if len(chunks) > 1:
            parts = [_resample([images[i] for i in c.tolist()], plans[c], orient[c], device)
                     for c in chunks]
            inverse = np.argsort(np.concatenate(chunks), kind="stable")
            (perm,) = _upload([inverse.astype(np.int64)], device)
            return torch.cat(parts).index_select(0, perm)
    return _resample(list(images), plans, orient, device)


def _flat(im: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """A 1-D view of a (3, H, W) image's elements and its (channel, row, column) strides in it:
    no copy for any dense layout (CHW as nvJPEG writes it, HWC permuted as libjpeg-turbo's)."""
    if im.dim() != 3 or im.shape[0] != 3:
        raise ValueError(f"resample takes RGB (3, H, W) images, got shape {tuple(im.shape)}")
    order = sorted(range(3), key=lambda d: -im.stride(d))
    dense = im.permute(order)
    if not dense.is_contiguous():
        im = im.contiguous()
        return im.view(-1), (im.stride(0), im.stride(1), im.stride(2))
    return dense.reshape(-1), (im.stride(0), im.stride(1), im.stride(2))


def _resample(images: list[torch.Tensor], plans: np.ndarray, orient: np.ndarray,
              device: torch.device) -> torch.Tensor:
    n = len(images)
    oh, ow = int(plans[0, 8]), int(plans[0, 9])
    flats, strides = zip(*(_flat(im) for im in images))
    shapes = np.array([im.shape[-2:] for im in images], dtype=np.int64).reshape(n, 2)
    sizes = shapes[:, 0] * shapes[:, 1] * 3
    bases = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    hc, wc = int(plans[:, 2].max()), int(plans[:, 3].max())
    rows, chans, cols = _gather_parts(shapes, np.array(strides, dtype=np.int64).reshape(n, 3),
                                      plans, orient, bases, hc, wc)
    flip = plans[:, 10].astype(bool)
    ya, yw = _axis(plans[:, 2], plans[:, 4], plans[:, 6], oh, np.zeros(n, dtype=bool))
    xa, xw = _axis(plans[:, 3], plans[:, 5], plans[:, 7], ow, flip)
    rows_d, chans_d, cols_d, ya_d, yw_d, xa_d, xw_d = _upload(
        [rows, chans, cols, ya, yw, xa, xw], device)
    s0, s1, s2 = int(chans.max()) + 1, int(rows.max()) + 1, int(cols.max()) + 1
    total = int(sizes.sum())
    tail = max(0, s0 + s1 + s2 - 2 - total)
    flat = torch.cat([*flats, _TAIL.get(device, tail)])
    view = flat.as_strided((s0, s1, s2), (1, 1, 1))
    x = view[chans_d[:, None, :, None], rows_d[:, :, None, None], cols_d[:, None, None, :]]
    x = x.to(torch.float32).view(n, hc, 3 * wc)  # (N, Hc, 3, Wc): channels between rows/cols
    a = torch.zeros((n, oh, hc), dtype=torch.float32, device=device).scatter_add_(2, ya_d, yw_d)
    b = torch.zeros((n, ow, wc), dtype=torch.float32, device=device).scatter_add_(2, xa_d, xw_d)
    y = torch.bmm(a, x).view(n, oh * 3, wc)
    z = torch.bmm(y, b.transpose(1, 2)).view(n, oh, 3, ow).permute(0, 2, 1, 3)
    return z.round_().clamp_(0, 255).to(torch.uint8, memory_format=torch.contiguous_format)
