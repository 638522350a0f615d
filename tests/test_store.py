"""The store: round trips, ImageFolder parity, the file format, read-only views, pickling."""

import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torchvision

import gpucache
from gpucache import CacheFormatError, JpegCache

DATA = Path(__file__).parent / "data"


def test_every_public_name_resolves():
    for name in gpucache.__all__:
        assert getattr(gpucache, name) is not None, name
    for name in gpucache.transforms.__all__:
        assert getattr(gpucache.transforms, name) is not None, name


def test_bytes_round_trip_and_imagefolder_parity(jpeg_folder, tmp_path):
    cache = JpegCache.from_folder(jpeg_folder, progress=False)
    ref = torchvision.datasets.ImageFolder(str(jpeg_folder))
    assert cache.classes == ref.classes
    assert [p for p, _ in ref.samples] == list(cache.paths)
    assert cache.labels.tolist() == [label for _, label in ref.samples]
    assert cache.nbytes == sum(os.path.getsize(p) for p, _ in ref.samples)
    for i, (path, _) in enumerate(ref.samples):
        assert cache[i].tobytes() == Path(path).read_bytes()
    opened = JpegCache.open(cache.save(tmp_path / "s.gpucache"))
    assert len(opened) == len(cache) and opened.classes == cache.classes
    assert np.array_equal(opened.labels, cache.labels)
    assert np.array_equal(opened.samples, cache.samples)
    for i, (path, _) in enumerate(ref.samples):
        assert opened[i].tobytes() == Path(path).read_bytes()
    assert cache[-1].tobytes() == opened[len(opened) - 1].tobytes()
    with pytest.raises(IndexError):
        cache[len(cache)]


def test_from_files_metadata_and_labels(jpeg_folder):
    paths = sorted(str(p) for p in Path(jpeg_folder).rglob("*.jpg"))[:5]
    meta = [f"caption {i} \N{SNOWMAN}" for i in range(5)]
    cache = JpegCache.from_files(
        paths, [0, 1, 0, 1, 1], meta, classes=["no", "yes"], progress=False
    )
    assert list(cache.metadata) == meta and cache.classes == ["no", "yes"]
    assert cache.labels.tolist() == [0, 1, 0, 1, 1]
    unlabeled = JpegCache.from_files(paths, progress=False)
    assert unlabeled.labels.tolist() == [-1] * 5 and unlabeled.metadata is None
    with pytest.raises(ValueError, match="labels must lie"):
        JpegCache.from_files(paths, [0, 1, 2, 0, 0], classes=["a", "b"], progress=False)
    with pytest.raises(ValueError, match="metadata has 2 entries"):
        JpegCache.from_files(paths, metadata=["a", "b"], progress=False)


def test_views_are_read_only_and_store_unchanged(jpeg_folder, tmp_path):
    for cache in (JpegCache.from_folder(jpeg_folder, progress=False),):
        opened = JpegCache.open(cache.save(tmp_path / "ro.gpucache"))
        for c in (cache, opened):
            before = c[0].tobytes()
            view = c[0]
            with pytest.raises(ValueError, match="read-only"):
                view[0] = 0
            with pytest.raises(ValueError, match="read-only"):
                view += 1
            with pytest.raises(ValueError):
                view.flags.writeable = True
            assert c[0].tobytes() == before


def test_pickle_is_o1_bytes_for_mapped_and_refused_in_memory(jpeg_folder, tmp_path):
    cache = JpegCache.from_folder(jpeg_folder, progress=False)
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(cache)
    opened = JpegCache.open(cache.save(tmp_path / "p.gpucache"))
    blob = pickle.dumps(opened)
    assert len(blob) < 400 < cache.nbytes
    again = pickle.loads(blob)
    assert again[3].tobytes() == cache[3].tobytes()
    shared = cache.share()
    try:
        assert shared.is_shared and len(pickle.dumps(shared)) < 400
        assert pickle.loads(pickle.dumps(shared))[5].tobytes() == opened[5].tobytes()
    finally:
        cache.close()
    assert not shared.is_shared
    with pytest.raises(ValueError, match="closed"):
        pickle.dumps(shared)
    assert shared[5].tobytes() == opened[5].tobytes()  # views stay valid after close()


def _fd_targets() -> dict[int, str]:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return out


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="Linux /proc")
def test_shared_memory_is_nameless_and_released_on_gc(jpeg_folder):
    import gc

    cache = JpegCache.from_folder(jpeg_folder, progress=False).share()
    fd = cache._file.handle.fd
    assert cache.path is None and "gpucache-" in _fd_targets()[fd]
    assert "(deleted)" in _fd_targets()[fd]  # no name in /dev/shm: only the descriptor holds it
    del cache
    gc.collect()
    assert "gpucache-" not in _fd_targets().get(fd, "")


def _tiny(tmp_path, monkeypatch) -> JpegCache:
    from conftest import sof_jpeg

    monkeypatch.chdir(tmp_path)  # relative paths, so the file does not depend on the machine
    Path("a.jpg").write_bytes(sof_jpeg(h=2, w=3))
    Path("b.jpg").write_bytes(sof_jpeg(h=5, w=4, comps=1))
    return JpegCache.from_files(
        ["a.jpg", "b.jpg"], [1, 0], ["first", "second"], classes=["cat", "dog"], progress=False
    )


def _check_tiny(opened: JpegCache) -> None:
    assert opened.classes == ["cat", "dog"] and opened.labels.tolist() == [1, 0]
    assert list(opened.metadata) == ["first", "second"] and list(opened.paths) == ["a.jpg", "b.jpg"]
    assert opened.samples["height"].tolist() == [2, 5] and opened.samples["width"].tolist() == [
        3,
        4,
    ]
    assert opened.samples["components"].tolist() == [3, 1]
    assert opened[0].tobytes()[:2] == b"\xff\xd8"


def test_a_version_1_file_is_refused_with_the_fix(tmp_path):
    """Version 1 (no section directory) was a development format, never released: a file of it
    gets a clear error naming the version this gpucache reads and the fix."""
    v1 = bytearray((DATA / "tiny-v2.gpucache").read_bytes())
    struct.pack_into("<I", v1, 8, 1)
    (tmp_path / "old.gpucache").write_bytes(v1)
    with pytest.raises(
        CacheFormatError,
        match=r"version 1 .*version 2.*gpucache build",
    ):
        JpegCache.open(tmp_path / "old.gpucache")


def test_golden_v2_file_without_checksums_or_report_still_opens():
    """A v2 file written before the ``sample.crc32`` and ``report.*`` sections existed."""
    opened = JpegCache.open(DATA / "tiny-v2.gpucache")
    _check_tiny(opened)
    assert sorted(opened.extra) == ["rst", "targets"] and opened.report is None


def test_golden_v2_bytes_with_optional_sections(tmp_path, monkeypatch, capsys):
    """Format v2 stays byte-for-byte stable, optional sections included."""
    from gpucache.store._format import ENTRY, HEAD_V2

    golden = DATA / "tiny-v2-report.gpucache"
    extra = {
        "rst": np.array([0, 4], dtype="<i4"),
        "targets": np.array([[0.5, 0.25], [1.0, 0.0]], dtype="<f4"),
    }
    cache = _tiny(tmp_path, monkeypatch)._replace(extra=extra)
    out = cache.save(tmp_path / "tiny.gpucache").read_bytes()
    assert out == golden.read_bytes()
    head = HEAD_V2.unpack_from(out)
    assert head[:6] == (b"GPUCACHE", 2, 256, 2, 2, len(out))
    directory, count = head[22], head[23]
    assert directory % 64 == 0 and count == 8
    names = [ENTRY.unpack_from(out, directory + k * ENTRY.size)[:2] for k in range(count)]
    assert [(n.rstrip(b"\0").decode(), t.rstrip(b"\0").decode()) for n, t in names] == [
        ("rst", "<i4"),
        ("targets", "<f4"),
        ("report.totals", "<i8"),
        ("report.kinds", "<i8"),
        ("report.skipped", "<i8"),
        ("report.offsets", "<u8"),
        ("report.text", "|u1"),
        ("sample.crc32", "<u4"),
    ]
    assert out[4096 : 4096 + 2] == b"\xff\xd8"  # data section on a page boundary
    opened = JpegCache.open(golden)
    _check_tiny(opened)
    assert sorted(opened.extra) == ["rst", "targets"]  # gpucache's own sections are not listed
    assert str(opened.report) == str(cache.report) == "2 files: 2 kept (JPEG: 2), 0 skipped"
    import zlib

    crcs = opened._file.extra["sample.crc32"]
    assert crcs.tolist() == [zlib.crc32(opened[i]) for i in range(2)]
    for name, arr in extra.items():
        got = opened.extra[name]
        assert got.dtype == arr.dtype and np.array_equal(got, arr) and not got.flags.writeable
    from gpucache.cli import main

    assert main(["info", str(golden)]) == 0
    assert "sections: rst <i4 (2,), targets <f4 (2, 2)" in capsys.readouterr().out
    shared = opened._replace().share()  # in memory, then shared memory: sections carried along
    again = pickle.loads(pickle.dumps(shared))
    assert np.array_equal(again.extra["targets"], extra["targets"])
    assert str(again.report) == str(cache.report)
    shared.close()


def test_optional_section_names_and_types_are_checked(tmp_path, monkeypatch):
    cache = _tiny(tmp_path, monkeypatch)
    for name, arr, match in [
        ("Bad Name", np.zeros(2), "not allowed"),
        ("x" * 33, np.zeros(2), "not allowed"),
        ("objs", np.array([None, 1], dtype=object), "1-D or 2-D"),
        ("cube", np.zeros((2, 2, 2)), "1-D or 2-D"),
    ]:
        with pytest.raises(ValueError, match=match):
            cache._replace(extra={name: arr})
    big_endian = cache._replace(extra={"t": np.array([1.5, 2.5], dtype=">f8")})
    path = big_endian.save(tmp_path / "be.gpucache")
    assert JpegCache.open(path).extra["t"].tolist() == [1.5, 2.5]


@pytest.fixture()
def saved(jpeg_folder, tmp_path) -> bytes:
    cache = JpegCache.from_folder(jpeg_folder, progress=False)
    return cache.save(tmp_path / "ok.gpucache").read_bytes()


def _open_bytes(tmp_path, data: bytes) -> JpegCache:
    p = tmp_path / "bad.gpucache"
    p.write_bytes(data)
    return JpegCache.open(p)


def _with_header_crc(b: bytearray) -> bytes:
    import zlib

    from gpucache.store._format import HEAD_V2

    struct.pack_into("<I", b, HEAD_V2.size, zlib.crc32(bytes(b[: HEAD_V2.size])))
    return bytes(b)


def test_bad_files_give_clear_errors(saved, tmp_path):
    cases = {
        "empty file": b"",
        "too small": saved[:100],
        "not a gpucache store": b"\x89PNG" + saved[4:],
        "truncated or extended": saved[:-1000],
        "header checksum": saved[:20] + b"\x07" + saved[21:],
    }
    for why, data in cases.items():
        with pytest.raises(CacheFormatError, match=why):
            _open_bytes(tmp_path, data)
    wrong_version = bytearray(saved)
    struct.pack_into("<I", wrong_version, 8, 99)
    with pytest.raises(CacheFormatError, match="version 99"):
        _open_bytes(tmp_path, _with_header_crc(wrong_version))
    with pytest.raises(FileNotFoundError, match="missing.gpucache"):
        JpegCache.open(tmp_path / "missing.gpucache")


def test_out_of_range_offsets_and_sections(saved, tmp_path):
    fields = struct.unpack_from("<8sIIQQQ" + "QQ" * 7, saved)
    off_start = fields[6]
    bad = bytearray(saved)
    struct.pack_into("<q", bad, off_start + 8, 10**12)  # offsets[1] far outside the data
    # index crc no longer matches: the checksum catches it first
    with pytest.raises(CacheFormatError, match="index checksum"):
        _open_bytes(tmp_path, bytes(bad))
    # the same corruption with a recomputed index checksum: the bounds check catches it
    import zlib

    crc = 0
    spans = list(zip(fields[6::2], fields[7::2]))
    for start, length in spans[:-1]:
        crc = zlib.crc32(bytes(bad[start : start + length]), crc)
    struct.pack_into("<I", bad, 156, crc)  # the index CRC
    with pytest.raises(CacheFormatError, match="offsets"):
        _open_bytes(tmp_path, _with_header_crc(bad))
    bad = bytearray(saved)
    struct.pack_into("<Q", bad, 40 + 16 * 6, len(saved) + 10)  # data section past the end
    with pytest.raises(CacheFormatError, match="out of bounds"):
        _open_bytes(tmp_path, _with_header_crc(bad))


def test_save_replaces_the_old_file_and_leaves_no_temp(jpeg_folder, tmp_path):
    cache = JpegCache.from_folder(jpeg_folder, progress=False)
    target = tmp_path / "a.gpucache"
    target.write_bytes(b"old contents")
    cache.save(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gpucache"]
    assert JpegCache.open(target)[0].tobytes() == cache[0].tobytes()


_SAVE_IN_CHILD = """
import resource, signal, sys
from gpucache import JpegCache
src, target, limit, die = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "die"
cache = JpegCache.open(src)
# Python ignores SIGXFSZ (a write past the limit fails with EFBIG); its default action kills
signal.signal(signal.SIGXFSZ, signal.SIG_DFL if die else signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # else SIGXFSZ kills mid-write
try:
    cache.save(target)
except OSError as err:
    print(err.errno, file=sys.stderr)
    sys.exit(3)
"""


@pytest.mark.parametrize("how", ["killed", "failed"])
def test_a_save_that_dies_or_fails_midway_leaves_the_old_file_intact(jpeg_folder, tmp_path, how):
    """A writer killed halfway through (SIGXFSZ at the file-size limit: the kernel stops it inside
    a write, the way a SIGKILL or a crash would) or failing halfway (EFBIG) never replaces the
    old file; a failed writer removes its temporary file, a killed one's is removed by the next
    save."""
    import errno
    import signal
    import subprocess
    import sys

    src = JpegCache.from_folder(jpeg_folder, progress=False).save(tmp_path / "src.gpucache")
    folder = tmp_path / "out"
    folder.mkdir()
    target = folder / "a.gpucache"
    target.write_bytes(b"old contents")
    size = src.stat().st_size
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            _SAVE_IN_CHILD,
            str(src),
            str(target),
            str(size // 2),
            "die" if how == "killed" else "fail",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert target.read_bytes() == b"old contents"
    temps = [p for p in folder.iterdir() if p != target]
    if how == "killed":
        assert child.returncode == -signal.SIGXFSZ, child.stderr
        assert len(temps) == 1 and 0 < temps[0].stat().st_size <= size // 2  # written partly
        JpegCache.open(src).save(target)  # the next save removes the dead writer's file
        assert sorted(folder.iterdir()) == [target]
        assert JpegCache.open(target)[0].tobytes() == JpegCache.open(src)[0].tobytes()
    else:
        assert child.returncode == 3 and child.stderr.strip() == str(errno.EFBIG)
        assert temps == []


def test_cli_build_info_verify(jpeg_folder, tmp_path, capsys):
    from gpucache.cli import main

    out = tmp_path / "cli.gpucache"
    assert main(["build", str(jpeg_folder), "-o", str(out)]) == 0
    assert main(["info", str(out)]) == 0
    assert main(["verify", str(out)]) == 0
    text = capsys.readouterr().out
    assert "24 files: 24 kept" in text and "24 of 24 samples decode" in text
    data = bytearray(out.read_bytes())
    data[-10] ^= 0xFF  # flip bits inside the image data: only the data checksum sees it
    out.write_bytes(bytes(data))
    assert main(["verify", str(out)]) == 1
    assert "sample 23 (" in capsys.readouterr().err  # the last sample: its checksum
    assert main(["info", str(tmp_path / "nope.gpucache")]) == 2


def _digests(cache) -> list[str]:
    import hashlib

    return [hashlib.sha256(cache[i]).hexdigest() for i in range(len(cache))]


def test_bytes_inside_a_spawned_worker_equal_the_files(jpeg_folder, tmp_path):
    """A store opened from its file and one moved to shared memory, each pickled into the same
    spawned worker (one interpreter for both)."""
    import hashlib
    import multiprocessing as mp

    cache = JpegCache.from_folder(jpeg_folder, progress=False)
    stores = {
        "file": JpegCache.open(cache.save(tmp_path / "w.gpucache")),
        "shared memory": cache.share(),
    }
    files = [hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in cache.paths]
    with mp.get_context("spawn").Pool(1) as pool:
        for backing, store in stores.items():
            assert pool.apply(_digests, (store,)) == files, backing
    cache.close()
