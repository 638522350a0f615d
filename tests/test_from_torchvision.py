"""torchvision pipelines as transform=: translated into gpucache's per-sample plans, or refused.

The reference is always the same pipeline written with gpucache.transforms, run by the same loader
with the same seed: a translated torchvision pipeline must give exactly its crops, flips and pixels.
"""

import warnings

import pytest
import torch
import torchvision.transforms as v1
import torchvision.transforms.v2 as v2

from gpucache import GpuCachedLoader, JpegCache
from gpucache import transforms as T
from gpucache.transforms._compose import as_compose

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@pytest.fixture(scope="module")
def cache(small_folder):
    return JpegCache.from_folder(small_folder, progress=False)


def _run(cache, transform, seed=3):
    loader = GpuCachedLoader(
        cache,
        batch_size=8,
        shuffle=True,
        seed=seed,
        num_workers=0,
        device="cpu",
        transform=transform,
        return_metadata=True,
    )
    return [(x, y, info.plans) for x, y, info in loader]


def _assert_same(a, b):
    assert len(a) == len(b)
    for (xa, ya, pa), (xb, yb, pb) in zip(a, b):
        assert isinstance(xa, torch.Tensor), type(xa)  # one batch tensor, not a list of images
        assert xa.dtype == xb.dtype and xa.shape == xb.shape
        assert torch.equal(pa, pb) if isinstance(pa, torch.Tensor) else (pa == pb).all()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_v2_compose_train_pipeline_gives_gpucache_crops(cache):
    """The pipeline users migrate from: a whole v2.Compose of RandomResizedCrop, flip, ToDtype."""
    tv = v2.Compose(
        [v2.RandomResizedCrop(32), v2.RandomHorizontalFlip(), v2.ToDtype(torch.float32, scale=True)]
    )
    ours = [T.RandomResizedCrop(32), T.RandomHorizontalFlip(), T.ToDtype(torch.float32)]
    got, want = _run(cache, tv), _run(cache, ours)
    _assert_same(got, want)
    assert got[0][0].shape == (8, 3, 32, 32) and got[0][0].dtype == torch.float32
    plans = torch.as_tensor(got[0][2])
    assert len({tuple(p[:4].tolist()) for p in plans}) > 1  # a crop per sample, not per batch
    flips = torch.cat([torch.as_tensor(p)[:, 10] for _, _, p in got])
    assert 0 < flips.sum() < len(flips)  # a flip draw per sample


def test_nested_compose_and_v1_pipelines_translate(cache):
    nested = v2.Compose(
        [
            v2.ToImage(),
            v2.Compose(
                [
                    v2.RandomResizedCrop(24, scale=(0.3, 1.0)),
                    v2.Compose([v2.RandomHorizontalFlip(0.3)]),
                ]
            ),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(MEAN, STD),
        ]
    )
    ours = [
        T.RandomResizedCrop(24, scale=(0.3, 1.0)),
        T.RandomHorizontalFlip(0.3),
        T.ToDtype(torch.float32),
        T.Normalize(MEAN, STD),
    ]
    _assert_same(_run(cache, nested), _run(cache, ours))
    classic = v1.Compose(
        [
            v1.RandomResizedCrop(24, scale=(0.3, 1.0)),
            v1.RandomHorizontalFlip(0.3),
            v1.ToTensor(),
            v1.Normalize(MEAN, STD),
        ]
    )
    _assert_same(_run(cache, classic), _run(cache, ours))


def test_val_pipeline_and_dtype_options_translate(cache):
    tv = [v2.Compose([v2.Resize(40), v2.CenterCrop(32)]), v2.ToDtype(torch.float32)]  # scale=False
    ours = [T.Resize(40), T.CenterCrop(32), T.ToDtype(torch.float32, scale=False)]
    got = _run(cache, tv)
    _assert_same(got, _run(cache, ours))
    assert got[0][0].max() > 1  # v2.ToDtype's default keeps 0..255
    v1_val = v1.Compose([v1.Resize(40), v1.CenterCrop(32), v1.ConvertImageDtype(torch.float32)])
    _assert_same(
        _run(cache, v1_val), _run(cache, [T.Resize(40), T.CenterCrop(32), T.ToDtype(torch.float32)])
    )


def test_pad_translates_with_its_sides(cache):
    for pad in (3, (1, 2), (1, 2, 3, 4)):
        want = _run(cache, [T.Resize(24), T.CenterCrop(20), T.Pad(pad)])
        for tv in (v2, v1):
            _assert_same(_run(cache, [tv.Resize(24), tv.CenterCrop(20), tv.Pad(pad)]), want)
        left, top, right, bottom = (pad,) * 4 if isinstance(pad, int) else pad * (4 // len(pad))
        assert want[0][0].shape[-2:] == (20 + top + bottom, 20 + left + right)


@pytest.mark.parametrize(
    "bad, fix",
    [
        (
            v2.RandomApply([v2.RandomResizedCrop(32)]),
            "gpucache.transforms.RandomResizedCrop outside",
        ),
        (
            v2.Compose(
                [v2.ToImage(), v2.Compose([v2.RandomChoice([v2.Resize(8), v2.CenterCrop(8)])])]
            ),
            "outside it, or wrap the whole RandomChoice in gpucache.transforms.PerSample",
        ),
        (v1.RandomOrder([v1.RandomHorizontalFlip()]), "RandomHorizontalFlip outside it"),
        (v2.Resize(32, interpolation=v2.InterpolationMode.BICUBIC), "antialiased bilinear only"),
        (
            v1.Compose([v1.RandomResizedCrop(32, interpolation=v1.InterpolationMode.NEAREST)]),
            "drop interpolation=",
        ),
        (v2.Resize(32, antialias=False), "drop antialias=False"),
        (v2.Pad(2, padding_mode="reflect"), r"GpuCachedLoader\(fill=\.\.\., mask_fill=\.\.\.\)"),
        (v1.Pad(2, fill=7), "gpucache.transforms.Pad"),
        (v2.RandomApply([v2.Pad(2)]), "Pad outside it"),
    ],
)
def test_what_cannot_be_reproduced_is_refused_with_the_fix(bad, fix):
    with pytest.raises(TypeError, match=fix):
        as_compose(bad)


def test_random_torchvision_op_on_a_batch_warns_unless_wrapped():
    with pytest.warns(UserWarning, match=r"once per batch.*PerSample\(RandomGrayscale"):
        T.Compose([T.RandomResizedCrop(16), v2.RandomGrayscale(p=0.5)])
    with pytest.warns(UserWarning, match="gpucache.transforms.ColorJitter"):
        as_compose(v2.Compose([v2.RandomResizedCrop(16), v2.ColorJitter(0.4)]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        T.Compose(
            [
                T.RandomResizedCrop(16),
                T.PerSample(v2.RandomGrayscale(p=0.5)),
                T.PerBatch(v2.RandomGrayscale(p=0.5)),
                v2.Normalize(MEAN, STD),
            ]
        )
        T.Compose([v2.RandomGrayscale(p=0.5)])  # variable sizes: run on each image, drawn per image


def test_per_batch_keeps_one_draw_for_the_batch():
    x = torch.randint(0, 256, (16, 3, 8, 8), dtype=torch.uint8)
    step = T.Compose([T.PerBatch(v2.RandomGrayscale(p=0.5))])
    outs = [step(x, generator=T.batch_generator(0, 0, b)) for b in range(12)]
    gray = [bool((o[:, 0] == o[:, 1]).all()) for o in outs]
    for o in outs:  # all samples of a batch alike: every one gray or none
        alike = (o[:, 0] == o[:, 1]).flatten(1).all(1)
        assert alike.all() or not alike.any()
    assert any(gray) and not all(gray)
