"""Targets: float (N, C) and ragged per-sample arrays stored in the file; boxes follow the plan.

The box test draws a filled box into real images, runs the loader with RandomResizedCrop and flips,
finds the box in the output (where the painted and the unpainted image differ, so photo content
cannot be mistaken for it) and compares it with the box mapped through ``info.plans``.
"""

from __future__ import annotations

import io
import pickle

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from gpucache import GpuCachedLoader, JpegCache, JpegDataset, with_targets
from gpucache import transforms as T
from gpucache.decode._apply import apply_plan
from gpucache.testing import make_jpeg_bytes


@pytest.fixture(scope="module")
def cache(small_folder):
    return JpegCache.from_folder(small_folder, progress=False)


def _ragged(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.uniform(0, 40, (k % 4, 5)).astype(np.float32) for k in range(n)]


def test_targets_are_stored_saved_shared_and_loaded(cache, tmp_path):
    n = len(cache)
    multi_hot = (np.random.default_rng(1).random((n, 6)) < 0.3).astype(np.float32)
    boxes = _ragged(n)
    tc = with_targets(cache, targets=multi_hot, ragged=boxes)
    opened = JpegCache.open(tc.save(tmp_path / "t.gpucache"))
    for store in (tc, opened, pickle.loads(pickle.dumps(opened))):
        assert np.array_equal(store.extra["targets"], multi_hot)
        off = store.extra["targets_ragged.offsets"]
        assert [store.extra["targets_ragged"][off[i] : off[i + 1]].tolist() for i in range(n)] == [
            b.tolist() for b in boxes
        ]
    loader = GpuCachedLoader(
        opened,
        batch_size=8,
        device="cpu",
        num_workers=0,
        shuffle=True,
        seed=0,
        return_metadata=True,
        transform=[T.CenterCrop(32)],
    )
    for _, y, info in loader:
        idx = info.indices.numpy()
        assert y.dtype == torch.float32 and torch.equal(y, torch.from_numpy(multi_hot[idx]))
        assert [t.tolist() for t in info.targets] == [boxes[i].tolist() for i in idx]
    ds = JpegDataset(opened, return_info=True)
    _, target, info = ds[5]
    assert np.array_equal(target, multi_hot[5]) and np.array_equal(info["targets"], boxes[5])
    assert isinstance(JpegDataset(cache)[5][1], int)  # stores without targets: int labels


def test_per_input_rows_drop_skipped_inputs(tmp_path):
    good = [make_jpeg_bytes(40, 30, seed=k) for k in range(3)]
    built = JpegCache.from_files([good[0], b"junk", good[1], good[2]], progress=False)
    tc = with_targets(
        built,
        targets=[[0.0], [1.0], [2.0], [3.0]],
        ragged=[[[1, 2]], [], [[3, 4], [5, 6]], []],
        per_input=True,
    )
    assert tc.extra["targets"][:, 0].tolist() == [0.0, 2.0, 3.0]
    assert tc.extra["targets_ragged.offsets"].tolist() == [0, 1, 3, 3]
    with pytest.raises(ValueError, match="share their row width"):
        with_targets(built, ragged=[[[1, 2]], [[1, 2, 3]], []])
    with pytest.raises(ValueError, match=r"\(N, C\) with N = 3"):
        with_targets(built, targets=np.zeros((5, 2)))


def test_mixup_mixes_float_targets_in_the_loader(cache):
    n = len(cache)
    tc = with_targets(cache, targets=np.eye(4, dtype=np.float32)[cache.labels])
    loader = GpuCachedLoader(
        tc,
        batch_size=8,
        device="cpu",
        num_workers=0,
        seed=3,
        transform=[T.CenterCrop(32), T.ToDtype(), T.MixUp(alpha=0.4)],
    )
    ys = [y for _, y in loader]
    assert sum(len(y) for y in ys) == n
    assert all(torch.allclose(y.sum(1), torch.ones(len(y))) for y in ys)
    assert any(((y > 0) & (y < 1)).any() for y in ys)  # mixed


# ------------------------------------------------------------------------- boxes follow the plan
def test_map_boxes_equals_executing_the_plan():
    img = torch.zeros(3, 90, 140, dtype=torch.uint8)
    box = np.array([[37.0, 21.0, 101.0, 60.0]])  # x0, y0, x1, y1: pixels [37, 101) x [21, 60)
    img[:, 21:60, 37:101] = 255
    compose = T.Compose([T.RandomResizedCrop((70, 90), scale=(0.3, 1.0)), T.RandomHorizontalFlip()])
    plans = compose.plan(np.full(40, 90), np.full(40, 140), np.random.default_rng(0))
    assert plans[:, 10].any() and not plans[:, 10].all()
    found = 0
    for plan in plans:
        out = apply_plan(img, plan)[0].float()
        mapped = T.map_boxes(box, plan)[0]
        ys, xs = torch.nonzero(out > 127, as_tuple=True)
        if len(ys) == 0:
            assert (mapped[2] - mapped[0]) * (mapped[3] - mapped[1]) < 2
            continue
        found += 1
        seen = [xs.min().item(), ys.min().item(), xs.max().item() + 1, ys.max().item() + 1]
        assert np.abs(np.array(seen) - mapped).max() <= 1.0, (plan, seen, mapped)
    assert found > 30
    for plan in plans[:4]:  # points: the box's corners, numpy or torch alike
        pts = T.map_points(torch.tensor([[37.0, 21.0], [101.0, 60.0]]), plan)
        unclipped = T.map_boxes(box, plan, clip=False)[0]
        assert isinstance(pts, torch.Tensor)
        assert sorted(pts[:, 0].tolist()) == pytest.approx([unclipped[0], unclipped[2]])
        assert pts[:, 1].tolist() == pytest.approx([unclipped[1], unclipped[3]])


def _painted(img: Image.Image, box) -> bytes:
    out = io.BytesIO()
    im = img.copy()
    ImageDraw.Draw(im).rectangle([box[0], box[1], box[2] - 1, box[3] - 1], fill=(255, 0, 255))
    im.save(out, "JPEG", quality=95)
    return out.getvalue()


def _plain(img: Image.Image) -> bytes:
    out = io.BytesIO()
    img.save(out, "JPEG", quality=95)
    return out.getvalue()


def _images() -> list[Image.Image]:
    """Generated photos of six sizes."""
    return [
        Image.open(io.BytesIO(make_jpeg_bytes(200 + 40 * k, 160, seed=k))).convert("RGB")
        for k in range(6)
    ]


def test_box_drawn_into_images_follows_rrc_and_flip_through_the_loader():
    images = _images()
    rng = np.random.default_rng(2)
    boxes = []
    for im in images:
        w, h = im.size
        x0, y0 = int(rng.integers(0, w // 2)), int(rng.integers(0, h // 2))
        boxes.append([x0, y0, x0 + w // 3, y0 + h // 3])
    painted = with_targets(
        JpegCache.from_files([_painted(im, b) for im, b in zip(images, boxes)], progress=False),
        ragged=[np.array([b + [1]]) for b in boxes],
    )
    plain = JpegCache.from_files([_plain(im) for im in images], progress=False)
    kw = dict(
        batch_size=3,
        device="cpu",
        num_workers=0,
        seed=11,
        return_metadata=True,
        transform=[T.RandomResizedCrop(96, scale=(0.35, 1.0)), T.RandomHorizontalFlip()],
    )
    checked, flips = 0, set()
    for epoch in range(3):
        a, b = GpuCachedLoader(painted, **kw), GpuCachedLoader(plain, **kw)
        a.set_epoch(epoch)
        b.set_epoch(epoch)
        for (xa, _, info), (xb, _, info_b) in zip(a, b):
            assert np.array_equal(info.plans, info_b.plans)  # same sizes, seed: same plans
            for k in range(len(xa)):
                mapped = T.map_boxes(info.targets[k][:, :4], info.plans[k])[0].numpy()
                diff = (xa[k].int() - xb[k].int()).abs().amax(0) > 60
                ys, xs = torch.nonzero(diff, as_tuple=True)
                area = (mapped[2] - mapped[0]) * (mapped[3] - mapped[1])
                if area < 9:  # cropped away (or a sliver)
                    assert len(ys) < 20
                    continue
                seen = np.array(
                    [xs.min().item(), ys.min().item(), xs.max().item() + 1, ys.max().item() + 1]
                )
                assert np.abs(seen - mapped).max() <= 2.5, (info.plans[k], seen, mapped)
                checked += 1
                flips.add(int(info.plans[k][10]))
    assert checked >= 10 and flips == {0, 1}
