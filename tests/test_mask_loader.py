"""Masks through the loader: each mask follows its image's plan (crops, resize, flip, EXIF
orientation, padding) pixel for pixel, keeps its values, and comes out the same for any worker
count, after a resume, and on every backend."""

from __future__ import annotations

import io
import threading

import numpy as np
import pytest
import torch
from PIL import Image

from gpucache import GpuCachedLoader, JpegCache
from gpucache import transforms as T
from gpucache.decode._masks import apply_mask_plan, gather_masks
from gpucache.decode._options import DecodeOptions
from gpucache.ingest._masks import decode_mask
from gpucache.testing import make_jpeg_bytes, make_mask_png, natural_image
from gpucache.transforms._orientation import orient

CPU = torch.device("cpu")

#: orientation -> the one that undoes it (6 and 8 turn opposite ways, the rest are their own)
UNDO = {1: 1, 2: 2, 3: 3, 4: 4, 5: 5, 6: 8, 7: 7, 8: 6}
PAINT = (255, 0, 255)  # magenta: the background never has it (its green is kept >= 128)


def _shape(h: int, w: int, seed: int) -> np.ndarray:
    """A filled ellipse and a rectangle, as a 0/1 mask."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    cy, cx = rng.integers(h // 4, 3 * h // 4), rng.integers(w // 4, 3 * w // 4)
    ry, rx = rng.integers(h // 8, h // 3), rng.integers(w // 8, w // 3)
    m = ((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2 <= 1
    top, left = rng.integers(0, h // 2), rng.integers(0, w // 2)
    m[top : top + h // 5, left : left + w // 4] = True
    return m.astype(np.uint8)


def _painted_pair(h: int, w: int, seed: int, orientation: int) -> tuple[bytes, bytes]:
    """A JPEG (4:4:4, quality 95) whose displayed image, after its EXIF ``orientation``, is a
    real-looking photo with the shape painted in; and the shape's mask (displayed orientation)."""
    shown = natural_image(w, h, seed=seed).copy()
    shown[..., 1] = np.maximum(shown[..., 1], 128)
    mask = _shape(h, w, seed)
    shown[mask == 1] = PAINT
    shown_t = torch.from_numpy(shown).permute(2, 0, 1)
    stored = orient(shown_t, UNDO[orientation])
    assert torch.equal(orient(stored, orientation), shown_t)
    im = Image.fromarray(stored.permute(1, 2, 0).numpy())
    exif = im.getexif()
    exif[0x0112] = orientation
    out = io.BytesIO()
    im.save(out, "JPEG", quality=95, subsampling=0, exif=exif.tobytes())
    return out.getvalue(), make_mask_png(mask, "L")


@pytest.fixture(scope="module")
def painted(tmp_path_factory) -> JpegCache:
    """One sample per EXIF orientation, two sizes each."""
    root = tmp_path_factory.mktemp("painted")
    images, masks = [], []
    for k in range(16):
        o = k % 8 + 1
        h, w = (72, 96) if k < 8 else (90, 70)
        jpg, png = _painted_pair(h, w, seed=k, orientation=o)
        (root / f"{k}.jpg").write_bytes(jpg)
        images.append(root / f"{k}.jpg")
        masks.append(png)
    return JpegCache.from_files(images, masks=masks, progress=False)


def _painted_region(images: torch.Tensor, most: bool = True) -> torch.Tensor:
    """Where a uint8 (N, 3, H, W) batch shows the painted colour: mostly (the pixel is more
    paint than background, ``most``), or clearly (three quarters paint or more)."""
    r, g, b = images[:, 0].int(), images[:, 1].int(), images[:, 2].int()
    if most:
        return (r > 128) & (g < 110) & (b > 128)
    return (r > 160) & (g < 64) & (b > 160)


def _inner(m: torch.Tensor) -> torch.Tensor:
    """Pixels whose 3 x 3 neighbourhood lies wholly inside ``m`` (N, H, W, bool): ``m`` less
    a one-pixel border, where the image's antialiased resize blends the two colours."""
    x = (~m).float()[:, None]
    grown = torch.nn.functional.max_pool2d(x, 3, stride=1, padding=1)[:, 0] > 0
    return m & ~grown


def _agree(images: torch.Tensor, masks: torch.Tensor) -> None:
    inside = masks == 1
    assert not (_inner(inside) & ~_painted_region(images)).any(), "mask: shape; image: not"
    clearly = _painted_region(images, most=False)
    assert not (_inner(~inside) & clearly).any(), "image shows the shape, mask does not"
    assert inside.any() and (~inside).any()


def test_painted_shape_and_mask_agree_after_random_crop_and_flip_in_every_orientation(painted):
    tf = [T.RandomResizedCrop(48, scale=(0.3, 1.0)), T.RandomHorizontalFlip()]
    flips = 0
    with GpuCachedLoader(
        painted,
        batch_size=8,
        shuffle=True,
        seed=5,
        num_workers=0,
        transform=tf,
        return_metadata=True,
    ) as loader:
        for _ in range(3):
            for images, masks, info in loader:
                assert masks.shape == (len(images), 48, 48) and masks.dtype == torch.uint8
                _agree(images, masks)
                flips += int(info.plans[:, 10].sum())
    assert flips > 0


def test_masks_are_the_same_for_zero_one_and_two_workers(painted):
    tf = [T.RandomResizedCrop(40), T.RandomHorizontalFlip()]
    runs = []
    for workers in (0, 1, 2):
        with GpuCachedLoader(
            painted, batch_size=5, shuffle=True, seed=11, num_workers=workers, transform=tf
        ) as loader:
            runs.append([(x, m) for x, m in loader])
    for run in runs[1:]:
        for (x, m), (rx, rm) in zip(run, runs[0], strict=True):
            assert torch.equal(m, rm) and torch.equal(x, rx)


def test_variable_size_masks_come_whole_and_aligned(painted):
    with GpuCachedLoader(painted, batch_size=4, num_workers=2, seed=0) as loader:
        for images, masks in loader:
            assert isinstance(masks, list)
            for x, m in zip(images, masks, strict=True):
                assert m.shape == x.shape[1:]
                _agree(x[None], m[None])


def test_resume_mid_epoch_gives_the_rest_of_the_masks(painted):
    kw = dict(
        batch_size=4,
        shuffle=True,
        seed=3,
        num_workers=0,
        transform=[T.RandomResizedCrop(32), T.RandomHorizontalFlip()],
    )
    with GpuCachedLoader(painted, **kw) as loader:
        full = [m for _, m in loader]
    with GpuCachedLoader(painted, **kw) as loader:
        it = iter(loader)
        next(it)
        state = loader.state_dict()
    with GpuCachedLoader(painted, **kw) as loader:
        loader.load_state_dict(state)
        rest = [m for _, m in loader]
    assert len(rest) == len(full) - 1
    for got, want in zip(rest, full[1:], strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("mode", ["L", "P", "I;16"])
def test_values_are_kept_exactly(tmp_path, mode):
    rng = np.random.default_rng(0)
    images, masks, values = [], [], []
    top = 60000 if mode == "I;16" else 200
    for k in range(5):
        h, w = 40 + k, 50 + 2 * k
        jpg, _ = _painted_pair(h, w, seed=k, orientation=1)
        (tmp_path / f"{k}.jpg").write_bytes(jpg)
        v = rng.integers(0, top, (h, w))
        images.append(tmp_path / f"{k}.jpg")
        masks.append(make_mask_png(v, mode))
        values.append(v)
    cache = JpegCache.from_files(images, masks=masks, progress=False)
    dtype = torch.int32 if mode == "I;16" else torch.uint8
    for workers in (0, 2):
        with GpuCachedLoader(cache, batch_size=5, num_workers=workers, seed=0) as loader:
            ((_, got),) = list(loader)
        for m, v in zip(got, values):
            assert m.dtype == dtype
            np.testing.assert_array_equal(m.numpy(), v)
    tf = [T.RandomResizedCrop(24), T.RandomHorizontalFlip()]
    with GpuCachedLoader(
        cache, batch_size=5, num_workers=2, seed=1, transform=tf, return_metadata=True
    ) as loader:
        ((_, got, info),) = list(loader)
    for m, plan, i in zip(got, info.plans, info.indices.tolist()):
        want = apply_mask_plan(
            torch.from_numpy(decode_mask(cache.masks[i]).astype(np.int64)), plan.tolist(), 255
        )
        assert torch.equal(m.long(), want)
        assert set(np.unique(m.numpy())) <= set(np.unique(values[i]))  # no value blended


def test_padding_gets_the_fill_values(painted):
    tf = [T.CenterCrop(120)]  # larger than every image: padded all round
    with GpuCachedLoader(
        painted,
        batch_size=4,
        num_workers=0,
        seed=0,
        transform=tf,
        fill=9,
        mask_fill=77,
        return_metadata=True,
    ) as loader:
        images, masks, info = next(iter(loader))
    h, w = int(painted.samples["height"][0]), int(painted.samples["width"][0])
    top, left = (120 - h) // 2, (120 - w) // 2
    assert (masks[0, :top] == 77).all() and (masks[0, :, :left] == 77).all()
    assert (images[0, :, :top] == 9).all() and (images[0, :, :, :left] == 9).all()
    assert set(np.unique(masks[0, top : top + h, left : left + w].numpy())) <= {0, 1}
    _agree(images[:, :, top : top + h, left : left + w], masks[:, top : top + h, left : left + w])


def test_letterbox_keeps_aspect_pads_and_maps_boxes(painted):
    with GpuCachedLoader(
        painted,
        batch_size=16,
        num_workers=0,
        seed=0,
        transform=[T.Letterbox(64)],
        return_metadata=True,
    ) as loader:
        images, masks, info = next(iter(loader))
    assert images.shape == (16, 3, 64, 64) and masks.shape == (16, 64, 64)
    for k, i in enumerate(info.indices.tolist()):
        h, w = int(painted.samples["height"][i]), int(painted.samples["width"][i])
        box = T.map_boxes(np.array([[0.0, 0.0, w, h]]), info.plans[k])[0]
        x0, y0, x1, y1 = (int(round(v)) for v in box)
        assert (x1 - x0 == 64) or (y1 - y0 == 64)  # the long side fills the box
        assert abs((x1 - x0) / (y1 - y0) - w / h) < 0.05
        inside = torch.zeros(64, 64, dtype=torch.bool)
        inside[y0:y1, x0:x1] = True
        assert (masks[k][~inside] == 255).all() and (masks[k][inside] != 255).all()
    _agree(images, masks)


def test_pad_adds_the_border_it_names():
    p = T.Compose([T.Pad((1, 2, 3, 4))]).plan(np.array([10]), np.array([20]), None)
    assert p[0].tolist() == [0, 0, 10, 20, 10, 20, -2, -1, 16, 24, 0]
    mask = torch.ones(10, 20, dtype=torch.uint8)
    out = apply_mask_plan(mask, p[0].tolist(), 255)
    assert out.shape == (16, 24) and int((out == 1).sum()) == 200
    assert (out[:2] == 255).all() and (out[:, :1] == 255).all() and (out[:, -3:] == 255).all()


def test_map_mask_values_maps_through_the_table(painted):
    table = {0: 7, 1: 3}
    tf = [T.RandomResizedCrop(32), T.MapMaskValues(table)]
    with GpuCachedLoader(painted, batch_size=8, num_workers=0, seed=0, transform=tf) as a:
        _, mapped = next(iter(a))
    with GpuCachedLoader(painted, batch_size=8, num_workers=0, seed=0, transform=tf[:1]) as b:
        _, plain = next(iter(b))
    assert torch.equal(mapped, torch.where(plain == 1, 3, 7).to(torch.uint8))
    wide = T.MapMaskValues({5: 300}, default=0)(torch.tensor([[5, 6]], dtype=torch.int32))
    assert wide.dtype == torch.int32 and wide.tolist() == [[300, 0]]
    cityscapes = T.MapMaskValues({7: 0, 8: 1, 26: 13})  # labelIds -> trainIds, 255 elsewhere
    got = cityscapes(torch.tensor([[7, 8, 26, 0, 33]], dtype=torch.uint8))
    assert got.dtype == torch.uint8 and got.tolist() == [[0, 1, 13, 255, 255]]


def test_labels_stay_reachable_and_masks_can_be_turned_off(painted):
    with GpuCachedLoader(painted, batch_size=4, num_workers=0, return_metadata=True) as loader:
        _, masks, info = next(iter(loader))
    assert isinstance(masks, list) and torch.equal(
        info.labels, torch.from_numpy(painted.labels[info.indices.numpy()])
    )
    with GpuCachedLoader(painted, batch_size=4, num_workers=0, masks=False) as loader:
        _, labels = next(iter(loader))
    assert torch.equal(labels, torch.from_numpy(painted.labels[:4]))


def test_mask_arguments_are_checked(painted, tmp_path):
    with pytest.raises(ValueError, match=r"mask_fill.*\[0, 255\]"):
        GpuCachedLoader(painted, batch_size=2, mask_fill=256)
    with pytest.raises(ValueError, match=r"^fill.*\[0, 255\].*-1"):
        GpuCachedLoader(painted, batch_size=2, fill=-1)
    with pytest.raises(ValueError, match="MixUp/CutMix"):
        GpuCachedLoader(
            painted, batch_size=2, transform=[T.RandomResizedCrop(8), T.MixUp(num_classes=2)]
        )
    (tmp_path / "a.jpg").write_bytes(_painted_pair(20, 20, 0, 1)[0])
    plain = JpegCache.from_files([tmp_path / "a.jpg"], progress=False)
    with pytest.raises(ValueError, match="this store has no masks"):
        GpuCachedLoader(plain, batch_size=2, masks=True)


def test_the_batched_gather_equals_the_per_sample_plan(painted):
    """The device path (one gather a batch, any device) picks the same pixels as the workers'."""
    tf = T.Compose([T.RandomResizedCrop(33, scale=(0.05, 1)), T.RandomHorizontalFlip(), T.Pad(3)])
    idx = np.arange(len(painted))
    s = painted.samples
    plans = tf.plan(
        s["height"][idx].astype(np.int64),
        s["width"][idx].astype(np.int64),
        np.random.default_rng(4),
    )
    from gpucache.decode._masks import decode_one
    from gpucache.decode.gpu._mask_stage import MaskStage

    stage = MaskStage(painted, fill=200, dtype=torch.uint8, device=CPU, pool=None, chunks=3)
    host = stage.submit(idx, plans, stack=True).host  # every mask in its top-left corner
    got = gather_masks(host, torch.from_numpy(plans), 200, size=(39, 39))
    for k, i in enumerate(idx.tolist()):
        want = apply_mask_plan(decode_one(painted, i, torch.uint8), plans[k].tolist(), 200)
        assert torch.equal(got[k], want)


#: output sizes of the backend comparisons: taller than wide, wider than tall, square
SIZES = [(40, 28), (28, 40), (40, 40)]


def _flipped(size: tuple[int, int]) -> list:
    """A random crop to ``size``, every sample flipped (a flip mirrors over the output's width:
    wrong on non-square outputs if it mirrored over the longer side)."""
    return [T.RandomResizedCrop(size), T.RandomHorizontalFlip(1.0)]


@pytest.fixture
def mask_threads(monkeypatch) -> list[threading.Thread]:
    """The threads each mask was decoded on (the real decoder, recorded as it runs)."""
    from gpucache.decode import _masks

    seen: list[threading.Thread] = []
    real = _masks.decode_one

    def recorded(*args, **kwargs):
        seen.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(_masks, "decode_one", recorded)
    return seen


def _close_to(images: torch.Tensor, ref: torch.Tensor) -> None:
    """The batched float resize against the cpu backend's fixed-point one: within a few
    levels, mostly equal (a flip mirrored over the wrong span is off by tens of levels)."""
    d = (images.int() - ref.int()).abs()
    assert images.shape == ref.shape and d.max() <= 4 and d.float().mean() <= 0.5


@pytest.mark.parametrize("size", SIZES)
def test_masks_agree_on_the_emulated_nvjpeg_backend(painted, mask_threads, size):
    """Decoded on nvjpeg's CPU-stage threads, one copy and one gather a batch on the device
    (its side stream, handed over to the consumer's: the emulation checks the order); images
    and masks as the cpu backend's, on every output shape, flipped."""
    from tests.support.emulated_cuda import EmulatedCuda

    kw = dict(batch_size=8, seed=2, shuffle=True, transform=_flipped(size))
    with GpuCachedLoader(painted, device="cpu", backend="cpu", num_workers=0, **kw) as cpu:
        ref = list(cpu)
    mask_threads.clear()
    with EmulatedCuda(devices=1):
        with GpuCachedLoader(painted, device="cuda", backend="nvjpeg", **kw) as gpu:
            got = [(x, m) for x, m in gpu]
        for (x, m), (rx, rm) in zip(got, ref, strict=True):
            assert m.device == x.device == torch.device("cuda", 0)
            assert m.shape == (len(x), *size)
            assert torch.equal(m.cpu(), rm)
            _close_to(x.cpu(), rx)
            _agree(x.cpu(), m.cpu())
    assert len(mask_threads) == len(painted)
    assert threading.main_thread() not in mask_threads  # never on the training loop's thread


@pytest.mark.parametrize("size", SIZES)
def test_masks_agree_on_dali_cpu(painted, mask_threads, size):
    """DALI decodes the masks on threads of its own, ahead of the batch."""
    pytest.importorskip("nvidia.dali")
    kw = dict(batch_size=8, seed=2, shuffle=True, transform=_flipped(size), device="cpu")
    with GpuCachedLoader(painted, backend="cpu", num_workers=0, **kw) as cpu:
        ref = list(cpu)
    mask_threads.clear()
    with GpuCachedLoader(painted, backend="dali", num_workers=2, **kw) as dali:
        got = [(x, m) for x, m in dali]
    for (x, m), (rx, rm) in zip(got, ref, strict=True):
        assert torch.equal(m, rm)
        # DALI's own resize filter: its stated tolerance, a mean of 2 levels an image
        per_image = (x.float() - rx.float()).abs().flatten(1).mean(1)
        assert x.shape == rx.shape and per_image.max() <= 2.0
        _agree(x, m)
    assert len(mask_threads) == len(painted)
    assert threading.main_thread() not in mask_threads


def test_fill_and_mask_fill_agree_on_the_emulated_nvjpeg_backend(painted):
    from tests.support.emulated_cuda import EmulatedCuda

    kw = dict(batch_size=8, seed=0, transform=[T.Letterbox(64)], fill=9, mask_fill=77)
    with GpuCachedLoader(painted, device="cpu", backend="cpu", num_workers=0, **kw) as cpu:
        ref = list(cpu)
    with EmulatedCuda(devices=1):
        with GpuCachedLoader(painted, device="cuda", backend="nvjpeg", **kw) as gpu:
            got = [(x.cpu(), m.cpu()) for x, m in gpu]
    for (x, m), (rx, rm) in zip(got, ref, strict=True):
        assert torch.equal(m, rm) and (m == 77).any()
        pad = (m == 77)[:, None].expand_as(x)
        assert (x[pad] == 9).all() and (rx[pad] == 9).all()


def test_an_eval_resize_and_center_crop_keeps_mask_and_image_aligned(painted):
    """With exact=False the image's crop may be cut before its resize (DCT scaling); the mask
    follows the plan as drawn and still agrees with the painted pixels."""
    for exact in (False, True):
        with GpuCachedLoader(
            painted,
            batch_size=16,
            num_workers=0,
            exact=exact,
            transform=[T.Resize(40), T.CenterCrop(36)],
        ) as loader:
            images, masks = next(iter(loader))
        _agree(images, masks)


def test_spawned_workers_send_the_same_masks(painted, tmp_path):
    """Under spawn the worker maps the saved store's pages, masks included."""
    store = JpegCache.open(painted.save(tmp_path / "painted.gpucache"))
    kw = dict(batch_size=8, seed=4, transform=[T.RandomResizedCrop(24), T.RandomHorizontalFlip()])
    with GpuCachedLoader(store, num_workers=0, **kw) as inline:
        want = [m for _, m in inline]
    with GpuCachedLoader(store, num_workers=1, multiprocessing_context="spawn", **kw) as spawned:
        got = [m for _, m in spawned]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_variable_size_masks_on_the_emulated_nvjpeg_backend(painted):
    from tests.support.emulated_cuda import EmulatedCuda

    with GpuCachedLoader(painted, batch_size=5, num_workers=0, seed=0) as cpu:
        ref = [m for _, m in cpu]
    with EmulatedCuda(devices=1):
        with GpuCachedLoader(painted, batch_size=5, device="cuda", backend="nvjpeg") as gpu:
            got = [[t.cpu() for t in m] for _, m in gpu]
    for g, r in zip(got, ref, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(g, r, strict=True))


def _painted_plans(cache, size, seed: int = 0) -> np.ndarray:
    s = cache.samples
    return T.Compose(_flipped(size)).plan(
        s["height"].astype(np.int64), s["width"].astype(np.int64), np.random.default_rng(seed)
    )


@pytest.mark.parametrize("fill", [0, 9])
def test_masks_make_no_host_sync_on_the_training_or_transform_thread(painted, fill):
    """On the emulated GPU (which counts every host synchronisation by thread): after the first
    batch the training thread waits for the device nowhere, masks and fill included, and
    neither does nvjpeg's transform stage (the masks' output size comes from the host plans,
    the fill's plans cross in a pinned non_blocking copy)."""
    from tests.support.emulated_cuda import EmulatedCuda

    tf = _flipped((40, 28))
    with EmulatedCuda(devices=1) as emu:
        with GpuCachedLoader(
            painted, device="cuda", backend="nvjpeg", batch_size=4, seed=0, fill=fill, transform=tf
        ) as loader:
            batches = iter(loader)
            next(batches)  # constants made once per device
            with emu.count_syncs() as c:
                rest = [(x.shape, m.shape) for x, m in batches]
            stages = [t for t in loader._backend._threads if "transform" in t.name]
        assert len(rest) == len(loader) - 1 >= 3 and len(c) == 0, c
        assert stages and not any(emu.host_syncs_in(t) for t in stages)


def test_dali_places_its_masks_without_a_host_sync(painted):
    """DALI's masks, decoded on its mask threads, reach the device in get() (the training
    loop's thread) with no host synchronisation. No GPU here: DALI runs its CPU graph, torch's
    side is the emulated GPU."""
    pytest.importorskip("nvidia.dali")
    from tests.support.dali_cpu_graph import CpuGraph
    from tests.support.emulated_cuda import EmulatedCuda

    plans = _painted_plans(painted, (40, 28))
    batches = [np.arange(k, k + 8) for k in (0, 8)]
    with EmulatedCuda(devices=1) as emu:
        be = CpuGraph(
            painted,
            options=DecodeOptions(
                on_error="raise", seed=0, masks=True, mask_fill=200, mask_dtype="uint8"
            ),
            device=torch.device("cuda", 0),
            batch_size=8,
            num_threads=2,
        )
        for idx in batches:
            be.submit(idx, plans[idx], stack=True)
        with emu.count_syncs() as c:
            got = [be.get() for _ in batches]
        be.close()
        assert len(c) == 0, c
        for out, idx in zip(got, batches):
            assert out.masks.device == torch.device("cuda", 0)
            want = [
                apply_mask_plan(torch.from_numpy(decode_mask(painted.masks[i])), plans[i], 200)
                for i in idx.tolist()
            ]
            assert torch.equal(out.masks.cpu(), torch.stack(want))


#: the kinds of the mixed store's samples: the emulated GPU decodes the baseline JPEGs; the PNGs
#: and the progressive JPEGs take the nvjpeg backend's CPU path
KINDS = ["jpeg", "progressive", "png", "jpeg", "png", "progressive", "jpeg", "jpeg"]
ON_CPU = [k for k, kind in enumerate(KINDS) if kind != "jpeg"]


@pytest.fixture(scope="module")
def mixed_kinds(tmp_path_factory) -> JpegCache:
    """Baseline JPEGs, progressive JPEGs and PNGs, each with its mask, large enough that a
    resize to 20 pixels decodes the JPEGs at a reduced DCT scale with ``exact=False``."""
    root = tmp_path_factory.mktemp("mixed")
    files, masks = [], []
    for k, kind in enumerate(KINDS):
        h, w = (192, 256) if k % 2 else (240, 176)
        path = root / f"{k}.{'png' if kind == 'png' else 'jpg'}"
        if kind == "png":
            Image.fromarray(natural_image(w, h, seed=k)).save(path)
        else:
            path.write_bytes(make_jpeg_bytes(w, h, seed=k, progressive=kind == "progressive"))
        files.append(path)
        masks.append(make_mask_png(_shape(h, w, k), "L"))
    return JpegCache.from_files(files, masks=masks, progress=False)


def _padded(plan: np.ndarray) -> torch.Tensor:
    """(h2, w2) bool: where ``plan``'s second crop leaves the resized image (its padding)."""
    rh, rw, t2, l2, h2, w2 = (int(v) for v in plan[4:10])
    inside = torch.zeros((h2, w2), dtype=torch.bool)
    inside[max(0, -t2) : rh - t2, max(0, -l2) : rw - l2] = True
    return ~inside


@pytest.mark.parametrize(
    "tf, pads",
    [([T.Resize(20), T.CenterCrop(20)], False), ([T.CenterCrop(280)], True)],
    ids=["shrink", "pad"],
)
def test_a_sample_on_the_cpu_path_keeps_fill_mask_and_exact_on_the_emulated_nvjpeg_backend(
    mixed_kinds, tf, pads
):
    """The nvjpeg backend's CPU path (PNGs, progressive JPEGs) decodes with the loader's whole
    options, as the cpu backend does: ``fill`` where a plan pads, ``exact=False``'s reduced DCT
    scale, and its mask through its plan."""
    from tests.support.emulated_cuda import EmulatedCuda

    kw = dict(batch_size=8, seed=0, transform=tf, fill=9, mask_fill=77, exact=False)
    with GpuCachedLoader(mixed_kinds, device="cpu", backend="cpu", num_workers=0, **kw) as cpu:
        rx, rm = next(iter(cpu))
    with EmulatedCuda(devices=1):
        with GpuCachedLoader(mixed_kinds, device="cuda", backend="nvjpeg", **kw) as gpu:
            x, m = next(iter(gpu))
            x, m = x.cpu(), m.cpu()
        assert gpu.stats.cpu_decoded == len(ON_CPU)
    for k in ON_CPU:
        assert torch.equal(x[k], rx[k]), (k, KINDS[k])
    assert torch.equal(m, rm)
    pad = (m == 77)[:, None].expand_as(x)
    assert (x[pad] == 9).all() and (rx[pad] == 9).all()
    assert bool(pad.any()) is pads


def test_exact_false_changes_the_progressive_samples_the_cpu_path_takes(mixed_kinds):
    """What the test above holds the CPU path to: with the compiled region decoder, a
    progressive JPEG shrunk to 20 pixels decodes at a reduced DCT scale (other pixels)."""
    from gpucache.decode import _roi
    from gpucache.decode._core import decode_batch

    if _roi.route() != "libjpeg-turbo":
        pytest.skip("the reduced DCT scale needs the compiled region decoder")
    idx = np.array([k for k in ON_CPU if KINDS[k] == "progressive"])
    s = mixed_kinds.samples
    plans = T.Compose([T.Resize(20), T.CenterCrop(20)]).plan(
        s["height"][idx].astype(np.int64),
        s["width"][idx].astype(np.int64),
        np.random.default_rng(0),
    )
    exact = decode_batch(mixed_kinds, idx, plans, stack=True)
    fast = decode_batch(mixed_kinds, idx, plans, DecodeOptions(exact=False), stack=True)
    assert fast.routes["scaled"] == len(idx) and exact.routes["scaled"] == 0
    assert not torch.equal(fast.images, exact.images)


@pytest.mark.parametrize("stack", [True, False])
def test_the_emulated_nvjpeg_backend_pads_with_fill_itself(mixed_kinds, stack):
    """No loader: the backend's own output has ``fill`` wherever a plan pads, on the batched
    path (the baseline JPEGs) and the CPU path (the rest) alike."""
    from gpucache.decode._core import decode_batch
    from gpucache.decode.gpu._nvjpeg import NvjpegBackend
    from tests.support.emulated_cuda import EmulatedCuda

    idx = np.arange(len(mixed_kinds))
    s = mixed_kinds.samples
    plans = T.Compose([T.CenterCrop(280)]).plan(
        s["height"].astype(np.int64), s["width"].astype(np.int64), np.random.default_rng(0)
    )
    options = DecodeOptions(fill=9)
    ref = decode_batch(mixed_kinds, idx, plans, options, stack=stack)
    with EmulatedCuda(devices=1):
        be = NvjpegBackend(mixed_kinds, device=torch.device("cuda", 0), options=options)
        be.submit(idx, plans, stack)
        out = be.get()
        be.close()
        images = [im.cpu() for im in out.images]
    assert out.indices.tolist() == idx.tolist() and out.cpu_decoded == len(ON_CPU)
    for k, (a, b) in enumerate(zip(images, ref.images, strict=True)):
        pad = _padded(plans[k])
        assert pad.any() and (a[:, pad] == 9).all() and (b[:, pad] == 9).all(), k
        assert (a.int() - b.int()).abs().max() <= 4
