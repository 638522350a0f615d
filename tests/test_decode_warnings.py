"""Corrupt JPEG data that libjpeg decodes anyway is reported per sample, never silently.

A real JPEG whose scan was damaged mid-way (a stray restart marker: libjpeg warns "Corrupt JPEG
data: premature end of data segment" and fills the rest) is kept by the build (its headers are
fine). The loader logs it once per sample with index and path, counts it in ``loader.stats``, and
with ``on_error="skip_warned"`` leaves it out; libjpeg's own message never reaches stderr.
"""

import io
import logging

import pytest
import torch
from PIL import Image

from gpucache import GpuCachedLoader, JpegCache
from gpucache import transforms as T
from gpucache.decode import _roi
from gpucache.testing import natural_image

pytestmark = pytest.mark.skipif(not _roi._c_ok(), reason="compiled region decoder not built")


def damaged_jpeg(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(natural_image(96, 64, seed=seed)).save(buf, "JPEG", quality=90)
    b = bytearray(buf.getvalue())
    b[len(b) // 2:len(b) // 2 + 2] = b"\xff\xd3"  # a restart marker where none belongs
    return bytes(b)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("warn")
    paths = []
    for k in range(4):
        p = root / f"{k}.jpg"
        if k == 2:
            p.write_bytes(damaged_jpeg(k))
        else:
            Image.fromarray(natural_image(96, 64, seed=k)).save(p, quality=90)
        paths.append(p)
    return JpegCache.from_files(paths, labels=[0, 1, 2, 3], progress=False)


@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize("transform", [T.RandomResizedCrop(32), None], ids=["crop", "full"])
def test_warned_sample_is_logged_once_and_counted(store, workers, transform, caplog, capfd):
    loader = GpuCachedLoader(store, batch_size=2, num_workers=workers, backend="cpu", seed=0,
                             transform=transform, multiprocessing_context="spawn")
    with caplog.at_level(logging.WARNING, logger="gpucache"), loader:
        for _ in range(2):  # two epochs: still one report
            n = sum(len(labels) for _, labels in loader)
            assert n == 4  # kept by default
    assert loader.stats.warned == 1 and list(loader.stats.warned_samples) == [2]
    reports = [r.getMessage() for r in caplog.records if "corrupt JPEG data" in r.getMessage()]
    assert len(reports) == 1 and "sample 2" in reports[0] and "2.jpg" in reports[0], reports
    assert "premature end of data segment" in reports[0]
    assert "Corrupt JPEG data" not in capfd.readouterr().err  # libjpeg's stderr line is gone


def test_skip_warned_leaves_the_sample_out(store):
    loader = GpuCachedLoader(store, batch_size=4, num_workers=0, backend="cpu", seed=0,
                             transform=T.Compose([T.Resize(40), T.CenterCrop(32)]),
                             on_error="skip_warned")
    with pytest.warns(RuntimeWarning, match="skip_warned"):
        (images, labels), = list(loader)
    assert images.shape == (3, 3, 32, 32) and 2 not in labels.tolist()
    assert loader.stats.skipped == 1 and loader.stats.warned == 1


def test_unknown_policy_is_refused(store):
    with pytest.raises(ValueError, match="skip_warned"):
        GpuCachedLoader(store, batch_size=2, on_error="warn")


def test_damaged_scan_decodes_to_different_pixels(store):
    """The report matters: the damaged sample's pixels really are wrong."""
    good = JpegCache.from_files([store.paths[0]], progress=False)
    from gpucache.decode._core import decode_sample
    bad = decode_sample(store, 2)
    ref = torch.from_numpy(natural_image(96, 64, seed=2)).permute(2, 0, 1)
    assert (bad.int() - ref.int()).abs().float().mean() > 10
    assert decode_sample(good, 0).shape == bad.shape
