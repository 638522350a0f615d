"""Inputs whose sizes lie, damaged shards and empty folders: each is a clear per-input reason or
a clear error, never a MemoryError, a bare tarfile error or a silent empty store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import numpy as np
import pytest

from gpucache import BuildError, JpegCache
from gpucache.cli import main as cli_main
from gpucache.ingest._build import build
from gpucache.ingest._inputs import Samples
from gpucache.ingest._options import BuildOptions
from gpucache.testing import make_jpeg_bytes

REPO = Path(__file__).resolve().parent.parent
GOOD = make_jpeg_bytes(40, 30, seed=1)

_SPARSE_CHILD = textwrap.dedent("""
    import json, sys
    from gpucache import JpegCache
    from gpucache.testing._memory import reset_peak_rss, status_bytes

    before = reset_peak_rss()  # the peak RSS (VmHWM) is now the current RSS
    out = {}
    for key, mp in (("capped", 89_478_485), ("uncapped", None)):
        cache = JpegCache.from_folder(sys.argv[1], progress=False, max_pixels=mp)
        out[key] = {s.path.rsplit("/", 1)[1]: s.reason for s in cache.report.skipped}
        out[key + "_kept"] = len(cache)
        del cache
    out["peak"] = status_bytes("VmHWM") - before
    print(json.dumps(out))
""")


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_sparse_and_huge_files_cost_no_memory(tmp_path):
    """A 1 GiB and a 64 GiB sparse file of zeros, and a JPEG header followed by 20 MiB of holes:
    each is skipped with its reason, and the build never holds more than a few MiB for them."""
    root = tmp_path / "root"
    (root / "c").mkdir(parents=True)
    (root / "c" / "good.jpg").write_bytes(GOOD)
    for name, size in (("zeros_1g.jpg", 1 << 30), ("zeros_64g.jpg", 64 << 30)):
        with open(root / "c" / name, "wb") as f:
            f.truncate(size)
    with open(root / "c" / "holes.jpg", "wb") as f:
        f.write(GOOD[:200])
        f.truncate(20 << 20)
    run = subprocess.run(
        [sys.executable, "-c", _SPARSE_CHILD, str(root)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["capped_kept"] == out["uncapped_kept"] == 1
    capped, uncapped = out["capped"], out["uncapped"]
    for name in ("zeros_1g.jpg", "zeros_64g.jpg"):
        assert "bytes, more than the" in capped[name] and "raise max_pixels=" in capped[name]
        assert "not an image" in uncapped[name]  # sniffed before any room was reserved
    assert "no end-of-image marker" in capped["holes.jpg"] == uncapped["holes.jpg"]
    assert out["peak"] < 80 << 20, f"the build held {out['peak'] / 2**20:.0f} MiB"


def test_file_that_changes_size_after_listing_is_refused(tmp_path):
    (tmp_path / "a.jpg").write_bytes(GOOD)
    (tmp_path / "b.jpg").write_bytes(GOOD)
    calls = []

    def grow(done, total, nbytes):  # runs after the size pass, before anything is read
        if not calls:
            with open(tmp_path / "b.jpg", "ab") as f:
                f.write(b"\0" * 10)
        calls.append((done, total, nbytes))

    cache = build(
        JpegCache,
        [str(tmp_path / "a.jpg"), str(tmp_path / "b.jpg")],
        Samples(np.zeros(2, np.int64), ["x"]),
        BuildOptions(num_threads=1, progress=False),
        on_progress=grow,
    )
    [bad] = cache.report.skipped
    assert bad.index == 1 and "changed size since it was listed" in bad.reason
    assert calls[0] == (0, 2, 0) and calls[-1] == (2, 2, 2 * len(GOOD))


# ------------------------------------------------------------------------------ tar shards
def _member(name: str, data: bytes, size: int | None = None) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = len(data) if size is None else size
    return info.tobuf(format=tarfile.GNU_FORMAT) + data + b"\0" * (-len(data) % 512)


def test_bad_shards_are_bad_inputs(tmp_path):
    """A member claiming 64 GiB, a shard cut inside a member, one cut inside a header, one cut
    right after a member (no end-of-archive blocks), a gzip file and a missing shard: the good
    samples are kept, each problem is a skipped input named after its shard or member, and the
    counts add up."""
    good = _member("k0.jpg", GOOD) + _member("k0.cls", b"1")
    full = good + _member("k1.jpg", GOOD) + _member("k1.cls", b"0") + b"\0" * 1024
    shards = {
        "claims64g.tar": good + _member("k1.jpg", GOOD, size=64 << 30) + b"\0" * 1024,
        "cut_member.tar": full[: len(good) + 512 + 100],
        "cut_header.tar": full[: len(good) + 300],
        "cut_between.tar": full[: len(good)],
        "gzip.tar": b"\x1f\x8b\x08" + b"x" * 600,
        "fine.tar": full,
    }
    for name, data in shards.items():
        (tmp_path / name).write_bytes(data)
    paths = [str(tmp_path / n) for n in shards] + [str(tmp_path / "missing.tar")]
    cache = JpegCache.from_webdataset(paths, progress=False)
    report = cache.report
    assert report.total == report.kept + len(report.skipped) and len(cache) == report.kept == 6
    assert all(bytes(cache[i]) == GOOD for i in range(len(cache)))
    why = {s.path[len(str(tmp_path)) + 1 :]: s.reason for s in report.skipped}
    assert "claims 68,719,476,736 bytes" in why["claims64g.tar/k1.jpg"]
    assert "truncated or corrupt tar" in why["claims64g.tar"]
    assert "shard ends 100 bytes after its start" in why["cut_member.tar/k1.jpg"]
    assert "truncated or corrupt tar" in why["cut_member.tar"]
    assert "no tar header" in why["cut_header.tar"]
    assert "without the tar's end-of-archive blocks" in why["cut_between.tar"]
    assert "not an uncompressed tar" in why["gzip.tar"] and "gunzip" in why["gzip.tar"]
    assert "cannot open the shard" in why["missing.tar"]
    with pytest.raises(BuildError, match="cut_member.tar: truncated"):
        JpegCache.from_webdataset(paths, progress=False, on_error="raise")


def test_text_members_that_are_not_utf8_are_named_not_a_crash(tmp_path):
    """A .json metadata member that is not UTF-8 leaves its sample out with the reason; a .cls
    that is not UTF-8 is a wrong label: the build refuses it, naming the member and its bytes."""
    shard = tmp_path / "s.tar"
    shard.write_bytes(
        _member("k0.jpg", GOOD)
        + _member("k0.cls", b"1")
        + _member("k0.json", b"{}")
        + _member("k1.jpg", GOOD)
        + _member("k1.cls", b"0")
        + _member("k1.json", b'{"name": "caf\xe9"}')
        + b"\0" * 1024
    )
    cache = JpegCache.from_webdataset(shard, metadata_ext="json", progress=False)
    assert len(cache) == 1 and list(cache.labels) == [1] and cache.metadata[0] == "{}"
    (bad,) = cache.report.skipped
    assert bad.path == f"{shard}/k1.jpg"
    assert "its .json member is not UTF-8 text (byte 13 is 0xe9)" in bad.reason
    assert "rewrite that member" in bad.reason
    assert len(JpegCache.from_webdataset(shard, progress=False)) == 2  # metadata not asked for
    other = tmp_path / "c.tar"
    other.write_bytes(_member("k0.jpg", GOOD) + _member("k0.cls", b"\xff1") + b"\0" * 1024)
    with pytest.raises(ValueError, match=r"c.tar/k0.cls holds '\\\\xff1', not an integer"):
        JpegCache.from_webdataset(other, progress=False)


# --------------------------------------------------------------------------- empty inputs
def test_folder_without_images_is_an_error(tmp_path, capsys):
    for c in ("a", "b"):
        (tmp_path / "root" / c).mkdir(parents=True)
    (tmp_path / "root" / "a" / "notes.txt").write_text("not an image")
    with pytest.raises(FileNotFoundError, match=r"found no image in .*root.*a, b.*\.jpg"):
        JpegCache.from_folder(tmp_path / "root", progress=False)
    assert cli_main(["build", str(tmp_path / "root"), "-o", str(tmp_path / "x.gpucache")]) != 0
    assert "found no image" in capsys.readouterr().err
    assert not (tmp_path / "x.gpucache").exists()


def test_build_that_keeps_nothing_is_an_error(tmp_path, caplog):
    (tmp_path / "root" / "a").mkdir(parents=True)
    (tmp_path / "root" / "b").mkdir(parents=True)
    (tmp_path / "root" / "b" / "x.jpg").write_bytes(b"not a jpeg")
    with pytest.raises(BuildError, match="(?s)1 files.*x.jpg"):
        JpegCache.from_folder(tmp_path / "root", progress=False)  # on_error="skip" too
    with pytest.raises(BuildError, match="nothing to build"):
        JpegCache.from_files([], progress=False)
    (tmp_path / "root" / "b" / "y.jpg").write_bytes(GOOD)
    cache = JpegCache.from_folder(tmp_path / "root", progress=False)
    assert cache.classes == ["a", "b"] and cache.labels.tolist() == [1]  # as torchvision
    assert "hold no image" in caplog.text and ": a" in caplog.text


def test_scan_folder_paths_are_the_os_names(tmp_path):
    from gpucache.ingest._build import scan_folder

    names = ["b.jpg", "a.JPEG", "caf\udce9.png", "z.txt"]
    for c in ("x", "y"):
        (tmp_path / c / "sub").mkdir(parents=True)
        for n in names:
            (tmp_path / c / n).write_bytes(b"")
        (tmp_path / c / "sub" / "s.jpg").write_bytes(b"")
    paths, labels, classes = scan_folder(tmp_path)
    expected = [
        str(tmp_path / c / n)
        for c in ("x", "y")
        for n in ("a.JPEG", "b.jpg", "caf\udce9.png", "sub/s.jpg")
    ]
    assert list(paths) == expected and paths[-1] == expected[-1] and paths[1:3] == expected[1:3]
    assert labels.tolist() == [0] * 4 + [1] * 4 and classes == ["x", "y"]
    with pytest.raises(IndexError):
        paths[len(expected)]
