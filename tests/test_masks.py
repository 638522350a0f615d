"""Segmentation masks in the store: kept exactly, checked at build and open, paired by folder
layout, shared (not copied) with worker processes."""

from __future__ import annotations

import hashlib
import io
import multiprocessing as mp
import pickle
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from gpucache import JpegCache
from gpucache._errors import BuildError, CacheFormatError
from gpucache.cli import main
from gpucache.ingest._masks import decode_mask
from gpucache.store import _format
from gpucache.store._masks import INFO, OFFSETS, MaskKind
from gpucache.testing import make_jpeg_bytes, make_mask_png


def _values(h: int, w: int, seed: int, top: int = 21) -> np.ndarray:
    rng = np.random.default_rng(seed)
    a = np.zeros((h, w), np.int64)
    for _ in range(4):  # a few blocks of class ids, an ignore border
        y, x = rng.integers(0, h - 8), rng.integers(0, w - 8)
        a[y : y + rng.integers(4, h // 2), x : x + rng.integers(4, w // 2)] = rng.integers(1, top)
    a[:, 0] = 255 if top < 256 else top - 1
    return a


def _pair(folder: Path, name: str, h: int, w: int, mask: Path, mode: str = "L", seed: int = 0):
    folder.mkdir(parents=True, exist_ok=True)
    mask.parent.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(make_jpeg_bytes(w, h, seed=seed))
    values = _values(h, w, seed, 60000 if mode == "I;16" else 21)
    mask.write_bytes(make_mask_png(values, mode))
    return values


# ------------------------------------------------------------------ values kept


@pytest.mark.parametrize("mode", ["L", "P", "I;16"])
def test_mask_values_come_back_exactly_through_save_and_open(tmp_path, mode):
    images, masks, want = [], [], []
    for i in range(4):
        h, w = 30 + 3 * i, 50 + i
        values = _pair(tmp_path, f"{i}.jpg", h, w, tmp_path / f"{i}.png", mode, seed=i)
        images.append(tmp_path / f"{i}.jpg")
        masks.append(tmp_path / f"{i}.png" if i % 2 else (tmp_path / f"{i}.png").read_bytes())
        want.append(values)
    cache = JpegCache.from_files(images, masks=masks, progress=False)
    opened = JpegCache.open(cache.save(tmp_path / "m.gpucache"))
    for store in (cache, opened):
        m = store.masks
        assert m is not None and len(m) == 4
        assert m.counts() == {MaskKind[{"I;16": "I16"}.get(mode, mode)].name: 4}
        for i, values in enumerate(want):
            got = decode_mask(m[i])
            assert got.dtype == m.kind(i).dtype
            np.testing.assert_array_equal(got, values)
            assert (m.heights[i], m.widths[i]) == values.shape
            assert not m[i].flags.writeable
        with pytest.raises(ValueError):
            m[0][0] = 1
    if mode == "P":  # the palette's colours never replace the indices
        assert Path(tmp_path / "1.png").read_bytes() == opened.masks[1].tobytes()


def test_a_store_without_masks_has_none_and_keeps_its_sections(jpeg_folder):
    cache = JpegCache.from_folder(jpeg_folder, progress=False)
    assert cache.masks is None
    assert not any(k.startswith("masks") for k in cache.extra)


def test_a_lossless_non_png_mask_is_stored_as_png_with_the_same_values(tmp_path):
    (tmp_path / "a.jpg").write_bytes(make_jpeg_bytes(40, 30, seed=1))
    values = _values(30, 40, 1)
    Image.fromarray(values.astype(np.uint8), "L").save(tmp_path / "a.bmp")
    cache = JpegCache.from_files([tmp_path / "a.jpg"], masks=[tmp_path / "a.bmp"], progress=False)
    assert bytes(cache.masks[0][:8]) == b"\x89PNG\r\n\x1a\n"
    np.testing.assert_array_equal(decode_mask(cache.masks[0]), values)


# ------------------------------------------------------------------ checks at build


def test_bad_pairs_are_reported_with_image_mask_and_reason(tmp_path):
    def image(name, h=30, w=40, **kw):
        (tmp_path / name).write_bytes(make_jpeg_bytes(w, h, seed=len(name), **kw))
        return tmp_path / name

    good = make_mask_png(_values(30, 40, 0), "L")
    rgb = io.BytesIO()
    Image.new("RGB", (40, 30), (1, 2, 3)).save(rgb, "PNG")
    jpeg_mask = io.BytesIO()
    Image.new("L", (40, 30), 3).save(jpeg_mask, "JPEG")
    (tmp_path / "truncated.png").write_bytes(good[: len(good) // 2])
    (tmp_path / "small.png").write_bytes(make_mask_png(_values(20, 40, 0), "L"))
    (tmp_path / "rgb.png").write_bytes(rgb.getvalue())
    (tmp_path / "good.png").write_bytes(good)
    # an EXIF-6 image stored 40 wide, 30 high, shown 30 wide, 40 high: its mask is 40 x 30 (h x w)
    shown = make_mask_png(_values(40, 30, 2), "L")
    cases = [
        (image("ok.jpg"), tmp_path / "good.png", None),
        (image("missing.jpg"), tmp_path / "nope.png", "does not exist"),
        (image("size.jpg"), tmp_path / "small.png", "20x40 .*image 30x40"),
        (image("cut.jpg"), tmp_path / "truncated.png", "not an image PIL can read"),
        (image("rgb.jpg"), tmp_path / "rgb.png", "mode is 'RGB'"),
        (image("jpegmask.jpg"), jpeg_mask.getvalue(), "is a JPEG"),
        (image("empty.jpg"), b"", "empty"),
        (image("turned.jpg", exif_orientation=6), shown, None),
        (image("unturned.jpg", exif_orientation=6), good, "30x40 .*image 40x30 after EXIF"),
    ]
    images = [c[0] for c in cases]
    masks = [c[1] for c in cases]
    cache = JpegCache.from_files(images, masks=masks, progress=False)
    report = cache.report
    assert report.total == len(cases) == len(cache) + len(report.skipped)
    kept = [str(c[0]) for c in cases if c[2] is None]
    assert list(cache.paths) == kept
    skipped = {s.path: s.reason for s in report.skipped}
    for img, mask, why in cases:
        if why is None:
            continue
        reason = skipped[str(img)]
        assert reason.startswith("mask ")
        if isinstance(mask, Path):
            assert str(mask) in reason
        assert __import__("re").search(why, reason), reason
    assert cache.masks.heights.tolist() == [30, 40] and cache.masks.widths.tolist() == [40, 30]
    with pytest.raises(BuildError, match="does not exist"):
        JpegCache.from_files(images[:2], masks=masks[:2], on_error="raise", progress=False)


def test_masks_must_be_one_per_image(tmp_path):
    (tmp_path / "a.jpg").write_bytes(make_jpeg_bytes(20, 20))
    with pytest.raises(ValueError, match="1 entries for 2 items"):
        JpegCache.from_files([tmp_path / "a.jpg"] * 2, masks=[b"x"], progress=False)


# ------------------------------------------------------------------ the four layouts


def _build_layout(tmp_path, layout: str):
    """(images root, masks root, {image path: mask values}) of a generated data set layout."""
    want = {}
    if layout == "isic":
        images, masks = tmp_path / "ISIC-2017_Training_Data", tmp_path / "ISIC-2017_Training_Part1"
        for i in range(3):
            name = f"ISIC_{i:07d}"
            want[images / f"{name}.jpg"] = _pair(
                images, f"{name}.jpg", 30, 40, masks / f"{name}_segmentation.png", seed=i
            )
    elif layout == "voc":
        images, masks = tmp_path / "VOC2012/JPEGImages", tmp_path / "VOC2012/SegmentationClass"
        for i in range(3):
            name = f"2007_{i:06d}"
            want[images / f"{name}.jpg"] = _pair(
                images, f"{name}.jpg", 32, 48, masks / f"{name}.png", "P", seed=i
            )
        (images / "2008_000099.jpg").write_bytes(make_jpeg_bytes(20, 20))  # no mask: reported
    elif layout == "ade20k":
        base = tmp_path / "ADEChallengeData2016"
        images, masks = base / "images", base / "annotations"
        for split in ("training", "validation"):
            for i in range(2):
                name = f"ADE_{split[:5]}_{i:08d}"
                want[images / split / f"{name}.jpg"] = _pair(
                    images / split, f"{name}.jpg", 36, 30, masks / split / f"{name}.png", seed=i
                )
    else:  # cityscapes
        images, masks = tmp_path / "leftImg8bit/train", tmp_path / "gtFine/train"
        for city in ("aachen", "bochum"):
            for i in range(2):
                key = f"{city}_{i:06d}_000019"
                png = io.BytesIO()
                Image.fromarray(np.asarray(make_jpeg_decoded(40, 20, i))).save(png, "PNG")
                (images / city).mkdir(parents=True, exist_ok=True)
                (images / city / f"{key}_leftImg8bit.png").write_bytes(png.getvalue())
                values = _values(20, 40, i, 34)
                (masks / city).mkdir(parents=True, exist_ok=True)
                (masks / city / f"{key}_gtFine_labelIds.png").write_bytes(
                    make_mask_png(values, "L")
                )
                # the other files beside it, never taken for the mask
                (masks / city / f"{key}_gtFine_color.png").write_bytes(png.getvalue())
                (masks / city / f"{key}_gtFine_instanceIds.png").write_bytes(
                    make_mask_png(values * 1000, "I;16")
                )
                want[images / city / f"{key}_leftImg8bit.png"] = values
    return images, masks, want


def make_jpeg_decoded(w: int, h: int, seed: int) -> Image.Image:
    return Image.open(io.BytesIO(make_jpeg_bytes(w, h, seed=seed))).convert("RGB")


@pytest.mark.parametrize("layout", ["isic", "voc", "ade20k", "cityscapes"])
def test_from_folder_pairs_the_common_segmentation_layouts_in_one_call(tmp_path, layout):
    images, masks, want = _build_layout(tmp_path, layout)
    cache = JpegCache.from_folder(images, masks=masks, progress=False)
    assert sorted(cache.paths) == sorted(str(p) for p in want)
    assert cache.classes == [] and (cache.labels == -1).all()
    for i, path in enumerate(cache.paths):
        np.testing.assert_array_equal(decode_mask(cache.masks[i]), want[Path(path)])
    skipped = cache.report.skipped
    if layout == "voc":  # JPEGImages holds images without a segmentation mask
        assert [Path(s.path).name for s in skipped] == ["2008_000099.jpg"]
        assert "no mask file" in skipped[0].reason and "SegmentationClass" in skipped[0].reason
    else:
        assert skipped == []


def test_a_mask_folder_inside_the_image_folder_is_not_taken_for_images(tmp_path):
    _pair(tmp_path, "a.jpg", 20, 30, tmp_path / "masks" / "a.png")
    cache = JpegCache.from_folder(tmp_path, masks=tmp_path / "masks", progress=False)
    assert [Path(p).name for p in cache.paths] == ["a.jpg"]


def test_from_csv_takes_a_mask_column_by_name_or_index(tmp_path):
    rows = []
    for i in range(3):
        _pair(tmp_path / "img", f"{i}.jpg", 20, 30, tmp_path / "lbl" / f"{i}.png", seed=i)
        rows.append(f"img/{i}.jpg,{i % 2},lbl/{i}.png")
    (tmp_path / "named.csv").write_text("path,label,mask\n" + "\n".join(rows) + "\n")
    (tmp_path / "plain.csv").write_text("\n".join(rows) + "\n")
    named = JpegCache.from_csv(tmp_path / "named.csv", mask_column="mask", progress=False)
    plain = JpegCache.from_csv(tmp_path / "plain.csv", mask_column=2, progress=False)
    for cache in (named, plain):
        assert len(cache) == 3 and cache.labels.tolist() == [0, 1, 0]
        assert [cache.masks[i].tobytes() for i in range(3)] == [
            (tmp_path / "lbl" / f"{i}.png").read_bytes() for i in range(3)
        ]
    with pytest.raises(ValueError, match="header row"):
        JpegCache.from_csv(tmp_path / "plain.csv", mask_column="mask", progress=False)


def test_from_hf_takes_a_mask_column(tmp_path):
    datasets = pytest.importorskip("datasets")
    images = [make_jpeg_bytes(30, 20, seed=i) for i in range(3)]
    masks = [make_mask_png(_values(20, 30, i), "P") for i in range(3)]
    ds = datasets.Dataset.from_dict(
        {
            "image": [{"bytes": b, "path": None} for b in images],
            "mask": [{"bytes": b, "path": None} for b in masks],
        },
        features=datasets.Features({"image": datasets.Image(), "mask": datasets.Image()}),
    )
    cache = JpegCache.from_hf(ds, mask_column="mask", label_column=None, progress=False)
    assert [cache.masks[i].tobytes() for i in range(3)] == masks
    assert cache.masks.counts() == {"P": 3}


def _tar(path: Path, members: dict[str, bytes]) -> Path:
    import tarfile

    with tarfile.open(path, "w") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def test_from_webdataset_takes_a_png_mask_member_beside_the_jpg(tmp_path):
    members, want = {}, []
    for i in range(3):
        values = _values(20, 30, i)
        members[f"s{i}.jpg"] = make_jpeg_bytes(30, 20, seed=i)
        members[f"s{i}.png"] = make_mask_png(values, "P")
        members[f"s{i}.cls"] = str(i).encode()
        want.append(values)
    members["s3.jpg"] = make_jpeg_bytes(30, 20, seed=3)  # no mask member: reported
    shard = _tar(tmp_path / "train-000.tar", members)
    cache = JpegCache.from_webdataset(shard, mask_ext="png", progress=False)
    assert len(cache) == 3 and cache.labels.tolist() == [0, 1, 2]
    assert all(k == 1 for k in cache.kinds())  # the jpg is the image, never the png
    for i, values in enumerate(want):
        np.testing.assert_array_equal(decode_mask(cache.masks[i]), values)
    [skipped] = cache.report.skipped
    assert skipped.path.endswith("s3.jpg") and "s3.png" in skipped.reason
    assert "no mask member" in skipped.reason


def test_local_images_with_masks_in_storage_and_the_reverse_are_refused_with_the_fix(tmp_path):
    (tmp_path / "a.jpg").write_bytes(make_jpeg_bytes(20, 20))
    fix = "local images with masks in storage, and images in storage with local masks"
    with pytest.raises(ValueError, match=fix):
        JpegCache.from_folder("s3://bucket/images/", masks=tmp_path)
    with pytest.raises(ValueError, match=fix):
        JpegCache.from_folder(tmp_path, masks="s3://bucket/masks/")
    with pytest.raises(ValueError, match=fix):
        JpegCache.from_files([tmp_path / "a.jpg"], masks=["s3://bucket/a.png"])


@pytest.fixture(scope="module")
def s3_masks(tmp_path_factory):
    """An S3 server on 127.0.0.1 (moto's) holding images, their masks, a CSV and a shard, in a
    bucket of its own (moto's buckets outlive a server within the process)."""
    pytest.importorskip("moto.server")
    s3fs = pytest.importorskip("s3fs")
    from tests.support.s3server import S3Server

    base = tmp_path_factory.mktemp("s3masks")
    server = S3Server()
    server.start()
    try:
        with pytest.MonkeyPatch.context() as mp:
            for k, v in server.env("masks-test-secret").items():
                mp.setenv(k, v)
            fs = s3fs.S3FileSystem(skip_instance_cache=True)
            fs.mkdir("segbkt")
            uploads, want, rows, members = {}, [], ["path,label,mask"], {}
            for i in range(3):
                values = _values(20, 30, i)
                image, mask = make_jpeg_bytes(30, 20, seed=i), make_mask_png(values, "P")
                uploads[f"segbkt/img/{i}.jpg"] = image
                uploads[f"segbkt/lbl/{i}.png"] = mask
                members[f"{i}.jpg"], members[f"{i}.png"] = image, mask
                rows.append(f"img/{i}.jpg,{i},lbl/{i}.png")
                want.append(values)
            uploads["segbkt/list.csv"] = ("\n".join(rows) + "\n").encode()
            uploads["segbkt/shards/s-000.tar"] = _tar(base / "s.tar", members).read_bytes()
            fs.pipe(uploads)
            yield want
    finally:
        server.stop()


def test_masks_in_object_storage_come_with_their_images(s3_masks, tmp_path):
    urls = [f"s3://segbkt/img/{i}.jpg" for i in range(3)]
    masks = [f"s3://segbkt/lbl/{i}.png" for i in range(2)] + ["s3://segbkt/lbl/missing.png"]
    kw = dict(cache_dir=tmp_path, progress=False)
    listed = JpegCache.from_files(urls, masks=masks, **kw)
    assert list(listed.paths) == urls[:2]
    [skipped] = listed.report.skipped
    assert "missing.png" in skipped.reason and "no such object" in skipped.reason
    from_csv = JpegCache.from_csv("s3://segbkt/list.csv", mask_column="mask", **kw)
    shards = JpegCache.from_webdataset("s3://segbkt/shards/s-{000..000}.tar", mask_ext="png", **kw)
    for cache, n in ((listed, 2), (from_csv, 3), (shards, 3)):
        assert len(cache) == n and cache.masks.counts() == {"P": n}
        for i in range(n):
            np.testing.assert_array_equal(decode_mask(cache.masks[i]), s3_masks[i])
    assert from_csv.labels.tolist() == [0, 1, 2]
    plain = JpegCache.from_files(urls, **kw)  # the same images without masks: another store
    assert plain.masks is None and plain.path != listed.path


@pytest.fixture(scope="module")
def s3_layouts(s3_masks, tmp_path_factory):
    """ISIC-like and Cityscapes-like folders on a disk, the same files under s3://segbkt/<layout>/
    (an ISIC image without a mask, and a name with odd characters, among them)."""
    s3fs = pytest.importorskip("s3fs")
    base = tmp_path_factory.mktemp("s3layouts")
    uploads, roots = {}, {}
    for layout in ("isic", "cityscapes"):
        images, masks, _ = _build_layout(base / layout, layout)
        if layout == "isic":
            (images / "ISIC_0000099.jpg").write_bytes(make_jpeg_bytes(20, 20))  # no mask
            name = "ISIC_0000007 (copy)+%20é"
            _pair(images, f"{name}.jpg", 30, 40, masks / f"{name}_segmentation.png", seed=7)
        for p in sorted((base / layout).rglob("*")):
            if p.is_file():
                uploads[f"segbkt/{layout}/{p.relative_to(base / layout).as_posix()}"] = (
                    p.read_bytes()
                )
        roots[layout] = (images, masks, base / layout)
    s3fs.S3FileSystem(skip_instance_cache=True).pipe(uploads)
    return roots


def _url(layout: str, folder: Path, top: Path) -> str:
    return f"s3://segbkt/{layout}/{folder.relative_to(top).as_posix()}/"


@pytest.mark.parametrize("layout", ["isic", "cityscapes"])
def test_from_folder_of_prefixes_in_storage_equals_the_local_build(s3_layouts, tmp_path, layout):
    images, masks, top = s3_layouts[layout]
    local = JpegCache.from_folder(images, masks=masks, progress=False)
    url, mask_url = _url(layout, images, top), _url(layout, masks, top)
    remote = JpegCache.from_folder(url, masks=mask_url, cache_dir=tmp_path, progress=False)
    assert len(remote) == len(local) and remote.masks.counts() == local.masks.counts()
    assert [p[len(url) :] for p in remote.paths] == [
        Path(p).relative_to(images).as_posix() for p in local.paths
    ]
    assert remote.classes == [] and (remote.labels == -1).all()
    for i in range(len(local)):
        assert remote[i].tobytes() == local[i].tobytes()
        assert remote.masks[i].tobytes() == local.masks[i].tobytes()
    skipped = [(s.path, s.reason) for s in remote.report.skipped]
    if layout == "isic":  # the image without a mask, named by its URL and the mask URL looked for
        [(path, reason)] = skipped
        [(_, local_reason)] = [(s.path, s.reason) for s in local.report.skipped]
        assert path == f"{url}ISIC_0000099.jpg"
        assert f"{mask_url}ISIC_0000099[_suffix].png" in reason
        assert reason.split(": ", 1)[1] == local_reason.split(": ", 1)[1]
    else:
        assert skipped == []
    again = JpegCache.from_folder(url, masks=mask_url, cache_dir=tmp_path, progress=False)
    assert again.path == remote.path  # unchanged listings: the store built once
    plain = JpegCache.from_files(list(remote.paths), cache_dir=tmp_path, progress=False)
    assert plain.masks is None and plain.path != remote.path


def test_a_mask_prefix_inside_the_image_prefix_is_not_taken_for_images(s3_masks, tmp_path):
    import s3fs

    values = _values(20, 30, 4)
    s3fs.S3FileSystem(skip_instance_cache=True).pipe(
        {
            "segbkt/inside/a.jpg": make_jpeg_bytes(30, 20, seed=4),
            "segbkt/inside/masks/a.png": make_mask_png(values, "L"),
        }
    )
    cache = JpegCache.from_folder(
        "s3://segbkt/inside", masks="s3://segbkt/inside/masks", cache_dir=tmp_path, progress=False
    )
    assert list(cache.paths) == ["s3://segbkt/inside/a.jpg"]
    np.testing.assert_array_equal(decode_mask(cache.masks[0]), values)
    with pytest.raises(FileNotFoundError, match="found no mask under s3://segbkt/nothing"):
        JpegCache.from_folder(
            "s3://segbkt/inside/", masks="s3://segbkt/nothing/", cache_dir=tmp_path
        )


def test_the_node_cache_key_holds_the_masks(tmp_path):
    _pair(tmp_path, "a.jpg", 20, 30, tmp_path / "a.png", seed=1)
    kw = dict(masks=[tmp_path / "a.png"], cache_dir=tmp_path / "node", progress=False)
    first = JpegCache.from_files([tmp_path / "a.jpg"], **kw)
    again = JpegCache.from_files([tmp_path / "a.jpg"], **kw)
    assert again.path == first.path  # unchanged inputs: the saved store
    plain = JpegCache.from_files([tmp_path / "a.jpg"], cache_dir=tmp_path / "node", progress=False)
    assert plain.path != first.path and plain.masks is None
    changed = _values(20, 30, 9)
    (tmp_path / "a.png").write_bytes(make_mask_png(changed, "L"))
    rebuilt = JpegCache.from_files([tmp_path / "a.jpg"], **kw)
    assert rebuilt.path != first.path
    np.testing.assert_array_equal(decode_mask(rebuilt.masks[0]), changed)


def test_from_folder_with_masks_is_built_once_and_rebuilt_when_a_mask_changes(tmp_path):
    images, masks, want = _build_layout(tmp_path, "ade20k")
    kw = dict(masks=masks, cache_dir=tmp_path / "node", progress=False)
    first = JpegCache.from_folder(images, **kw)
    assert JpegCache.from_folder(images, **kw).path == first.path
    target = masks / "training" / "ADE_train_00000001.png"
    target.write_bytes(make_mask_png(_values(36, 30, 7), "L"))
    assert JpegCache.from_folder(images, **kw).path != first.path


# ------------------------------------------------------------------ one copy, read-only


def _mask_digests(store) -> tuple[list[str], bool]:
    m = store.masks
    return [hashlib.sha256(m[i].tobytes()).hexdigest() for i in range(len(m))], any(
        m[i].flags.writeable for i in range(len(m))
    )


def test_a_spawned_worker_reads_the_masks_from_the_shared_store(tmp_path):
    """A store opened from its file and one moved to shared memory, each pickled into the same
    spawned worker (one interpreter for both)."""
    images, masks = [], []
    for i in range(3):
        _pair(tmp_path, f"{i}.jpg", 20, 30, tmp_path / f"{i}.png", seed=i)
        images.append(tmp_path / f"{i}.jpg")
        masks.append(tmp_path / f"{i}.png")
    cache = JpegCache.from_files(images, masks=masks, progress=False)
    stores = {"file": JpegCache.open(cache.save(tmp_path / "w.gpucache")), "shm": cache.share()}
    files = [hashlib.sha256(m.read_bytes()).hexdigest() for m in masks]
    with mp.get_context("spawn").Pool(1) as pool:
        for backing, store in stores.items():
            assert len(pickle.dumps(store)) < 1024, backing  # its handle, not its bytes
            assert pool.apply(_mask_digests, (store,)) == (files, False), backing  # read-only
    for store in stores.values():
        store.close()


# ------------------------------------------------------------------ the file format


@pytest.fixture()
def saved(tmp_path) -> Path:
    _pair(tmp_path, "a.jpg", 20, 30, tmp_path / "a.png", seed=1)
    _pair(tmp_path, "b.jpg", 24, 16, tmp_path / "b.png", "I;16", seed=2)
    cache = JpegCache.from_files(
        [tmp_path / "a.jpg", tmp_path / "b.jpg"],
        masks=[tmp_path / "a.png", tmp_path / "b.png"],
        progress=False,
    )
    return cache.save(tmp_path / "s.gpucache")


def _section_span(path: Path, name: str) -> tuple[int, int]:
    with JpegCache.open(path) as c:
        a = c.extra[name]
        base = np.frombuffer(c._file.buf, np.uint8).ctypes.data
        return a.ctypes.data - base, a.nbytes


def test_a_garbled_mask_section_is_a_clear_error(saved):
    start, length = _section_span(saved, "masks")
    raw = bytearray(saved.read_bytes())
    raw[start + length // 2] ^= 0xFF
    saved.write_bytes(bytes(raw))
    with pytest.raises(CacheFormatError, match="'masks' checksum mismatch"):
        JpegCache.open(saved)


def test_a_truncated_store_with_masks_is_a_clear_error(saved):
    raw = saved.read_bytes()
    saved.write_bytes(raw[: len(raw) - 100])
    with pytest.raises(CacheFormatError, match="truncated"):
        JpegCache.open(saved)


def _write_with(path: Path, cache: JpegCache, **sections: np.ndarray) -> None:
    arrays = cache._stored()
    arrays = arrays.with_sections({**sections})
    with open(path, "wb") as f:
        _format.write(f, arrays)


def test_mask_records_that_break_their_rules_are_refused_at_open(saved, tmp_path):
    cache = JpegCache.open(saved)
    info = np.array(cache.extra[INFO])
    offsets = np.array(cache.extra[OFFSETS])
    bad_kind, bad_size, bad_offsets = info.copy(), info.copy(), offsets.copy()
    bad_kind[1, 0] = 9
    bad_size[0, 1] += 1  # no longer its image's height
    bad_offsets[1] = offsets[2] + 5
    for sections, match in (
        ({INFO: bad_kind}, "'masks.info' holds an invalid record .* sample 1: kind 9"),
        ({INFO: bad_size}, "sample 0: kind 1, 21x30 \\(its image: 20x30\\)"),
        ({OFFSETS: bad_offsets}, "'masks.offsets' must start at 0, increase"),
        ({INFO: info[:1]}, "'masks.info' .* holds <u4 \\(1, 3\\)"),
    ):
        _write_with(tmp_path / "bad.gpucache", cache, **sections)
        with pytest.raises(CacheFormatError, match=match):
            JpegCache.open(tmp_path / "bad.gpucache")
        with pytest.raises(ValueError, match=match):
            cache._replace(extra={**cache.extra, **sections})
    with pytest.raises(ValueError, match="'masks'.*without 'masks.offsets'"):
        cache._replace(extra={"masks": np.zeros(3, np.uint8)})


# ------------------------------------------------------------------ command line


def test_cli_builds_shows_and_verifies_masks(tmp_path, capsys):
    images, masks, _ = _build_layout(tmp_path, "isic")
    out = tmp_path / "isic.gpucache"
    assert main(["build", str(images), "--masks", str(masks), "-o", str(out)]) == 0
    assert main(["info", str(out)]) == 0
    assert "masks: 3 (L: 3)" in capsys.readouterr().out
    assert main(["verify", str(out)]) == 0
    assert "3 of 3 masks decode" in capsys.readouterr().out
    # a mask whose bytes no longer decode to its record is found by verify
    cache = JpegCache.open(out)
    info = np.array(cache.extra[INFO])
    info[:, 0] = int(MaskKind.I16)
    _write_with(tmp_path / "wrong.gpucache", cache, **{INFO: info})
    assert main(["verify", str(tmp_path / "wrong.gpucache")]) == 1
    assert "0 of 3 masks decode" in capsys.readouterr().out


def test_a_mask_follows_its_image_resized_at_build_by_nearest_neighbour(tmp_path):
    values = _pair(tmp_path, "big.jpg", 60, 80, tmp_path / "big.png", "P", seed=3)
    _pair(tmp_path, "small.jpg", 20, 30, tmp_path / "small.png", seed=4)
    cache = JpegCache.from_files(
        [tmp_path / "big.jpg", tmp_path / "small.jpg"],
        masks=[tmp_path / "big.png", tmp_path / "small.png"],
        max_side=40,
        progress=False,
    )
    assert (cache.samples["height"].tolist(), cache.samples["width"].tolist()) == (
        [30, 20],
        [40, 30],
    )
    big = decode_mask(cache.masks[0])
    assert big.shape == (30, 40) and cache.masks.kind(0) is MaskKind.P
    assert set(np.unique(big)) <= set(np.unique(values))  # values kept, never blended
    np.testing.assert_array_equal(big, values[1::2, 1::2])  # a 2x nearest neighbour
    assert cache.masks[1].tobytes() == (tmp_path / "small.png").read_bytes()  # not re-encoded
