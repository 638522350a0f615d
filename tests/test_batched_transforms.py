"""The batched geometric transforms (gpucache/transforms/_resample.py): the same pixels as the
per-image path, in a number of ops that does not grow with the batch, on the emulated GPU too."""

import numpy as np
import pytest
import torch

from benchmarks.batched_transforms import count_ops, float_plan
from gpucache import JpegCache
from gpucache import transforms as T
from gpucache.decode._apply import apply_plan
from gpucache.decode._sample import decode_sample
from gpucache.transforms._orientation import orient
from gpucache.transforms._resample import resample

PIPELINES = {
    "train": T.Compose([T.RandomResizedCrop(48), T.RandomHorizontalFlip()]),
    "eval": T.Compose([T.Resize(56), T.CenterCrop(48)]),
    "pad": T.Compose([T.Resize(40), T.CenterCrop(64)]),  # crop larger than the image: zeros
    "fixed": T.Compose([T.Resize((30, 50)), T.RandomHorizontalFlip(0.5)]),
    "crop only": T.Compose([T.CenterCrop(32)]),
    # non-square outputs, flipped: a flip mirrors over the output's width in both orientations
    "tall flip": T.Compose([T.RandomResizedCrop((48, 32)), T.RandomHorizontalFlip(1.0)]),
    "wide flip": T.Compose([T.RandomResizedCrop((32, 48)), T.RandomHorizontalFlip(1.0)]),
    "tall pad flip": T.Compose([T.Resize(30), T.CenterCrop((64, 40)), T.RandomHorizontalFlip(1.0)]),
}


@pytest.fixture(scope="module")
def stored(photo_folder):
    """Decoded photo-size images as a decoder that skips EXIF gives them (HWC-strided, as
    libjpeg-turbo's), each with one of the 8 orientations (every one of them among the 12), and
    their displayed sizes.

    12 photos (116x174 to 348x662, landscape, portrait and square): each pipeline's plans, the
    gather, the taps and the padding are per image, so 24 of them exercised no more of it
    than 12 (half the time, 2026-12-07)."""
    cache = JpegCache.from_folder(photo_folder, progress=False)
    rng = np.random.default_rng(0)
    images = [decode_sample(cache, i) for i in range(12)]  # displayed (EXIF applied)
    images = [im.permute(1, 2, 0).contiguous().permute(2, 0, 1) for im in images]
    orientations = rng.permutation(np.resize(np.arange(1, 9), len(images)))
    inverse = {6: 8, 8: 6}  # the other tags are their own inverses
    raw = [orient(im, inverse.get(int(o), int(o))) for im, o in zip(images, orientations)]
    assert all(torch.equal(orient(r, o), im) for r, o, im in zip(raw, orientations, images))
    return raw, orientations, images


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_batched_equals_the_per_image_path_within_one_level(stored, name):
    raw, orientations, shown = stored
    h = np.array([im.shape[1] for im in shown])
    w = np.array([im.shape[2] for im in shown])
    plans = PIPELINES[name].plan(h, w, np.random.default_rng(7))
    got = resample(raw, plans, orientations=orientations)
    ref = torch.stack([float_plan(im, p) for im, p in zip(shown, plans)])
    cpu = torch.stack([apply_plan(im, p) for im, p in zip(shown, plans)])  # fixed-point uint8
    assert got.shape == ref.shape and got.dtype == torch.uint8 and got.is_contiguous()
    d = (got.int() - ref.int()).abs()
    assert d.max() <= 1 and (d > 0).float().mean() < 1e-3, name  # float rounding only
    assert (got.int() - cpu.int()).abs().max() <= 1, name
    if name == "pad":
        # the zero padding of a crop larger than the image: its first row or first column
        assert all(bool((g[:, 0, :] == 0).all() or (g[:, :, 0] == 0).all()) for g in got)
    chunked = resample(raw, plans, orientations=orientations, budget_bytes=1)  # one a chunk
    d = (chunked.int() - got.int()).abs()  # other padding: other float summation order
    assert d.max() <= 1 and (d > 0).float().mean() < 1e-3
    contiguous = resample([r.contiguous() for r in raw], plans, orientations=orientations)
    assert torch.equal(contiguous, got)  # CHW as nvJPEG writes it: the same gather


def test_bad_batches_are_refused_with_the_fix():
    img = torch.zeros((3, 8, 8), dtype=torch.uint8)
    plans = T.Compose([T.Resize(4)]).plan(
        np.array([8, 8]), np.array([8, 16]), np.random.default_rng(0)
    )
    with pytest.raises(ValueError, match="several output sizes.*per-image path"):
        resample([img, torch.zeros((3, 8, 16), dtype=torch.uint8)], plans)
    with pytest.raises(ValueError, match="2 plans"):
        resample([img], plans)
    with pytest.raises(ValueError, match=r"RGB \(3, H, W\)"):
        resample([torch.zeros((1, 8, 8), dtype=torch.uint8)], plans[:1])


def test_ops_a_batch_do_not_grow_with_the_batch_on_the_emulated_gpu(jpeg_folder):
    """Every aten op dispatched while the nvjpeg backend decodes and transforms a batch and
    Normalize runs (decoder excluded, views excluded): the per-image path grows with the batch,
    the batched one only with its chunks (cut by crop size: a few whatever the batch size), each
    a constant number of ops."""
    cache = JpegCache.from_folder(jpeg_folder, progress=False)
    small = count_ops(cache, 8, per_image=False, batches=2)
    large = count_ops(cache, 32, per_image=False, batches=2)
    per_image = count_ops(cache, 32, per_image=True, batches=1)["ops_per_batch"]
    for r in (small, large):
        assert r["chunks"] <= 4 and r["ops_per_batch"] <= 24 + 32 * r["chunks"], r
    assert per_image >= 4 * 32 > large["ops_per_batch"]


def test_a_batch_of_large_photos_fits_the_strided_view():
    """256 photos of 2000x1500 in one chunk: the strided view over the joined images has a
    size product within int64 (three view dimensions of the batch's extent overflowed it)."""
    n, h, w = 256, 1500, 2000
    imgs = [torch.empty((3, h, w), dtype=torch.uint8, device="meta") for _ in range(n)]
    plans = PIPELINES["train"].plan(np.full(n, h), np.full(n, w), np.random.default_rng(0))
    out = resample(imgs, plans, budget_bytes=1 << 50)
    assert out.shape == (n, 3, 48, 48) and out.dtype == torch.uint8
