"""A whole batch's geometric plans in a constant number of tensor ops a chunk, on any device.

The per-image executor (:func:`gpucache.decode._apply.apply_plan`) crops, resizes, crops again and
flips one image at a time: five to seven ops an image, each a kernel launch on CUDA. Here a chunk
of the batch (images of similar crop size, below) takes the same plans in a constant number of
ops whatever its size (about 15 for the batch plus 27 a chunk, measured on the emulated GPU),
because every step of a plan is linear and separable:

1. **gather**: a chunk's images (any sizes, any dense layout) are joined into one flat buffer (one
   ``cat``; a chunk of one image reads its own), and one advanced-indexing op reads every image's
   first crop box into a padded
   ``(N, Hc, 3, Wc)`` batch. The addresses are the sum of two small broadcast index tensors
   (where each row of each channel starts, (N, Hc, 3), and the column part, (N, Wc); affine in
   their indices, made on the device from 8 numbers an image) over an overlapping ``as_strided``
   view whose element ``[a, b]`` is ``flat[a + b]``, so no per-pixel index is ever built; EXIF
   orientation (transpose, flips) is folded into those parts, so a decoder that skips the tag
   costs nothing extra;
2. **resize, second crop, flip** as two batched matrix products ``A @ X @ Bᵀ``: ``A`` (N, OH, Hc)
   and ``B`` (N, OW, Wc) hold, per output row and column, the antialiased bilinear filter taps
   torch's ``interpolate(mode="bilinear", antialias=True)`` uses; the second crop picks rows of
   them (rows outside the resized image are zero: the zero padding), a flip reverses them, and
   padded rows and columns of ``X`` get zero weight;
3. **round, clamp, uint8** into an (N, 3, OH, OW) batch.

The host computes, per image and output row or column, where its filter window starts (NumPy over
(N, OH + OW) values); that and the index parts of every chunk cross in one copy (pinned,
``non_blocking``, on CUDA), and the device expands them to the taps (about a dozen ops a chunk for
both axes together) and to dense ``A``/``B`` (one ``scatter_add_`` each). The result equals the per-image float path up to float
rounding (at most one level, in 0.013% of values on real photos) and the CPU's fixed-point uint8
path within one level (``benchmarks/batched_transforms.py``).

The batch is cut into chunks by :func:`gpucache.transforms._chunks.plan_chunks`: crop boxes sorted
by size, a cut wherever padding to the chunk's largest box would waste more than half of the
arithmetic or the chunk's buffers would pass ``BUDGET_BYTES`` (256 MiB, every buffer counted), so an
outlier photo neither inflates the whole batch nor holds gigabytes of the GPU. Each chunk writes
its rows of the batch's output (one ``index_copy_``; a batch of one chunk is written in place); a
:class:`~gpucache.transforms._chunks.Scratch` keeps the intermediates in one block across batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..base._plan import PLAN_WIDTH, Col
from ._chunks import BUDGET_BYTES, Chunk, Scratch, plan_chunks
from ._orientation import steps_of


def _taps_host(
    length: np.ndarray,
    resized: np.ndarray,
    start2: np.ndarray,
    out: int,
    flip: np.ndarray,
    span: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One axis's filter per output position, as torch's ``_upsample_bilinear2d_aa`` defines it
    (support = the scale when shrinking, else 1; a triangle normalised per output): a resize
    ``length`` -> ``resized``, then ``span`` output positions from ``start2``, mirrored over
    ``span`` where ``flip``. ``out`` (>= ``span``) is the row length of the arrays, so both axes
    of a chunk share one layout; positions from ``span`` on are never read.

    Returns, per image and output position (N, out): the first input index of the window (the
    crop's ``length`` where the position is outside the resized image: the second crop's zero
    padding, whose taps all fall past the box) and its offset ``first - center + 0.5``; per
    image the inverse filter scale and the support (a window holds at most ``ceil(2 *
    support) + 1`` taps).
    :func:`_taps_device` expands them to (N, out, K) taps."""
    length = length.astype(np.float64)
    scale = length / resized.astype(np.float64)
    support = np.maximum(scale, 1.0)
    o = np.arange(out, dtype=np.float64)[None, :]
    pos = np.where(flip[:, None], start2[:, None] + span - 1 - o, start2[:, None] + o)
    center = scale[:, None] * (pos + 0.5)
    first = np.maximum(np.trunc(center - support[:, None] + 0.5), 0.0)
    inside = (pos >= 0) & (pos < resized[:, None])
    return (
        np.where(inside, first, length[:, None]).astype(np.float32),
        (first - center + 0.5).astype(np.float32),
        (1.0 / support).astype(np.float32),
        support,
    )


def _taps_device(
    first: torch.Tensor, offset: torch.Tensor, inv: torch.Tensor, last: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Input indices and normalised weights (N, out, k) from :func:`_taps_host`'s arrays
    (``last``: the crop box's last index), in a fixed number of ops whatever N: a tap past the
    crop box (or the window) has weight 0."""
    j = torch.arange(k, dtype=torch.float32, device=first.device)
    w = torch.rsub((offset[..., None] + j).mul_(inv[:, None, None]).abs_(), 1).clamp_min_(0)
    index = first[..., None] + j
    w.mul_(index <= last[:, None, None])
    w.div_(w.sum(-1, keepdim=True).clamp_min_(1e-30))
    return torch.minimum(index, last[:, None, None]).to(torch.int64), w


def _gather_parts(
    shapes: np.ndarray,
    strides: np.ndarray,
    plans: np.ndarray,
    orient: np.ndarray,
    bases: np.ndarray,
) -> np.ndarray:
    """Per image, the affine address parts of its first crop box in the flat buffer (element
    strides (channel, row, column) per image), displayed under its orientation: row ``i`` of the
    box starts at ``row0 + row_step * min(i, h1 - 1)`` (clamped inside the box), column ``j`` at
    ``col0 + col_step * min(j, w1 - 1)``, channel ``c`` at ``base + c * channel_stride``.

    Returns (8, N) int64: row0, row_step, h1 - 1, col0, col_step, w1 - 1, base, channel stride."""
    hs, ws = shapes[:, 0], shapes[:, 1]
    sc, sr, sx = strides[:, 0], strides[:, 1], strides[:, 2]
    table = steps_of(orient)
    transpose, flip_r, flip_c = table[:, 0], table[:, 1], table[:, 2]
    hd = np.where(transpose, ws, hs)  # displayed size
    wd = np.where(transpose, hs, ws)
    t1, l1, h1, w1 = (plans[:, c] for c in (Col.TOP1, Col.LEFT1, Col.HEIGHT1, Col.WIDTH1))
    s_row = np.where(transpose, sx, sr)  # a displayed row is a stored column when transposed
    s_col = np.where(transpose, sr, sx)
    row0 = np.where(flip_r, hd - 1 - t1, t1) * s_row
    col0 = np.where(flip_c, wd - 1 - l1, l1) * s_col
    return np.stack(
        [
            row0,
            np.where(flip_r, -s_row, s_row),
            h1 - 1,
            col0,
            np.where(flip_c, -s_col, s_col),
            w1 - 1,
            bases,
            sc,
        ]
    ).astype(np.int64)


def _gather_device(
    parts: torch.Tensor, hc: int, wc: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row (N, Hc), channel (N, 3) and column (N, Wc) address parts from :func:`_gather_parts`'s
    (8, N) values, in a fixed number of ops."""
    row0, row_step, h_last, col0, col_step, w_last, base, chan = parts.unbind(0)
    i = torch.arange(max(hc, wc, 3), dtype=torch.int64, device=parts.device)
    rows = row0[:, None] + row_step[:, None] * torch.minimum(i[:hc], h_last[:, None])
    cols = col0[:, None] + col_step[:, None] * torch.minimum(i[:wc], w_last[:, None])
    chans = base[:, None] + chan[:, None] * i[:3]
    return rows, chans, cols


def _view_sizes(parts: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Each chunk's strided view sizes (chunks of images from ``starts``): one more than its
    largest channel, row and column parts. (3, chunks)."""
    row0, row_step, h_last, col0, col_step, w_last, base, chan = parts
    rows = np.maximum(row0, row0 + row_step * h_last)
    cols = np.maximum(col0, col0 + col_step * w_last)
    return np.maximum.reduceat(np.stack([base + 2 * chan, rows, cols]), starts, axis=1) + 1


def _upload(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """The arrays on ``device`` in one copy (pinned and ``non_blocking`` on CUDA): views of one
    uploaded byte buffer, each 8-byte aligned."""
    sizes = [a.nbytes for a in arrays]
    padded = [(s + 7) // 8 * 8 for s in sizes]
    blob = np.zeros(sum(padded), dtype=np.uint8)
    offset = 0
    for a, p in zip(arrays, padded):
        blob[offset : offset + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
        offset += p
    host = torch.from_numpy(blob)
    if device.type == "cuda":
        host = host.pin_memory()
    dev = host.to(device, non_blocking=True)
    out, offset = [], 0
    for a, p in zip(arrays, padded):
        dtype = torch.float32 if a.dtype == np.float32 else torch.int64
        out.append(dev[offset : offset + a.nbytes].view(dtype).view(a.shape))
        offset += p
    return out


def resample(
    images: Sequence[torch.Tensor],
    plans: np.ndarray,
    *,
    orientations: np.ndarray | None = None,
    budget_bytes: int = BUDGET_BYTES,
    scratch: Scratch | None = None,
) -> torch.Tensor:
    """Run every image's plan (crop, antialiased bilinear resize, zero-padded crop, flip) on a
    batch whose plans share one output size: ``(N, 3, OH, OW)`` uint8 on the images' device.

    ``images``: RGB uint8 (3, H, W) tensors as *stored* (before EXIF orientation), on one device;
    ``orientations``: each image's EXIF orientation (1-8; None: all 1, e.g. a decoder that
    applied it). ``plans``: the (N, 11) plans of :mod:`gpucache.transforms`, in displayed
    coordinates. ``budget_bytes``: the device memory the call may hold
    (:func:`~gpucache.transforms._chunks.plan_chunks` cuts the batch to fit it and to bound the
    padding). ``scratch``: where the intermediates live (a fresh allocation each otherwise).
    Device-agnostic: the same function runs on CPU tensors in CI."""
    plans = np.asarray(plans, dtype=np.int64).reshape(-1, PLAN_WIDTH)
    n = len(images)
    if n != len(plans):
        raise ValueError(f"resample: {n} images but {len(plans)} plans; give one plan an image.")
    if n == 0:
        raise ValueError("resample: an empty batch has no device; handle it before calling.")
    oh, ow = int(plans[0, Col.HEIGHT2]), int(plans[0, Col.WIDTH2])
    if not (np.all(plans[:, Col.HEIGHT2] == oh) and np.all(plans[:, Col.WIDTH2] == ow)):
        raise ValueError(
            "resample: the plans give several output sizes; a batch tensor needs "
            "one (use the per-image path for variable sizes)."
        )
    orient = (
        np.ones(n, dtype=np.int64)
        if orientations is None
        else np.asarray(orientations, dtype=np.int64).reshape(n)
    )
    device = images[0].device
    flats, strides_ = zip(*(_flat(im) for im in images))
    shapes = np.array([im.shape[-2:] for im in images], dtype=np.int64).reshape(n, 2)
    strides = np.array(strides_, dtype=np.int64).reshape(n, 3)
    chunks, hosts, arrays = host_plan(shapes, strides, plans, orient, budget_bytes)
    parts_d, order_d, *taps_d = _upload(arrays, device)
    hc = max(h.box[0] for h in hosts)
    wc = max(h.box[1] for h in hosts)
    rows_d, chans_d, cols_d = _gather_device(parts_d, hc, wc)
    out = torch.empty((n, 3, oh, ow), dtype=torch.uint8, device=device)
    start = 0
    for c, h in zip(chunks, hosts):
        end = start + len(c.rows)
        batch, two = slice(start, end), slice(2 * start, 2 * end)
        first, offset, inv, last = (t[two] for t in taps_d)
        _run_chunk(
            [flats[i] for i in c.rows.tolist()],
            h,
            _taps_device(first, offset, inv, last, h.taps),
            (rows_d[batch, : h.box[0]], chans_d[batch], cols_d[batch, : h.box[1]]),
            c.band,
            out if len(chunks) == 1 else (out, order_d[batch]),
            scratch,
        )
        start = end
    return out


def _flat(im: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """A 1-D view of a (3, H, W) image's elements and its (channel, row, column) strides in it:
    no copy for any dense layout (CHW as nvJPEG writes it, HWC permuted as libjpeg-turbo's)."""
    if im.dim() != 3 or im.shape[0] != 3:
        raise ValueError(f"resample takes RGB (3, H, W) images, got shape {tuple(im.shape)}")
    strides = im.stride()
    order = sorted(range(3), key=lambda d: -strides[d])
    dense = im.permute(order)
    if not dense.is_contiguous():
        im = im.contiguous()
        return im.view(-1), (im.stride(0), im.stride(1), im.stride(2))
    return dense.reshape(-1), (im.stride(0), im.stride(1), im.stride(2))


@dataclass
class _Host:
    """What the host computes for one chunk (NumPy only): the sizes its device ops need."""

    taps: int  # most taps a filter window holds
    box: tuple[int, int]  # (Hc, Wc): the padded crop box
    view: tuple[int, int, int]  # the strided view's sizes
    total: int  # elements of the joined images


def host_plan(
    shapes: np.ndarray, strides: np.ndarray, plans: np.ndarray, orient: np.ndarray, budget: int
) -> tuple[list[Chunk], list[_Host], list[np.ndarray]]:
    """The host's part of :func:`resample` for images of ``shapes`` (N, 2) with element
    ``strides`` (N, 3), NumPy over (N, OH + OW) values: the chunks, each one's sizes, and what
    crosses to the device in one copy: the address parts (8, N) and the batch's rows in chunk
    order, then per chunk its heights' and its widths' filter windows (first, offset: (2n, O);
    inverse scale, last index of the box: (2n,)), chunk after chunk."""
    chunks = plan_chunks(plans, shapes[:, 0] * shapes[:, 1] * 3, budget)
    n = len(plans)
    if len(chunks) == 1:
        chunks[0].rows = np.arange(n)  # one chunk: the batch's own order
    order = np.concatenate([c.rows for c in chunks])
    counts = np.array([len(c.rows) for c in chunks])
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    shapes, strides, plans, orient = shapes[order], strides[order], plans[order], orient[order]
    sizes = shapes[:, 0] * shapes[:, 1] * 3
    ends = np.cumsum(sizes)
    bases = ends - sizes - np.repeat(ends[starts] - sizes[starts], counts)  # joined per chunk
    parts = _gather_parts(shapes, strides, plans, orient, bases)
    # both axes' filters in one set of rows a chunk: its n heights, then its n widths
    # (a flip mirrors over the output's width, not over the longer side)
    oh, ow = int(plans[0, Col.HEIGHT2]), int(plans[0, Col.WIDTH2])
    o = max(oh, ow)
    h1, w1 = plans[:, Col.HEIGHT1], plans[:, Col.WIDTH1]
    hy = _taps_host(h1, plans[:, Col.RH], plans[:, Col.TOP2], o, np.zeros(n, dtype=bool), oh)
    flips = plans[:, Col.FLIP].astype(bool)
    hx = _taps_host(w1, plans[:, Col.RW], plans[:, Col.LEFT2], o, flips, ow)
    laid = np.concatenate([np.r_[a : a + m, n + a : n + a + m] for a, m in zip(starts, counts)])
    first, offset, inv = (np.concatenate([y, x])[laid] for y, x in zip(hy[:3], hx[:3]))
    last = (np.concatenate([h1, w1]).astype(np.float32) - 1)[laid]
    support = np.maximum(hy[3], hx[3])
    taps = np.ceil(2 * np.maximum.reduceat(support, starts)).astype(np.int64) + 1
    views = _view_sizes(parts, starts)
    totals = np.add.reduceat(sizes, starts)
    hosts = [
        _Host(int(taps[k]), c.box, (int(v[0]), int(v[1]), int(v[2])), int(totals[k]))
        for k, (c, v) in enumerate(zip(chunks, views.T))
    ]
    return chunks, hosts, [parts, order, first, offset, inv, last]


def _run_chunk(
    flats: list[torch.Tensor],
    host: _Host,
    taps: tuple[torch.Tensor, torch.Tensor],
    address: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    band: int,
    out: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    scratch: Scratch | None,
) -> None:
    """One chunk on the device (``taps``: its filter taps' indices and weights, ``address``: its
    gather's row, channel and column parts): written into ``out``, the batch's output when the
    chunk is the whole batch in order, else an (output, rows) pair. ``band``: rows of the crop
    box gathered and multiplied at a time (the products accumulate)."""
    n, (hc, wc), (s0, s1, s2), total = len(flats), host.box, host.view, host.total
    oh, ow = out.shape[-2:] if isinstance(out, torch.Tensor) else out[0].shape[-2:]
    index, weight = taps
    rows_d, chans_d, cols_d = address
    starts = rows_d[:, :, None] + chans_d[:, None, :]  # (N, Hc, 3): where each row starts
    band = min(band, hc)
    # the products reuse the gathered box's memory (dead by then) where it is large enough
    gathered_n, result_n = n * band * 3 * wc, n * 3 * oh * ow
    f32, u8 = torch.float32, torch.uint8
    specs = [
        ((max(gathered_n, result_n),), u8),  # the gathered box, then the uint8 result
        ((max(gathered_n, result_n),), f32),  # the box in float32, then the second product
        ((n, oh, hc), f32),
        ((n, ow, wc), f32),
        ((n, oh, 3 * wc), f32),
    ]
    if n > 1:
        # the strided view's bounds reach past the images (never read: every address is
        # clamped inside its image), so the images are joined into the head of a longer buffer
        specs.append(((max(total, s0 + s1 + s2 - 1),), u8))
    device = flats[0].device
    if scratch is None:
        bufs = [torch.empty(sh, dtype=dt, device=device) for sh, dt in specs]
    else:
        bufs = scratch.take(specs, device)
    gathered, x, a, b, y = bufs[:5]
    if n > 1:
        flat = bufs[5]
        torch.cat(flats, out=flat[:total])
    else:  # one image: its own elements, which the view's bounds end at exactly
        flat = flats[0]
    view = flat.as_strided((s0 + s1 - 1, s2), (1, 1))  # view[a, b] is flat[a + b]
    a.zero_().scatter_add_(2, index[:n, :oh], weight[:n, :oh])
    b.zero_().scatter_add_(2, index[n:, :ow], weight[n:, :ow])
    for r0 in range(0, hc, band):
        bh = min(band, hc - r0)
        g = gathered[: n * bh * 3 * wc].view(n, bh, 3, wc)
        torch.ops.aten.index.Tensor_out(
            view, [starts[:, r0 : r0 + bh, :, None], cols_d[:, None, None, :]], out=g
        )  # (N, bh, 3, Wc): channels between rows/cols
        xb = x[: n * bh * 3 * wc].view(n, bh, 3 * wc)
        xb.view(n, bh, 3, wc).copy_(g)
        if r0 == 0:
            torch.bmm(a[:, :, :bh], xb, out=y)
        else:
            y.baddbmm_(a[:, :, r0 : r0 + bh], xb)
    z = x[:result_n].view(n, oh * 3, ow)
    torch.bmm(y.view(n, oh * 3, wc), b.transpose(1, 2), out=z)
    zz = z.view(n, oh, 3, ow).permute(0, 2, 1, 3).round_().clamp_(0, 255)
    if isinstance(out, torch.Tensor):
        out.copy_(zz)  # integral values: the cast is exact
    else:
        result = gathered[:result_n].view(n, 3, oh, ow)
        result.copy_(zz)
        out[0].index_copy_(0, out[1], result)
