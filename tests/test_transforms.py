"""Transforms: plans drawn from seeds, executed per sample; results checked against torchvision."""

import numpy as np
import pytest
import torch
import torchvision.transforms.v2 as v2
import torchvision.transforms.v2.functional as TF

from gpucache import GpuCachedLoader, JpegCache
from gpucache import transforms as T
from gpucache.decode._apply import apply_plan
from gpucache.decode._sample import decode_sample
from gpucache.transforms._compose import as_compose


@pytest.fixture(scope="module")
def cache(jpeg_folder):
    return JpegCache.from_folder(jpeg_folder, progress=False)


def test_val_transform_matches_torchvision(cache):
    loader = GpuCachedLoader(
        cache,
        batch_size=8,
        num_workers=0,
        device="cpu",
        transform=[T.Resize(256), T.CenterCrop(224)],
        return_metadata=True,
    )
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
        np.array([30]), np.array([50]), np.random.default_rng(0)
    )
    img = torch.arange(3 * 30 * 50, dtype=torch.int64).reshape(3, 30, 50)
    ref = TF.center_crop(img.flip(-1), [10, 20])
    assert torch.equal(apply_plan(img, p[0]), ref)
    small = T.Compose([T.CenterCrop(40)]).plan(
        np.array([30]), np.array([50]), np.random.default_rng(0)
    )
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
    with pytest.raises(ValueError, match="before ToDtype/Normalize"):  # translated, then ordered
        T.Compose([T.ToDtype(), v2.Resize(10)])
    assert isinstance(T.Compose([v2.Resize(10)]).geometric[0], T.Resize)


# ------------------------------------------------------------------ open transforms

from gpucache.testing import make_jpeg_bytes  # noqa: E402


def _photo_batch(n: int = 6, size: int = 64) -> torch.Tensor:
    """Generated photos, resized and cropped."""
    blobs = [make_jpeg_bytes(120, 90, seed=k) for k in range(n)]
    from gpucache.decode._jpeg import decode_jpeg

    imgs = [decode_jpeg(torch.frombuffer(bytearray(b), dtype=torch.uint8)) for b in blobs]
    return torch.stack([TF.center_crop(TF.resize(i, [size], antialias=True), [size]) for i in imgs])


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_color_jitter_matches_torchvision_per_sample(dtype):
    x = _photo_batch()
    if dtype == torch.float32:
        x = x.float() / 255
    cj = T.ColorJitter(brightness=0.4, contrast=0.4, saturation=0.4)
    out = cj(x, generator=T.batch_generator(7, 0, 3))
    f = cj.factors(len(x), T.batch_generator(7, 0, 3))
    assert len(set(f["brightness"].tolist())) == len(x)  # one draw per sample
    assert all(0.6 <= v <= 1.4 for k in f for v in f[k].tolist())
    for k in range(len(x)):
        ref = TF.adjust_brightness(x[k], f["brightness"][k].item())
        ref = TF.adjust_contrast(ref, f["contrast"][k].item())
        ref = TF.adjust_saturation(ref, f["saturation"][k].item())
        diff = (out[k].float() - ref.float()).abs()
        assert out.dtype == dtype and diff.max() <= (1 if dtype == torch.uint8 else 1e-5)
        assert diff.mean() < 0.05 * (1 if dtype == torch.uint8 else 1 / 255)
    again = cj(x, generator=T.batch_generator(7, 0, 3))
    other = cj(x, generator=T.batch_generator(7, 0, 4))
    assert torch.equal(out, again) and not torch.equal(out, other)


def test_mixup_and_cutmix_mix_images_and_labels_alike():
    x = _photo_batch(n=4)
    labels = torch.tensor([0, 1, 2, 1])
    g = T.batch_generator(1, 2, 3)
    images, soft = T.MixUp(alpha=1.0, num_classes=3)(x, labels, generator=g)
    assert soft.shape == (4, 3) and torch.allclose(soft.sum(1), torch.ones(4))
    lam = soft[0, 0].item()  # sample 0 (class 0) mixed with sample 3 (class 1)
    assert 0 < lam < 1 and abs(soft[0, 1].item() - (1 - lam)) < 1e-6
    ref = (lam * x.float() + (1 - lam) * x.roll(1, 0).float()).round()
    assert (images.float() - ref).abs().max() <= 1
    images, soft = T.CutMix(alpha=1.0, num_classes=3)(x, labels, generator=g)
    pasted = (images != x).any(1)  # where sample k shows sample k-1's pixels
    assert pasted.any()
    ys, xs = torch.nonzero(pasted[0], as_tuple=True)
    box = images[:, :, ys.min() : ys.max() + 1, xs.min() : xs.max() + 1]
    assert torch.equal(box, x.roll(1, 0)[:, :, ys.min() : ys.max() + 1, xs.min() : xs.max() + 1])
    area = (ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1) / x[0, 0].numel()
    assert abs(soft[0, 1].item() - area.item()) < 1e-6 and abs(soft[0, 0].item() - 1 + area) < 1e-6
    with pytest.raises(ValueError, match="num_classes"):
        T.MixUp()(x, labels)


def test_any_callable_runs_on_the_batch_seeded():
    x = _photo_batch(n=4)
    compose = T.Compose(
        [
            T.RandomResizedCrop(32),
            v2.RandomGrayscale(p=0.5),
            lambda b: b.flip(-2),
            T.PerSample(v2.RandAugment()),
            T.ToDtype(torch.float32),
            v2.MixUp(num_classes=3),
        ]
    )
    assert [k for k, _ in compose.steps] == ["pixel"] * 4 + ["labels"]
    labels = torch.tensor([0, 1, 2, 0])
    a = compose.apply(x, labels, generator=T.batch_generator(0, 0, 0))
    torch.manual_seed(123)  # the global RNG is neither used nor disturbed
    state = torch.get_rng_state()
    b = compose.apply(x, labels, generator=T.batch_generator(0, 0, 0))
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[1].shape == (4, 3)
    c = compose.apply(x, labels, generator=T.batch_generator(0, 0, 1))
    assert not torch.equal(a[0], c[0])
    with pytest.raises(ValueError, match="apply"):
        compose(x)


def test_wrong_transform_names_what_is_accepted():
    for bad in (42, "Resize", {"a": 1}):
        with pytest.raises(TypeError, match="Compose"):
            as_compose(bad)
    with pytest.raises(TypeError, match="callable"):
        T.Compose([T.Resize(8), 3])
    assert as_compose(v2.ColorJitter(0.5)).steps[0][0] == "pixel"
    with pytest.raises(ValueError, match="mixes samples"):
        T.Compose([T.MixUp(num_classes=2)]).apply([torch.zeros(3, 4, 4)], torch.tensor([0]))


def test_loader_takes_torchvision_transforms_and_functions(cache):
    """A single torchvision op, a list mixing kinds, and plain functions are accepted."""
    for transform in (
        v2.ColorJitter(brightness=0.5),
        [
            T.RandomResizedCrop(32),
            v2.ColorJitter(0.5),
            T.ColorJitter(0.3, 0.3, 0.3),
            lambda b: b // 2,
            T.Normalize([0.5] * 3, [0.25] * 3),
        ],
    ):
        loader = GpuCachedLoader(
            cache, batch_size=8, num_workers=0, device="cpu", transform=transform, seed=0
        )
        batches = list(loader)
        assert sum(len(y) for _, y in batches) == len(cache)
    assert batches[0][0].shape == (8, 3, 32, 32) and batches[0][0].dtype == torch.float32


def test_loader_augmentation_is_seeded_per_batch_for_any_worker_count(cache):
    """(seed, epoch, batch) decide the pixel augmentation: 0 or 2 workers, same batches."""
    transform = [
        T.RandomResizedCrop(48),
        T.ColorJitter(0.4, 0.4, 0.4),
        v2.RandomGrayscale(p=0.5),
        T.PerSample(v2.RandomRotation(20)),
    ]
    runs = []
    for workers in (0, 2):
        with GpuCachedLoader(
            cache,
            batch_size=8,
            device="cpu",
            num_workers=workers,
            seed=9,
            transform=transform,
            multiprocessing_context="fork",
        ) as loader:
            runs.append([x for x, _ in loader])
            runs.append([x for x, _ in loader])  # the next epoch
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[2]))
    assert all(torch.equal(a, b) for a, b in zip(runs[1], runs[3]))
    assert not torch.equal(runs[0][0], runs[1][0])  # epochs differ


def test_a_nested_compose_is_flattened_so_its_batch_steps_run():
    # a Compose inside a Compose used to count as one geometric op: its Normalize never ran
    norm = T.Normalize([0.5] * 3, [0.25] * 3)
    nested = T.Compose([T.Compose([T.Resize((8, 8)), T.RandomHorizontalFlip(p=0.0)]), norm])
    assert len(nested.geometric) == 2 and nested.steps == [("pixel", norm)]
    inner_steps = T.Compose([T.Compose([T.Resize((8, 8)), norm])])
    assert len(inner_steps.geometric) == 1 and inner_steps.steps == [("pixel", norm)]
    images = torch.full((2, 3, 8, 8), 255, dtype=torch.uint8)
    out, _ = inner_steps.apply(images, torch.zeros(2, dtype=torch.long))
    assert out.dtype == torch.float32 and torch.allclose(out, torch.full_like(out, 2.0))
