"""Reduced-size (DCT-scaled) decode: exact within its scale, and within the stated tolerance of
exact decode (docs/guides/backends.md).

``exact=False`` decodes a box with at least 2 scaled pixels per output pixel each way at 1/2, 1/4
or 1/8 scale; a crop of a scaled decode is bit-identical to the same crop of the whole scaled
decode, through the region decoder and the restart-marker segment decoder alike.
"""

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from gpucache import GpuCachedLoader, JpegCache
from gpucache import transforms as T
from gpucache.decode import _roi, _roi_rst
from gpucache.decode._apply import apply_plan
from gpucache.decode._core import decode_batch
from gpucache.decode._options import DecodeOptions
from gpucache.decode._sample import decode_sample
from gpucache.decode._scaled import fast_plan, reduced_scale
from gpucache.testing import natural_image

pytestmark = pytest.mark.skipif(not _roi._c_ok(), reason="compiled region decoder not built")
#: 160 x 96, luma 4x2, chroma 1x1 (4:1 one way, 2:1 the other), quality 90, written by
#: libjpeg-turbo 2.1.5 (jpeg_set_defaults + those factors) from natural_image(160, 96, seed=2)
ODD = Path(__file__).parent / "data" / "sampling_42_11_11.jpg"


def _jpeg(w: int, h: int, seed: int, **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(natural_image(w, h, seed=seed)).convert(kw.pop("mode", "RGB")).save(
        buf, "JPEG", quality=90, **kw
    )
    return buf.getvalue()


@pytest.mark.parametrize(
    "kw",
    [
        dict(subsampling=2),
        dict(subsampling=1),
        dict(subsampling=0),
        dict(mode="L"),
        dict(subsampling=2, progressive=True),
    ],
    ids=["420", "422", "444", "gray", "progressive"],
)
def test_scaled_crops_equal_the_crop_of_the_scaled_image(kw):
    data = _jpeg(301, 203, 5, **dict(kw))
    rst, k = _roi_rst.transcode(data)
    arr = np.frombuffer(rst, dtype=np.uint8)
    rng = np.random.default_rng(1)
    for d in (2, 4, 8):
        sh, sw = -(-203 // d), -(-301 // d)
        full = _roi._c_region(data, 0, 0, sh, sw, height=sh, width=sw, denom=d)
        assert full.shape == (3, sh, sw)
        for _ in range(12):
            bh, bw = int(rng.integers(1, sh + 1)), int(rng.integers(1, sw + 1))
            t, l = int(rng.integers(0, sh - bh + 1)), int(rng.integers(0, sw - bw + 1))
            want = full[:, t : t + bh, l : l + bw]
            assert torch.equal(
                _roi._c_region(data, t, l, bh, bw, height=sh, width=sw, denom=d), want
            ), (d, t, l, bh, bw)
            got = _roi_rst.decode_crop(
                arr,
                k,
                (t * d, l * d, bh * d, bw * d),
                _roi.Oriented(203, 301),
                region=_roi._c_region,
                denom=d,
            )
            ts, ls, hs, ws = _roi.scaled_box(t * d, l * d, bh * d, bw * d, 203, 301, d)[:4]
            assert torch.equal(got, full[:, ts : ts + hs, ls : ls + ws]), (d, t, l, bh, bw)


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    root = tmp_path_factory.mktemp("big")
    paths = []
    for k, (w, h) in enumerate([(1200, 900), (900, 1200), (1600, 1067)]):
        p = root / f"{k}.jpg"
        p.write_bytes(_jpeg(w, h, 10 + k, subsampling=2 if k != 1 else 1))
        paths.append(p)
    return JpegCache.from_files(paths, labels=[0, 1, 2], progress=False)


@pytest.mark.parametrize("aligned", [True, False], ids=["on-grid", "any-box"])
@pytest.mark.parametrize(
    "transform",
    [
        T.Compose([T.RandomResizedCrop(112), T.RandomHorizontalFlip()]),
        T.Compose([T.Resize(128), T.CenterCrop(112)]),
    ],
    ids=["train", "eval"],
)
def test_scaled_decode_is_within_the_stated_tolerance(big, transform, aligned):
    """Mean |difference| per image <= 1.5 levels for boxes on the 1/d grid (the filter: DCT
    scaling, then the antialiased resize of the rest), <= 3 for any box (the edges of a
    training box off the grid take context outside it, or a finer scale)."""
    s, idx = big.samples, np.repeat(np.arange(len(big)), 6)
    hs, ws = s["height"][idx].astype(np.int64), s["width"][idx].astype(np.int64)
    plans = transform.plan(hs, ws, np.random.default_rng(4))
    scales = [
        fast_plan(p, h, w, scalable=True)[1]
        for p, h, w in zip(plans.tolist(), hs.tolist(), ws.tolist())
    ]
    assert max(scales) >= 4  # the plans really shrink these images
    if aligned:
        for p, d in zip(plans, scales):
            p[:4] -= p[:4] % d
    exact = decode_batch(big, idx, plans, DecodeOptions(on_error="raise"), stack=True).images
    fast = decode_batch(
        big, idx, plans, DecodeOptions(on_error="raise", exact=False), stack=True
    ).images
    diff = (fast.int() - exact.int()).abs().float().mean(dim=(1, 2, 3))
    assert diff.max() <= (1.5 if aligned else 3), diff.tolist()
    assert (diff[torch.tensor(scales) > 1] > 0).all()  # and they were decoded scaled
    assert torch.equal(exact[0], apply_plan(decode_sample(big, int(idx[0])), plans[0]))


def test_sampling_it_cannot_scale_exactly_takes_the_exact_path():
    data = ODD.read_bytes()
    with pytest.raises(_roi.ScaleRefused):
        _roi._c_region(data, 0, 0, 10, 10, height=48, width=80, denom=2)
    store = JpegCache.from_files([ODD], progress=False)
    plans = np.asarray([[0, 0, 96, 160, 10, 15, 0, 0, 10, 15, 0]], dtype=np.int64)
    assert reduced_scale(96, 160, 10, 15) == 4
    a = decode_batch(
        store, np.zeros(1, np.int64), plans, DecodeOptions(on_error="raise"), stack=True
    )
    b = decode_batch(
        store,
        np.zeros(1, np.int64),
        plans,
        DecodeOptions(on_error="raise", exact=False),
        stack=True,
    )
    assert torch.equal(a.images, b.images)


def test_loader_exact_switch(big):
    t = T.Compose([T.Resize(128), T.CenterCrop(112)])
    out = {}
    for exact in (True, False):
        with GpuCachedLoader(
            big, batch_size=3, num_workers=0, backend="cpu", transform=t, exact=exact
        ) as loader:
            ((out[exact], _),) = list(loader)
    plans = t.plan(
        big.samples["height"].astype(np.int64),
        big.samples["width"].astype(np.int64),
        np.random.default_rng(0),
    )
    ref = torch.stack([apply_plan(decode_sample(big, i), plans[i]) for i in range(3)])
    assert torch.equal(out[True], ref)
    assert not torch.equal(out[False], ref)
    assert (out[False].int() - ref.int()).abs().float().mean() <= 4


@pytest.mark.parametrize(
    "transform",
    [T.Compose([T.RandomResizedCrop(64)]), T.Compose([T.Resize(80), T.CenterCrop(64)])],
    ids=["train", "eval"],
)
def test_scaled_decode_follows_exif_orientation(tmp_path, transform):
    """The box is mapped to the coded image before it is scaled, and its edges are put on the
    coded image's 1/d grid (which starts at the far end of a flipped axis; 1003 x 701 is no
    multiple of d): every orientation is as close to exact as the unrotated image (a grid
    taken from the wrong end: up to 3.7 levels here; a wrong mapping: tens of levels)."""
    pixels = Image.fromarray(natural_image(1003, 701, seed=7))
    paths = []
    for o in range(1, 9):
        exif = Image.Exif()
        exif[0x0112] = o
        paths.append(tmp_path / f"o{o}.jpg")
        pixels.save(paths[-1], quality=90, exif=exif.tobytes())
    store = JpegCache.from_files(paths, progress=False)
    idx = np.repeat(np.arange(8), 4)
    hw = (
        store.samples["height"][idx].astype(np.int64),
        store.samples["width"][idx].astype(np.int64),
    )
    plans = transform.plan(*hw, np.random.default_rng(2))
    exact = decode_batch(store, idx, plans, DecodeOptions(on_error="raise"), stack=True).images
    fast = decode_batch(
        store, idx, plans, DecodeOptions(on_error="raise", exact=False), stack=True
    ).images
    diff = (fast.int() - exact.int()).abs().float().mean(dim=(1, 2, 3))
    scaled = torch.tensor(
        [
            fast_plan(p, h, w, orientation=o, scalable=True)[1] > 1
            for p, h, w, o in zip(plans.tolist(), *hw, store.samples["orientation"][idx])
        ]
    )
    assert scaled.sum() >= 16 and (diff[scaled] > 0).all()
    assert diff.max() <= 2, diff.view(8, 4).tolist()


@pytest.mark.parametrize("hw", [(1500, 2000), (375, 500), (500, 333), (200, 150), (1067, 1600)])
def test_a_crop_after_a_resize_is_cut_before_it(hw):
    """Resize(256) + CenterCrop(224): the first box becomes the centre crop's part of the image
    plus context, resized so that each crop pixel is sampled where the full resize samples it
    (to a tenth of a source pixel here, on the grid of the DCT scale it will take); plans whose
    crop comes first, or whose crop pads, stay as they are."""
    h, w = hw
    plan = (
        T.Compose([T.Resize(256), T.CenterCrop(224), T.RandomHorizontalFlip(1.0)])
        .plan(np.array([h]), np.array([w]), np.random.default_rng(0))[0]
        .tolist()
    )
    t1, l1, h1, w1, rh, rw, t2, l2, h2, w2, flip = plan
    got, d = fast_plan(plan, h, w, scalable=True)
    top, left, hb, wb, nh, nw, ot, ol = got[:8]
    assert got[8:] == [224, 224, 1] and 0 <= top and top + hb <= h and 0 <= left and left + wb <= w
    assert hb * wb < h * w  # a smaller box than the whole image
    for start, length, n, o, c, size, r in (
        (top, hb, nh, ot, t2, h, rh),
        (left, wb, nw, ol, l2, w, rw),
    ):
        j = np.arange(224) + 0.5
        err = np.abs(start + (j + o) * length / n - (c + j) * size / r)  # source positions
        assert err.max() <= 0.1 * max(d, 2), (start, length, n, o, err.max())
        assert o >= 1 or c == 0  # context before the crop, unless it starts at the image edge
        assert start % d == 0
    train = (
        T.Compose([T.RandomResizedCrop(224)])
        .plan(np.array([h]), np.array([w]), np.random.default_rng(0))[0]
        .tolist()
    )
    fast, d = fast_plan(train, h, w, scalable=True)
    assert fast == train or d > 1  # its crop is already before the resize: as it is, unscaled
    padded = (
        T.Compose([T.Resize(100), T.CenterCrop(120)])
        .plan(np.array([h]), np.array([w]), np.random.default_rng(0))[0]
        .tolist()
    )
    assert fast_plan(padded, h, w, scalable=True) == (padded, 1)  # a crop that pads stays


def test_a_centre_crop_cut_first_samples_near_the_full_resize_at_every_size():
    """Over 5,460 image sizes (150 to 3,000 pixels each way): the fused plan samples each crop
    pixel within 0.1 x max(d, 2) source pixels of where the full resize does for 99% of sizes,
    and never further than 0.24 x max(d, 2) nor 0.09 output pixels (a box edge is a whole pixel
    on the 1/d grid; where the scale is near a multiple of d and no nearby edge lands within
    0.05 output pixels, the next finer scale is taken)."""
    hs, ws = np.meshgrid(np.arange(150, 3001, 37), np.arange(150, 3001, 41), indexing="ij")
    hs, ws = hs.ravel(), ws.ravel()
    plans = T.Compose([T.Resize(256), T.CenterCrop(224)]).plan(hs, ws, np.random.default_rng(0))
    j = np.arange(224) + 0.5
    worst, shifts = [], []
    for h, w, plan in zip(hs.tolist(), ws.tolist(), plans.tolist()):
        t2, l2, rh, rw = plan[6], plan[7], plan[4], plan[5]
        fused, d = fast_plan(plan, h, w, scalable=True)
        top, left, hb, wb, nh, nw, ot, ol = fused[:8]
        err = max(
            np.abs(start + (j + o) * length / n - (c + j) * size / r).max()
            for start, length, n, o, c, size, r in (
                (top, hb, nh, ot, t2, h, rh),
                (left, wb, nw, ol, l2, w, rw),
            )
        )
        worst.append(err / max(d, 2))
        shifts.append(err * 256 / min(h, w))  # in output pixels
    worst = np.asarray(worst)
    assert (worst <= 0.1).mean() >= 0.99 and worst.max() <= 0.24, (
        (worst <= 0.1).mean(),
        worst.max(),
    )
    assert max(shifts) <= 0.09, max(shifts)


def test_eval_decodes_only_the_centre_crop_without_exact(tmp_path):
    """Photo-size images (no DCT scaling): exact=False decodes the fused plan, within a fraction
    of a level of the exact output on average; exact=True is untouched."""
    paths = []
    for k, (w, h) in enumerate([(500, 375), (375, 500), (640, 427)]):
        paths.append(tmp_path / f"{k}.jpg")
        paths[-1].write_bytes(_jpeg(w, h, 20 + k, subsampling=2))
    store = JpegCache.from_files(paths, progress=False)
    idx = np.arange(3)
    plans = T.Compose([T.Resize(256), T.CenterCrop(224)]).plan(
        store.samples["height"].astype(np.int64),
        store.samples["width"].astype(np.int64),
        np.random.default_rng(0),
    )
    cut = [
        fast_plan(p, h, w, scalable=True)
        for p, h, w in zip(
            plans.tolist(), store.samples["height"].tolist(), store.samples["width"].tolist()
        )
    ]
    assert all(d == 1 for _, d in cut)
    fused = np.asarray([p for p, _ in cut], dtype=np.int64)
    exact = decode_batch(store, idx, plans, DecodeOptions(on_error="raise"), stack=True)
    fast = decode_batch(store, idx, plans, DecodeOptions(on_error="raise", exact=False), stack=True)
    assert fast.roi_decoded == 3 and exact.roi_decoded == 0  # only the crop's box was decoded
    assert torch.equal(
        fast.images,
        decode_batch(store, idx, fused, DecodeOptions(on_error="raise"), stack=True).images,
    )
    diff = (fast.images.int() - exact.images.int()).abs().float().mean(dim=(1, 2, 3))
    assert (diff > 0).all() and diff.max() <= 1.5, diff.tolist()
