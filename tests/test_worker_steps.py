"""Batch steps in the cpu backend's workers: the per-sample steps (ToDtype, Normalize, ColorJitter,
PerSample) run with the decode when the batch ends on the CPU, the rest (MixUp, any callable)
in the loop's process after them, and the batches are the same as with every step in the loop,
for any worker count; Normalize is folded into the resize's output (one pass to float)."""

from __future__ import annotations

import pickle
from unittest import mock

import numpy as np
import pytest
import torch
from torchvision.transforms import v2

from gpucache import GpuCachedLoader, JpegCache
from gpucache import transforms as T
from gpucache.decode import _core
from gpucache.decode._options import DecodeOptions

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
#: the largest difference allowed between one pass and two: the one pass multiplies, then adds,
#: where Normalize on a batch fuses them (one float32 rounding: 2.4e-7 at ImageNet's constants)
ONE_PASS_TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def photos(photo_folder) -> JpegCache:
    return JpegCache.from_folder(photo_folder, progress=False)


@pytest.fixture(scope="module")
def few_photos(photo_folder) -> JpegCache:
    """The first 30 of the photos (images 0-29 of make_jpeg_folder: both classes, and the gray,
    CMYK, progressive and EXIF-rotated ones among them), for the tests that compare whole epochs
    of batches made several ways: four batches of 8, the last one short. They compare batch by
    batch, so the 60 photos added only time (2026-12-07: 6.1 s of CPU for those tests with 60,
    3.7 s with 30)."""
    files = sorted(photo_folder.rglob("*.jpg"), key=lambda p: p.name.rsplit("_", 1)[1])[:30]
    labels = [["ants", "bees"].index(f.parent.name) for f in files]
    return JpegCache.from_files([str(f) for f in files], labels, progress=False)


def _batches(cache, transform, workers: int, **kw) -> list[tuple[torch.Tensor, torch.Tensor]]:
    with GpuCachedLoader(
        cache,
        batch_size=8,
        shuffle=True,
        seed=5,
        num_workers=workers,
        device="cpu",
        transform=transform,
        multiprocessing_context="fork",
        **kw,
    ) as loader:
        return [(x, y) for x, y in loader]


def _in_the_loop():
    """Every batch step in the loop's process, as before they ran in the workers."""
    return mock.patch.object(T.Compose, "per_sample_steps", lambda self: 0)


README = [T.RandomResizedCrop(64), T.RandomHorizontalFlip(), T.Normalize(MEAN, STD)]
MIXED = [
    T.RandomResizedCrop(48),
    T.ColorJitter(0.4, 0.4, 0.4),
    T.PerSample(v2.RandomRotation(20)),
    T.ToDtype(torch.float32),
    T.Normalize(MEAN, STD),
    T.MixUp(num_classes=2),  # stays in the loop's process, drawing after the workers' steps
    T.PerBatch(v2.RandomGrayscale(p=0.5)),
]


@pytest.fixture(scope="module")
def inline(few_photos) -> dict:
    """The batches of each pipeline made without workers, by the pipeline's name: the reference
    the runs with workers are compared to, made once for the module (nothing writes to them)."""
    return {
        name: _batches(few_photos, transform, 0)
        for name, transform in (("uint8", README[:2]), ("readme", README), ("mixed", MIXED))
    }


@pytest.mark.parametrize(
    "name, transform", [("readme", README), ("mixed", MIXED)], ids=["readme", "mixed"]
)
def test_same_seed_same_float_batches_for_any_worker_count(few_photos, inline, name, transform):
    runs = {0: inline[name], **{w: _batches(few_photos, transform, w) for w in (1, 2)}}
    with _in_the_loop():
        runs["loop"] = _batches(few_photos, transform, 2)
    assert runs[0][0][0].dtype == torch.float32
    for name, run in runs.items():  # the same for any worker count; with every step in the
        assert len(run) == len(runs[0]), name  # loop's process, within one float32 rounding
        for (x, y), (x0, y0) in zip(run, runs[0]):
            if name == "loop":
                assert float((x - x0).abs().max()) <= ONE_PASS_TOLERANCE, name
                assert torch.allclose(y, y0, atol=ONE_PASS_TOLERANCE), name
            else:
                assert torch.equal(x, x0) and torch.equal(y, y0), name


def test_only_per_sample_steps_go_to_the_workers(photos):
    loader = GpuCachedLoader(photos, batch_size=8, num_workers=2, device="cpu", transform=MIXED)
    options = loader.decode_options  # up to Normalize; MixUp and the callable stay here
    names = [type(t).__name__ for t in options.steps]
    assert names == ["ColorJitter", "PerSample", "ToDtype", "Normalize"]
    assert loader._steps_in_backend == 4
    pickle.dumps(options)  # what spawn and forkserver workers receive
    local = GpuCachedLoader(  # a step that does not pickle, and what follows it, stay here
        photos,
        batch_size=8,
        num_workers=2,
        device="cpu",
        transform=[T.Resize((32, 32)), T.PerSample(lambda im: im), T.Normalize(MEAN, STD)],
    )
    assert local._steps_in_backend == 0
    variable = GpuCachedLoader(  # variable sizes: a list, its steps run per image in the loop
        photos,
        batch_size=8,
        num_workers=2,
        device="cpu",
        transform=[T.Resize(32), T.Normalize(MEAN, STD)],
    )
    assert variable._steps_in_backend == 0


def test_one_pass_is_within_the_tolerance_of_two_passes(photos):
    norm = T.Normalize(MEAN, STD)
    compose = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip()])
    s = photos.samples
    idx = np.arange(len(photos))
    plans = compose.plan(
        s["height"][idx].astype(np.int64),
        s["width"][idx].astype(np.int64),
        np.random.default_rng(0),
    )
    one = _core.decode_batch(
        photos, idx, plans, DecodeOptions(on_error="raise", steps=(norm,)), stack=True
    )
    with mock.patch.object(_core, "fused_steps", lambda steps: 0):
        two = _core.decode_batch(
            photos, idx, plans, DecodeOptions(on_error="raise", steps=(norm,)), stack=True
        )
    plain = _core.decode_batch(photos, idx, plans, DecodeOptions(on_error="raise"), stack=True)
    assert isinstance(one.images, torch.Tensor) and one.images.dtype == torch.float32
    assert one.images.shape == (len(photos), 3, 224, 224)
    assert float((one.images - two.images).abs().max()) <= ONE_PASS_TOLERANCE
    assert float((one.images - norm(plain.images)).abs().max()) <= ONE_PASS_TOLERANCE
    assert one.times["steps"] > 0 and plain.times["steps"] < one.times["steps"]


def test_an_empty_batch_keeps_the_steps_dtype(photos):
    norm = T.Normalize(MEAN, STD)
    out = _core.decode_batch(
        photos,
        np.zeros(0, dtype=np.int64),
        np.zeros((0, 11), dtype=np.int64),
        DecodeOptions(on_error="raise", steps=(norm,)),
        stack=True,
    )
    assert isinstance(out.images, torch.Tensor) and out.images.dtype == torch.float32
    assert out.images.shape[0] == 0 and out.rng_state is not None


def test_the_readme_pipeline_on_the_cpu_is_decode_bound(photos):
    # Normalize of a float batch ran in the loop's process and bound it; in the workers, the
    # loop's process only hands the batches over
    loader = GpuCachedLoader(
        photos,
        batch_size=8,
        num_workers=2,
        device="cpu",
        transform=[T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.Normalize(MEAN, STD)],
    )
    with loader:
        for images, _ in loader:  # no training step: the loop waits for data
            assert images.dtype == torch.float32
    s = loader.stats
    assert s.bottleneck == "decode", str(s)
    assert s.seconds["steps"] > 0 and s.seconds["transform"] < s.seconds["decode"] / 10, str(s)


def _refused(*args: object) -> int:
    raise PermissionError(1, "memfd_create refused (a sandbox)")


def _too_big(fd: int, size: int) -> None:
    raise OSError(27, "File too large")  # EFBIG: a file-size rlimit below the batch


@pytest.mark.parametrize("how", ["memory files", "socket", "memfd refused", "file-size rlimit"])
def test_batches_come_back_whole_by_memory_file_or_socket(few_photos, inline, monkeypatch, how):
    """A worker sends a stacked batch as a memory file where it can (``decode/cpu/_batch_files.py``),
    through the socket otherwise; the batches are the same either way, uint8 and float."""
    from gpucache.decode.cpu import _batch_files

    if how == "socket":
        monkeypatch.setattr(_batch_files, "available", lambda: False)
    elif how == "memfd refused":  # fork workers inherit the patch
        monkeypatch.setattr(_batch_files.os, "memfd_create", _refused)
    elif how == "file-size rlimit":
        monkeypatch.setattr(_batch_files.os, "ftruncate", _too_big)
    for name, transform in (("uint8", README[:2]), ("readme", README), ("mixed", MIXED)):
        got = _batches(few_photos, transform, 2)
        want = inline[name]
        assert len(got) == len(want)
        for (x, y), (x0, y0) in zip(got, want):
            assert torch.equal(x, x0) and torch.equal(y, y0), how
            if transform is not MIXED:  # (RandomGrayscale expands its channels: no writes)
                x.add_(1)  # the batch is the caller's to change
