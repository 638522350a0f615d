"""Transforms: plans drawn from seeds, executed per sample; results checked against torchvision."""

import numpy as np
import pytest
import torch
import torchvision.transforms.v2 as v2
import torchvision.transforms.v2.functional as TF

from gpucache import GpuCachedLoader, JpegCache
from gpucache import transforms as T
from gpucache.decode.cpu import apply_plan, decode_sample


@pytest.fixture(scope="module")
def cache(jpeg_folder):
    return JpegCache.from_folder(jpeg_folder, progress=False)


def test_val_transform_matches_torchvision(cache):
    loader = GpuCachedLoader(cache, batch_size=8, num_workers=0, device="cpu",
                             transform=[T.Resize(256), T.CenterCrop(224)], return_metadata=True)
    ref_t = v2.Compose([v2.Resize(256, antialias=True), v2.CenterCrop(224)])
    diffs = []
    for images, _, info in loader:
        assert images.shape[1:] == (3, 224, 224) and images.dtype == torch.uint8
        for img, i in zip(images, info.indices.tolist()):
            ref = ref_t(decode_sample(cache, i))
            diffs.append((img.float() - ref.float()).abs().mean().item())
    assert max(diffs) <= 3, diffs  # the contract's tolerance; the same resize kernel gives ~0
    assert np.median(diffs) < 0.5


def test_random_resized_crop_follows_torchvision_rules():
    rrc = T.RandomResizedCrop(224)
    rng = np.random.default_rng(0)
    for h, w in [(375, 500), (500, 333), (100, 2000), (224, 224)]:
        for _ in range(200):
            top, left, ch, cw = rrc.box(h, w, rng)
            assert 0 <= top and 0 <= left and top + ch <= h and left + cw <= w
            ratio = cw / ch
            inside = 0.08 * 0.95 <= ch * cw / (h * w) <= 1.0 and 3 / 4 * 0.9 <= ratio <= 4 / 3 * 1.1
            fallback = ch == h or cw == w  # torchvision's central fallback after 10 misses
            assert inside or fallback


def test_train_crop_covers_the_drawn_region(cache):
    """The executed crop equals torchvision's resized_crop of the same box, then the flip."""
    compose = T.Compose([T.RandomResizedCrop(64), T.RandomHorizontalFlip(p=0.5)])
    i = 5
    h, w = int(cache.samples["height"][i]), int(cache.samples["width"][i])
    plans = compose.plan(np.array([h] * 20), np.array([w] * 20), np.random.default_rng(1))
    img = decode_sample(cache, i)
    assert plans[:, 10].any() and not plans[:, 10].all()
    for plan in plans:
        top, left, ch, cw = plan[:4].tolist()
        ref = TF.resized_crop(img, top, left, ch, cw, [64, 64], antialias=True)
        if plan[10]:
            ref = ref.flip(-1)
        assert torch.equal(apply_plan(img, plan), ref)


def test_plans_compose_crops_and_flips():
    p = T.Compose([T.RandomHorizontalFlip(p=1.0), T.CenterCrop((10, 20))]).plan(
        np.array([30]), np.array([50]), np.random.default_rng(0))
    img = torch.arange(3 * 30 * 50, dtype=torch.int64).reshape(3, 30, 50)
    ref = TF.center_crop(img.flip(-1), [10, 20])
    assert torch.equal(apply_plan(img, p[0]), ref)
    small = T.Compose([T.CenterCrop(40)]).plan(np.array([30]), np.array([50]),
                                              np.random.default_rng(0))
    assert torch.equal(apply_plan(img, small[0]), TF.center_crop(img, [40, 40]))  # zero padding


def test_normalize_and_layouts_match_torchvision():
    x = torch.randint(0, 256, (4, 3, 8, 9), dtype=torch.uint8)
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    ref = v2.Normalize(mean, std)(v2.ToDtype(torch.float32, scale=True)(x))
    out = T.Normalize(mean, std)(x)
    assert out.dtype == torch.float32 and torch.allclose(out, ref, atol=1e-5)
    half = T.Normalize(mean, std, dtype=torch.float16, layout="channels_last")(x)
    assert half.dtype == torch.float16 and half.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(half.float(), ref, atol=2e-2)
    nhwc = T.ToDtype(torch.float32, layout="NHWC")(x)
    assert nhwc.shape == (4, 8, 9, 3) and torch.allclose(nhwc, x.permute(0, 2, 3, 1) / 255)


def test_pixel_before_geometry_is_rejected():
    with pytest.raises(ValueError, match="before ToDtype/Normalize"):
        T.Compose([T.ToDtype(), T.Resize(10)])
    with pytest.raises(TypeError, match="gpucache.transforms"):
        T.Compose([v2.Resize(10)])
