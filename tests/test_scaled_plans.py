"""``exact=False`` plans (gpucache/decode/_scaled.py) lose no sample and stay within the tolerance
docs/guides/backends.md states.

Every box a plan cuts is at least a pixel and inside the image, for any image size (1 pixel
across, enlarged hundreds of times, included) and any geometric transform; through the real
loader, thin and tiny images come out as with ``exact=True``. On photo-like images of photo size
(gpucache.testing's: gradients, shaded shapes, texture and grain, ~90 KB at 500 x 375) the mean
absolute difference per image is within the stated bounds.
"""

import numpy as np
import pytest
import torch

from gpucache import GpuCachedLoader, JpegCache
from gpucache import transforms as T
from gpucache.decode import _roi
from gpucache.decode._core import decode_batch
from gpucache.decode._options import DecodeOptions
from gpucache.decode._scaled import fast_plan
from gpucache.testing import make_jpeg_bytes

EVAL = T.Compose([T.Resize(256), T.CenterCrop(224)])
TRANSFORMS = {
    "eval": EVAL,
    "train": T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip()]),
    "train+centre": T.Compose([T.RandomResizedCrop(64), T.CenterCrop(48)]),
    "resize-hw+centre": T.Compose([T.Resize((40, 24)), T.CenterCrop(20)]),
    "centre-pads": T.Compose([T.Resize(30), T.CenterCrop(32)]),
    "centre-only": T.Compose([T.CenterCrop(3)]),
}


def _store(tmp_path, sizes, **kw) -> JpegCache:
    paths = []
    for k, (h, w) in enumerate(sizes):
        paths.append(tmp_path / f"{k:03d}_{h}x{w}.jpg")
        paths[-1].write_bytes(make_jpeg_bytes(w, h, seed=k, **kw))
    return JpegCache.from_files(paths, progress=False)


def _diffs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.int() - b.int()).abs().float().mean(dim=(1, 2, 3))


@pytest.mark.parametrize("orientation", [1, 3, 6])
@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_every_box_is_inside_the_image_and_not_empty(name, orientation):
    """Over every size 1..40 x 1..40 and a spread up to 3,000 px: each box holds at least a
    pixel, lies inside the image, and holds the crop (0 <= offset, offset + crop <= resize)."""
    side = np.r_[1:41, 57, 130, 255, 256, 257, 500, 641, 1999, 3000]
    hs, ws = (a.ravel() for a in np.meshgrid(side, side, indexing="ij"))
    plans = TRANSFORMS[name].plan(hs, ws, np.random.default_rng(0))
    bad = []
    for h, w, plan in zip(hs.tolist(), ws.tolist(), plans.tolist()):
        for scalable in (True, False):
            (t, l, bh, bw, rh, rw, t2, l2, h2, w2, _), d = fast_plan(
                plan, h, w, orientation=orientation, scalable=scalable
            )
            pads = min(t2, l2) < 0 or t2 + h2 > rh or l2 + w2 > rw
            if (
                bh < 1
                or bw < 1
                or t < 0
                or l < 0
                or t + bh > h
                or l + bw > w
                or d not in (1, 2, 4, 8)
                or (pads and plan != [t, l, bh, bw, rh, rw, t2, l2, h2, w2, plan[10]])
            ):
                bad.append((h, w, scalable, plan))
    assert not bad, f"{len(bad)} bad plans, e.g. {bad[:3]}"


THIN = [(h, w) for h in range(1, 6) for w in (1, 2, 3, 4, 5, 7, 16, 17, 40)]
THIN += [(w, h) for h, w in THIN if h != w]


@pytest.mark.parametrize("name", ["eval", "train", "train+centre", "resize-hw+centre"])
def test_thin_and_tiny_images_are_kept_without_exact(tmp_path, name):
    """Images 1 to 5 pixels wide or tall (1x16, 16x1, 1x2, 4x1, ...) through the loader with
    exact=False: none skipped (a centre crop cut before its resize once made a 0-pixel-wide box
    of them: "region outside the image"), each within 1.5 levels of exact=True's output."""
    store = _store(tmp_path, THIN)
    out = {}
    for exact in (True, False):
        with GpuCachedLoader(
            store,
            batch_size=len(THIN),
            num_workers=0,
            backend="cpu",
            transform=TRANSFORMS[name],
            exact=exact,
            seed=3,
        ) as loader:
            ((out[exact], _),) = list(loader)
            assert loader.stats.skipped == 0, loader.stats.skipped_samples[:3]
    assert len(out[False]) == len(THIN)
    diff = _diffs(out[False], out[True])
    assert diff.max() <= 1.5, sorted(zip(diff.tolist(), THIN))[-3:]


#: photo sizes: ImageNet's median, its transpose, and ones whose eval box a margin of 1 scaled
#: pixel per output pixel decodes at 1/2 (640 x 615, 534 x 800: 2.7 to 3.6 levels from exact)
PHOTOS = [(375, 500), (500, 375), (615, 640), (640, 615), (534, 800)]


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    return _store(tmp_path_factory.mktemp("photos"), PHOTOS, quality=90)


@pytest.mark.skipif(not _roi._c_ok(), reason="compiled region decoder not built")
@pytest.mark.parametrize(
    "name, transform, bound",
    [
        ("eval", EVAL, 1.5),
        ("RandomResizedCrop(224)", T.Compose([T.RandomResizedCrop(224)]), 3),
        ("RandomResizedCrop(32)", T.Compose([T.RandomResizedCrop(32)]), 3),
    ],
)
def test_photo_size_images_are_within_the_stated_tolerance(photos, name, transform, bound):
    """The bounds docs/guides/backends.md states: mean |difference| per image <= 1.5 levels for
    eval, <= 3 for any training crop (on 396 real photos the worst were 0.67 and 1.92; the rule
    before, margin 1 and training edges rounded to the scaled grid: 5.3 and 6.0 here)."""
    idx = np.tile(np.arange(len(PHOTOS)), 1 if name == "eval" else 6)
    hs = photos.samples["height"][idx].astype(np.int64)
    ws = photos.samples["width"][idx].astype(np.int64)
    plans = transform.plan(hs, ws, np.random.default_rng(5))
    exact = decode_batch(photos, idx, plans, DecodeOptions(on_error="raise"), stack=True).images
    fast = decode_batch(
        photos, idx, plans, DecodeOptions(on_error="raise", exact=False), stack=True
    ).images
    diff = _diffs(fast, exact)
    assert diff.max() <= bound, [(PHOTOS[i], round(x, 2)) for i, x in zip(idx, diff.tolist())]
    scales = [
        fast_plan(p, h, w, scalable=True)[1]
        for p, h, w in zip(plans.tolist(), hs.tolist(), ws.tolist())
    ]
    if name == "RandomResizedCrop(32)":  # it does decode these photos scaled
        assert max(scales) > 1
