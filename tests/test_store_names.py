"""File names that are not UTF-8, and the build report, survive build, save, open and workers."""

import io
import os
import pickle
import tarfile

import torchvision

from gpucache import GpuCachedLoader, JpegCache
from gpucache.testing import make_jpeg_bytes

LATIN1 = b"caf\xe9"  # "café" in Latin-1: not UTF-8, listed fine by os.listdir and ImageFolder


def _bytes_folder(tmp_path) -> bytes:
    """root/caf\\xe9/{caf\\xe9.jpg, na\\xefve.jpg, bad\\xff.jpg}, root/ok/x.jpg (bytes paths)."""
    root = os.fsencode(tmp_path / "imgs")
    for cls, names in ((LATIN1, [LATIN1 + b".jpg", b"na\xefve.jpg"]), (b"ok", [b"x.jpg"])):
        os.makedirs(os.path.join(root, cls))
        for k, name in enumerate(names):
            with open(os.path.join(root, cls, name), "wb") as f:
                f.write(make_jpeg_bytes(24 + k, 16, seed=k))
    with open(os.path.join(root, LATIN1, b"bad\xff.jpg"), "wb") as f:
        f.write(b"not an image")
    return root


def test_from_folder_keeps_non_utf8_names_through_save_open_and_workers(tmp_path):
    root = _bytes_folder(tmp_path)
    cache = JpegCache.from_folder(os.fsdecode(root), progress=False)
    ref = torchvision.datasets.ImageFolder(os.fsdecode(root))
    assert cache.classes == ref.classes == [os.fsdecode(LATIN1), "ok"]
    good = [p for p, _ in ref.samples if not p.endswith(os.fsdecode(b"bad\xff.jpg"))]
    assert list(cache.paths) == good and len(cache) == 3
    (skipped,) = cache.report.skipped
    assert os.fsencode(skipped.path) == os.path.join(root, LATIN1, b"bad\xff.jpg")

    opened = JpegCache.open(cache.save(tmp_path / "names.gpucache"))
    assert opened.classes == cache.classes and list(opened.paths) == good
    for i, p in enumerate(opened.paths):  # the same str the OS gave: it names the file
        with open(p, "rb") as f:
            assert f.read() == opened[i].tobytes()
    assert opened.report.skipped == cache.report.skipped

    again = pickle.loads(pickle.dumps(opened))  # as a spawn worker gets it
    assert list(again.paths) == good and again.report.skipped == cache.report.skipped
    loader = GpuCachedLoader(
        opened, batch_size=3, device="cpu", num_workers=0, return_metadata=True
    )
    ((_, _, info),) = list(loader)
    assert sorted(info.paths) == sorted(good)
    loader.close()


def test_from_files_takes_fsdecoded_names(tmp_path):
    root = _bytes_folder(tmp_path)
    files = [os.path.join(root, LATIN1, n) for n in (LATIN1 + b".jpg", b"na\xefve.jpg")]
    names = [os.fsdecode(f) for f in files]
    cache = JpegCache.from_files(
        names, [0, 1], [os.fsdecode(b"meta\xe9"), "plain"], classes=["a", "b"], progress=False
    )
    opened = JpegCache.open(cache.save(tmp_path / "files.gpucache"))
    assert list(opened.paths) == names
    assert [os.fsencode(p) for p in opened.paths] == files
    assert list(opened.metadata) == [os.fsdecode(b"meta\xe9"), "plain"]


def test_from_webdataset_member_named_in_latin1(tmp_path):
    shard = tmp_path / "shard-0.tar"
    with tarfile.open(shard, "w", format=tarfile.GNU_FORMAT) as tar:  # names stored as raw bytes
        for k, key in enumerate((LATIN1, b"plain")):
            for ext, data in ((b".jpg", make_jpeg_bytes(20, 12, seed=k)), (b".cls", b"%d" % k)):
                info = tarfile.TarInfo(os.fsdecode(key + ext))
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    raw = shard.read_bytes()
    assert LATIN1 + b".jpg\0" in raw  # the member name really is Latin-1 in the tar
    cache = JpegCache.from_webdataset(shard, progress=False)
    assert cache.labels.tolist() == [0, 1]
    opened = JpegCache.open(cache.save(tmp_path / "wds.gpucache"))
    assert list(opened.paths) == list(cache.paths)
    assert opened.paths[0] == f"{shard}/{os.fsdecode(LATIN1)}.jpg"
    assert opened[0].tobytes() == make_jpeg_bytes(20, 12, seed=0)


def test_build_report_is_kept_in_the_file(tmp_path, capsys, caplog):
    """``cache.report`` after open is the build's report; the CLI lists each skipped file once."""
    from gpucache.cli import main

    root = tmp_path / "imgs" / "c"
    root.mkdir(parents=True)
    for k in range(3):
        (root / f"{k}.jpg").write_bytes(make_jpeg_bytes(20, 12, seed=k))
    for k in range(2):
        (root / f"broken{k}.jpg").write_bytes(b"\xff\xd8 truncated")
    out = tmp_path / "r.gpucache"
    assert main(["build", str(root.parent), "-o", str(out)]) == 0
    captured = capsys.readouterr()
    text = captured.out + captured.err + caplog.text  # caplog: the build's warning
    for k in range(2):
        assert text.count(f"broken{k}.jpg") == 1, text
    opened = JpegCache.open(out)
    assert opened.report is not None
    assert (opened.report.total, opened.report.kept) == (5, 3)
    assert opened.report.counts == {"JPEG": 3}
    assert [os.path.basename(s.path) for s in opened.report.skipped] == [
        "broken0.jpg",
        "broken1.jpg",
    ]
    assert [s.index for s in opened.report.skipped] == [3, 4]  # after 0, 1, 2.jpg
    assert all(s.reason for s in opened.report.skipped)
    assert main(["info", "--skipped", str(out)]) == 0
    info = capsys.readouterr().out
    assert "build report: 5 files: 3 kept (JPEG: 3), 2 skipped" in info
    assert "broken1.jpg" in info
