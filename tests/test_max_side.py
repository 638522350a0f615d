"""Build-time re-encoding: images over ``max_side`` re-encoded once (upright, quality recorded),
with ``jpeg_quality`` every other image too where that is smaller; the rest kept byte for byte,
what changed recorded in the store."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from gpucache import JpegCache, Kind
from gpucache.cli import main as cli_main
from gpucache.decode._sample import decode_sample
from gpucache.ingest._resize import QUALITY, max_side_of, resized
from gpucache.testing import make_jpeg_bytes, natural_image


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("max_side")
    (root / "c").mkdir()
    png = io.BytesIO()
    Image.fromarray(natural_image(400, 300, seed=7)).save(png, "PNG")
    files = {
        "small.jpg": make_jpeg_bytes(120, 90, seed=1),
        "edge.jpg": make_jpeg_bytes(256, 100, seed=2),  # long side == max_side: kept
        "big.jpg": make_jpeg_bytes(640, 480, seed=3),
        "tall_exif6.jpg": make_jpeg_bytes(600, 400, seed=4, exif_orientation=6),
        "gray.jpg": make_jpeg_bytes(500, 300, seed=5, mode="L"),
        "cmyk.jpg": make_jpeg_bytes(400, 300, seed=6, mode="CMYK"),
        "big.png": png.getvalue(),
    }
    for name, data in files.items():
        (root / "c" / name).write_bytes(data)
    return root, files


def _reference(data: bytes, size: tuple[int, int]) -> torch.Tensor:
    with Image.open(io.BytesIO(data)) as im:
        im = ImageOps.exif_transpose(im).convert("RGB").resize(size, Image.LANCZOS)
    return torch.from_numpy(np.asarray(im)).permute(2, 0, 1)


def test_large_images_are_capped_and_the_rest_kept(folder):
    root, files = folder
    cache = JpegCache.from_folder(root, progress=False, max_side=256)
    names = [p.rsplit("/", 1)[1] for p in cache.paths]
    mask, rec = resized(cache), cache.extra["resized"]
    assert max_side_of(cache) == (256, QUALITY)
    for i, name in enumerate(names):
        original = files[name]
        h, w = int(cache.samples["height"][i]), int(cache.samples["width"][i])
        if name in ("small.jpg", "edge.jpg"):
            assert not mask[i] and bytes(cache[i]) == original and rec[i].tolist() == [0, 0, 0]
            continue
        assert mask[i] and max(h, w) == 256, name
        assert cache.samples["kind"][i] == Kind.JPEG and cache.samples["orientation"][i] == 1
        with Image.open(io.BytesIO(original)) as im:
            up = ImageOps.exif_transpose(im)
            assert rec[i].tolist() == [up.height, up.width, len(original)], name
            assert abs(up.width / up.height - w / h) < 0.02, name  # aspect kept, upright
        img = decode_sample(cache, i)
        assert tuple(img.shape) == (3, h, w)
        diff = (img.float() - _reference(original, (w, h)).float()).abs().mean()
        assert diff < (10 if name == "cmyk.jpg" else 6), (name, float(diff))  # q90 JPEG loss
    assert (cache.samples["components"][names.index("gray.jpg")]) == 1


def test_max_side_with_restart_markers_and_the_cli(folder, tmp_path):
    root, _ = folder
    out = tmp_path / "capped.gpucache"
    assert cli_main(["build", str(root), "-o", str(out), "--max-side", "200"]) == 0
    cache = JpegCache.open(out)
    assert max_side_of(cache) == (200, QUALITY) and int(resized(cache).sum()) == 6
    assert max(int(cache.samples["height"].max()), int(cache.samples["width"].max())) == 200
    from gpucache.decode import _roi_rst

    if _roi_rst.transcoder_available():
        both = JpegCache.from_folder(root, progress=False, max_side=200, restart_markers=True)
        assert (_roi_rst.intervals(both) > 0).sum() >= 6 and int(resized(both).sum()) == 6
    plain = JpegCache.from_folder(root, progress=False)
    assert resized(plain) is None and max_side_of(plain) is None
    with pytest.raises(ValueError, match="max_side"):
        JpegCache.from_folder(root, progress=False, max_side=0)


def test_jpeg_quality_reencodes_every_image_where_that_is_smaller(folder, tmp_path):
    """FFCV's jpg mode, opt-in: every image decoded, upright, re-encoded at the quality at its
    own size (4:2:0); an image that would not shrink (stored at a lower quality already) keeps
    its bytes. Photo-size 4:4:4 JPEGs at quality 95 shrink by about half, within a few levels
    on average."""
    root, files = folder
    low = make_jpeg_bytes(300, 200, seed=8, quality=40)  # q90 would be larger: kept
    (root / "c" / "low_q40.jpg").write_bytes(low)
    files = {**files, "low_q40.jpg": low}
    try:
        cache = JpegCache.from_folder(root, progress=False, jpeg_quality=90)
    finally:
        (root / "c" / "low_q40.jpg").unlink()
    names = [p.rsplit("/", 1)[1] for p in cache.paths]
    mask, rec = resized(cache), cache.extra["resized"]
    assert max_side_of(cache) == (None, 90)
    for i, name in enumerate(names):
        original = files[name]
        if not mask[i]:
            assert bytes(cache[i]) == original and rec[i].tolist() == [0, 0, 0], name
            continue
        assert len(cache[i]) < len(original), name
        assert cache.samples["kind"][i] == Kind.JPEG and cache.samples["orientation"][i] == 1
        with Image.open(io.BytesIO(original)) as im:
            up = ImageOps.exif_transpose(im)
            assert rec[i].tolist() == [up.height, up.width, len(original)], name
            h, w = int(cache.samples["height"][i]), int(cache.samples["width"][i])
            assert (h, w) == (up.height, up.width), name  # no resize without max_side
        diff = (decode_sample(cache, i).float() - _reference(original, (w, h)).float()).abs()
        assert diff.mean() < (10 if name == "cmyk.jpg" else 6), (name, float(diff.mean()))
    assert not mask[names.index("low_q40.jpg")] and mask[names.index("big.png")]
    assert cache.samples["components"][names.index("gray.jpg")] == 1

    photos = []  # photo-size 4:4:4 JPEGs at quality 95, as many cameras and exports store them
    for seed in range(12):
        out = io.BytesIO()
        Image.fromarray(natural_image(500, 375, seed=seed)).save(
            out, "JPEG", quality=95, subsampling=0
        )
        photos.append(out.getvalue())
    plain = JpegCache.from_files(photos, progress=False)
    q90 = JpegCache.from_files(photos, progress=False, jpeg_quality=90)
    assert int(resized(q90).sum()) == 12
    assert sum(len(q90[i]) for i in range(12)) < 0.7 * sum(len(plain[i]) for i in range(12))
    diffs = [
        float((decode_sample(q90, i).float() - decode_sample(plain, i).float()).abs().mean())
        for i in range(12)
    ]
    # these generated photos are noisier than real ones (median 6.0 here; the 396 real photos
    # of docs/guides/stores.md: median 2.7, max 7.1)
    assert max(diffs) < 8 and np.median(diffs) < 7, diffs


def test_jpeg_quality_with_max_side_the_cli_and_other_sources(folder, tmp_path, capsys):
    root, files = folder
    out = tmp_path / "q70.gpucache"
    assert (
        cli_main(["build", str(root), "-o", str(out), "--max-side", "200", "--jpeg-quality", "70"])
        == 0
    )
    cache = JpegCache.open(out)
    assert max_side_of(cache) == (200, 70)
    capsys.readouterr()
    assert cli_main(["info", str(out)]) == 0
    changed = int(resized(cache).sum())
    assert (
        f"re-encoded at build (max_side 200, quality 70): {changed} of {len(cache)} samples"
        in capsys.readouterr().out
    )
    names = [p.rsplit("/", 1)[1] for p in cache.paths]
    capped = JpegCache.from_folder(root, progress=False, max_side=200)
    for i, name in enumerate(names):  # over the cap: the same resize at the lower quality
        if max(int(capped.extra["resized"][i][0]), int(capped.extra["resized"][i][1])) > 200:
            assert len(cache[i]) < len(capped[i]), name
    csv = tmp_path / "list.csv"
    csv.write_text("".join(f"{root / 'c' / n},0\n" for n in sorted(files)))
    from_csv = JpegCache.from_csv(csv, progress=False, jpeg_quality=70, max_side=200)
    assert (
        max_side_of(from_csv) == (200, 70)
        and resized(from_csv).tolist()
        == resized(
            JpegCache.from_files(
                [root / "c" / n for n in sorted(files)],
                progress=False,
                jpeg_quality=70,
                max_side=200,
            )
        ).tolist()
    )
    for bad in (0, 101, 9.5, True):
        with pytest.raises(ValueError, match="jpeg_quality.*1 to 100"):
            JpegCache.from_folder(root, progress=False, jpeg_quality=bad)
