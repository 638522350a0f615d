"""Sniffing agrees with the decoders, reads headers only, and stays linear on hostile bytes;
the build reads paths and source objects into one buffer."""

import io
import os
import tarfile
import threading
import time

import numpy as np
import pytest
import torch
from PIL import Image

from gpucache import JpegCache
from gpucache.decode._jpeg import decode_jpeg
from gpucache.decode._sample import decode_pil, decode_sample
from gpucache.ingest._build import BytesSource, FileObjSource, FileRangeSource, build
from gpucache.ingest._inputs import Samples
from gpucache.ingest._options import BuildOptions
from gpucache.ingest._sniff import MAX_SCANS, Kind, SniffError, sniff
from gpucache.store._format import Columns
from gpucache.store._limits import check_pixels
from gpucache.testing import make_jpeg_bytes
from tests.support.hostile import (
    before_marker,
    extra_scans,
    flat_progressive,
    hostile_image_bytes,
    make_hostile_folder,
    one_coefficient_script,
)

CASES = hostile_image_bytes(fill_bytes=4096)


def _decode(data: bytes) -> torch.Tensor:
    if data[:2] == b"\xff\xd8":
        return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    return decode_pil(np.frombuffer(data, dtype=np.uint8))


@pytest.mark.parametrize("name", [k for k, (_, o) in CASES.items() if o == "kept"])
def test_sniffed_size_is_the_decoded_size(name):
    """Junk between markers, a short APP14, FF fill and every EXIF layout (orientation as LONG,
    two Exif segments, XMP before Exif, Exif after SOF, PNG eXIf after IDAT): the stored size,
    EXIF orientation applied, is what libjpeg-turbo (TorchCodec) or PIL decodes."""
    data = CASES[name][0]
    info = sniff(memoryview(data))
    assert tuple(_decode(data).shape[1:]) == (info.height, info.width), name


def test_png_is_sniffed_without_decoding():
    """A PNG whose image data is garbage still sniffs (only chunk headers are read) and a 144 Mpx
    PNG sniffs without allocating its pixels; its eXIf after IDAT is still found."""
    info = sniff(memoryview(CASES["png_bad_idat.png"][0]))
    assert (info.height, info.width) == (30, 40)
    with pytest.raises(Exception):  # noqa: B017 - PIL's error depends on the damage
        _decode(CASES["png_bad_idat.png"][0])
    info = sniff(memoryview(CASES["bomb_12000.png"][0]))
    assert (info.height, info.width) == (12000, 12000)
    assert sniff(memoryview(CASES["png_exif_after_idat.png"][0])).orientation == 6


def test_ff_fill_is_scanned_in_linear_time():
    """20 MiB of FF fill between two markers: about 2.5 s with a byte-by-byte scan, ~10 ms now.
    The bound is 20x the measured time, so only a per-byte Python loop can fail it."""
    data = memoryview(
        before_marker(make_jpeg_bytes(48, 32, seed=1), b"\xff\xdb", b"\xff" * (20 << 20))
    )
    t = time.process_time()
    info = sniff(data)
    assert time.process_time() - t < 0.25
    assert (info.height, info.width) == (32, 48)


def test_still_refused():
    """Tolerance stops where libjpeg stops: a second SOI, a bad segment length, no SOF."""
    good = make_jpeg_bytes(16, 16, seed=3)
    no_sof = b"\xff\xd8\xff\xfe\x00\x04hi" + b"\x00" * 64 + b"\xff\xd9"  # a comment, no SOF
    for bad, why in [
        (good[:2] + good, "second start-of-image"),
        (good[:4] + b"\x00\x01" + good[6:], "has length 1"),
        (no_sof, "no frame header"),
    ]:
        with pytest.raises(SniffError, match=why):
            sniff(memoryview(bad))


def test_hostile_folder_builds_and_decodes_as_promised(tmp_path):
    from gpucache.decode._sample import decode_sample

    outcomes = make_hostile_folder(tmp_path, fill_bytes=4096)
    cache = JpegCache.from_folder(tmp_path, progress=False)
    skipped = {s.path: s.reason for s in cache.report.skipped}
    assert sorted(skipped) == sorted(p for p, o in outcomes.items() if o == "skip")
    assert "max_pixels=89,478,485" in skipped[str(tmp_path / "x" / "bomb_65500.jpg")]
    assert "65500x65500" in skipped[str(tmp_path / "x" / "bomb_65500.jpg")]
    assert "max_pixels" in skipped[str(tmp_path / "x" / "bomb_30000.jpg")]
    assert "max_pixels" in skipped[str(tmp_path / "x" / "bomb_12000.png")]
    assert "decompression" in skipped[str(tmp_path / "x" / "bomb_65500.png")]
    assert skipped[str(tmp_path / "x" / "fifo.jpg")].startswith("not a regular file (a FIFO)")
    for i, path in enumerate(cache.paths):
        if outcomes[path] == "decode-fails":
            with pytest.raises(Exception):  # noqa: B017 - each decoder fails its own way
                decode_sample(cache, i)
        else:  # kept at build means decoded at the stored size, never dropped at decode
            img = decode_sample(cache, i)
            assert tuple(img.shape[1:]) == tuple(cache.samples[["height", "width"]][i]), path


def test_fifo_does_not_hang_the_build(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.jpg").write_bytes(make_jpeg_bytes(16, 16, seed=1))
    fifo = tmp_path / "c" / "pipe.jpg"
    os.mkfifo(fifo)
    out = {}
    t = threading.Thread(
        target=lambda: out.update(c=JpegCache.from_folder(tmp_path, progress=False))
    )
    t.start()
    t.join(20)
    if t.is_alive():  # free the blocked reader so the test process can exit, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join()
        pytest.fail("from_folder blocked opening a FIFO")
    assert len(out["c"]) == 1 and out["c"].report.skipped[0].path == str(fifo)


def test_max_pixels_at_build(tmp_path):
    bomb = CASES["bomb_30000.jpg"][0]
    (tmp_path / "bomb.jpg").write_bytes(bomb)
    (tmp_path / "ok.jpg").write_bytes(make_jpeg_bytes(16, 16, seed=1))
    args = (
        [str(tmp_path / "ok.jpg"), str(tmp_path / "bomb.jpg")],
        Samples(np.zeros(2, np.int64), ["a"]),
    )
    kw = dict(on_error="skip", num_threads=1, progress=False)
    assert len(build(JpegCache, *args, BuildOptions(**kw))) == 1
    assert len(build(JpegCache, *args, BuildOptions(**kw, max_pixels=30000 * 30000))) == 2
    cache = build(JpegCache, *args, BuildOptions(**kw, max_pixels=None))
    assert len(cache) == 2
    with pytest.raises(ValueError, match="30000x30000"):  # the decode-side guard
        check_pixels(cache, 1)
    with pytest.raises(Exception, match="max_pixels=1,000"):
        opts = BuildOptions(on_error="raise", num_threads=1, progress=False, max_pixels=1000)
        build(JpegCache, *args, opts)


def test_decode_guard_reads_the_bytes_not_only_the_record():
    """A record that understates the size (a tampered or stale store) cannot let a bomb through."""
    bomb = CASES["bomb_65500.jpg"][0]
    cache = build(
        JpegCache,
        [BytesSource("bomb", bomb)],
        Samples(np.zeros(1, np.int64), ["a"]),
        BuildOptions(on_error="skip", num_threads=1, progress=False, max_pixels=None),
    )
    samples = cache.samples.copy()
    samples["height"], samples["width"] = 16, 16
    lying = JpegCache(
        Columns(
            data=cache._data,
            offsets=cache._offsets,
            labels=cache.labels,
            samples=samples,
            classes=["a"],
            paths=cache._paths,
        )
    )
    with pytest.raises(ValueError, match="65500x65500"):
        check_pixels(lying, 0)


def test_progressive_jpeg_with_thousands_of_scans_is_refused_at_build(tmp_path):
    """A valid progressive JPEG with 5,000 more scans (each an end-of-band run: libjpeg decodes it
    to the pixels of the 10-scan original, without a warning) and one with 101 distinct scans
    are left out with their reasons; one with 100 distinct scans and the 10-scan original are
    kept and decode as before."""
    plain = make_jpeg_bytes(48, 32, seed=1, progressive=True)
    at_limit = flat_progressive(32, 48, one_coefficient_script(MAX_SCANS))
    over = flat_progressive(32, 48, one_coefficient_script(MAX_SCANS + 1))
    hostile = extra_scans(plain, 5000)
    assert torch.equal(_decode(hostile), _decode(plain))  # valid: same pixels
    assert _decode(over).shape == (3, 32, 48)  # valid too
    names = ["plain.jpg", "at_limit.jpg", "hostile.jpg", "baseline.jpg", "over.jpg"]
    datas = [plain, at_limit, hostile, make_jpeg_bytes(40, 30, seed=2), over]
    for name, data in zip(names, datas):
        (tmp_path / name).write_bytes(data)
    paths = [str(tmp_path / n) for n in names]
    cache = JpegCache.from_files(paths, progress=False)
    skipped = cache.report.skipped
    assert [(s.index, s.path) for s in skipped] == [(2, paths[2]), (4, paths[4])]
    assert "scan 11 codes again coefficients 1-63 of component 1" in skipped[0].reason
    assert f"more than {MAX_SCANS} scans" in skipped[1].reason
    assert all("jpegtran" in s.reason for s in skipped)  # the fix
    assert len(cache) + len(skipped) == len(paths)
    assert list(cache.paths) == [paths[0], paths[1], paths[3]]
    assert cache.samples["kind"][:2].tolist() == [Kind.JPEG_PROGRESSIVE] * 2
    assert torch.equal(decode_sample(cache, 0), _decode(plain))
    assert torch.equal(decode_sample(cache, 1), _decode(at_limit))


def test_scans_are_counted_without_decoding():
    """20,000 scans over a 1024 x 1024 image: about 2 s of libjpeg decode (0.1 ms a scan,
    benchmarks/scan_limit.py); refused at its first repeated scan, the 11th, in about 1 ms of
    CPU, skipping the scan data in C."""
    buf = io.BytesIO()
    Image.new("RGB", (1024, 1024), (90, 140, 200)).save(buf, "JPEG", progressive=True)
    hostile = memoryview(extra_scans(buf.getvalue(), 20_000))
    t = time.process_time()
    with pytest.raises(SniffError, match="scan 11 "):
        sniff(hostile)
    assert time.process_time() - t < 0.1


def test_decode_guard_counts_the_scans_of_the_stored_bytes():
    """A store whose bytes were not counted (built before the limit, or crafted) refuses the
    sample before any decoder sees it, with the same reason."""
    plain = make_jpeg_bytes(48, 32, seed=1, progressive=True)
    cache = build(
        JpegCache,
        [BytesSource("p", plain)],
        Samples(np.zeros(1, np.int64), ["a"]),
        BuildOptions(on_error="raise", num_threads=1, progress=False),
    )
    hostile = np.frombuffer(extra_scans(plain, 5000), np.uint8)
    uncounted = JpegCache(
        Columns(
            data=hostile,
            offsets=np.array([0, len(hostile)]),
            labels=cache.labels,
            samples=cache.samples,
            classes=["a"],
            paths=cache._paths,
        )
    )
    check_pixels(cache, 0)
    for guarded in (check_pixels, decode_sample):
        with pytest.raises(ValueError, match="scan 11 "):
            guarded(uncounted, 0)


def test_sources_go_straight_into_the_buffer(tmp_path):
    a, b = make_jpeg_bytes(40, 30, seed=1), make_jpeg_bytes(50, 20, seed=2)
    (tmp_path / "a.jpg").write_bytes(a)
    with tarfile.open(tmp_path / "s.tar", "w") as tar:
        member = tarfile.TarInfo("x/b.jpg")
        member.size = len(b)
        tar.addfile(member, io.BytesIO(b))
    with tarfile.open(tmp_path / "s.tar") as tar:
        offset = tar.getmember("x/b.jpg").offset_data

    class Failing:
        name, nbytes = "flaky", 10

        def readinto(self, slot):
            raise OSError(5, "I/O error")

    inputs = [
        tmp_path / "a.jpg",
        BytesSource("mem", memoryview(a)),
        Failing(),
        FileObjSource("fileobj", io.BytesIO(b)),
        FileRangeSource("s.tar/x/b.jpg", tmp_path / "s.tar", offset, len(b)),
        BytesSource("junk", b"not an image"),
    ]
    cache = build(
        JpegCache,
        inputs,
        Samples(np.arange(6), list("abcdef")),
        BuildOptions(on_error="skip", num_threads=3, progress=False),
    )
    assert list(cache.paths) == [str(tmp_path / "a.jpg"), "mem", "fileobj", "s.tar/x/b.jpg"]
    assert [bytes(cache[i]) for i in range(4)] == [a, a, b, b]
    assert cache.labels.tolist() == [0, 1, 3, 4]
    assert cache.nbytes == 2 * len(a) + 2 * len(b)  # the failing and junk inputs squeezed out
    assert [(s.index, s.path) for s in cache.report.skipped] == [(2, "flaky"), (5, "junk")]
    assert "I/O error" in cache.report.skipped[0].reason
    with pytest.raises(TypeError, match="BytesSource"):
        build(
            JpegCache,
            [a],
            Samples(np.zeros(1, np.int64), ["a"]),
            BuildOptions(on_error="skip", num_threads=1, progress=False),
        )
