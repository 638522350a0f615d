"""``gpucache verify``: corrupt samples found by index and path, on several threads."""

import zlib

import numpy as np
import pytest

from gpucache import JpegCache
from gpucache.cli import main
from gpucache.store._checksum import crc32, crc32_combine, crc32_of, sample_crcs


@pytest.fixture()
def saved(jpeg_folder, tmp_path):
    cache = JpegCache.from_folder(jpeg_folder, progress=False)
    return cache, cache.save(tmp_path / "v.gpucache")


def _flip(path, cache, i: int, at: float) -> None:
    """Flip one byte of sample ``i``'s entropy-coded data in the file (it may still decode)."""
    data_start = path.stat().st_size - cache.nbytes
    a, b = int(cache._offsets[i]), int(cache._offsets[i + 1])
    with open(path, "r+b") as f:
        f.seek(data_start + a + int((b - a) * at))
        byte = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([byte ^ 0x10]))


@pytest.mark.parametrize("threads", ["1", "3"])
def test_verify_names_the_corrupt_sample(saved, capsys, threads):
    cache, path = saved
    assert main(["verify", "-j", threads, str(path)]) == 0
    assert "checksums ok; 24 of 24 samples decode" in capsys.readouterr().out
    _flip(path, cache, 7, 0.6)  # inside the scan: the sample still decodes, to wrong pixels
    _flip(path, cache, 15, 0.6)
    assert main(["verify", "-j", threads, "--no-decode", str(path)]) == 1
    out = capsys.readouterr()
    assert "2 checksum problem(s)" in out.out
    lines = [ln for ln in out.err.splitlines() if "checksum mismatch" in ln]
    assert len(lines) == 2
    assert f"sample 7 ({cache.paths[7]}): checksum mismatch" in lines[0]
    assert f"sample 15 ({cache.paths[15]}): checksum mismatch" in lines[1]


def test_verify_reports_a_sample_that_does_not_decode(saved, capsys):
    cache, path = saved
    data_start = path.stat().st_size - cache.nbytes
    a = int(cache._offsets[4])
    with open(path, "r+b") as f:  # overwrite sample 4's SOI: no longer a JPEG at all
        f.seek(data_start + a)
        f.write(b"\0\0")
    assert main(["verify", "-j", "2", str(path)]) == 1
    out = capsys.readouterr()
    assert "1 checksum problem(s); 23 of 24 samples decode" in out.out
    lines = [ln for ln in out.err.splitlines() if f"sample 4 ({cache.paths[4]}): " in ln]
    assert len(lines) == 2 and "checksum mismatch" in lines[0]  # and its decode error


def test_parallel_checksums_equal_zlib():
    rng = np.random.default_rng(0)
    buf = rng.integers(0, 256, (1 << 20) * 5 + 1234, dtype=np.uint8)
    a, b = buf[:1000].tobytes(), buf[1000:5000].tobytes()
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    import gpucache.store._checksum as ck

    old = ck.CHUNK_BYTES
    ck.CHUNK_BYTES = 1 << 20  # several chunks and a short last one
    try:
        assert crc32(buf, threads=3) == zlib.crc32(buf) == crc32(buf, threads=1)
        assert crc32_of(buf[7:], 12345) == zlib.crc32(buf[7:], 12345)  # ISA-L's, if installed
    finally:
        ck.CHUNK_BYTES = old
    offsets = np.array([0, 10, 10, 70000, buf.size], dtype=np.int64)
    assert sample_crcs(buf, offsets, threads=2).tolist() == [
        zlib.crc32(buf[s:e]) for s, e in zip(offsets, offsets[1:])
    ]


def test_old_store_without_sample_checksums_still_verifies(saved, tmp_path, capsys):
    """A store without ``sample.crc32`` is checked by its whole data CRC."""
    cache, _ = saved
    from gpucache.store import _format

    path = tmp_path / "old.gpucache"
    with open(path, "wb") as f:
        _format.write(f, cache._columns())  # checksums=False: as stores were written before
    assert "sample.crc32" not in JpegCache.open(path)._file.extra
    assert main(["verify", "--no-decode", str(path)]) == 0
    _flip(path, cache, 3, 0.5)
    assert main(["verify", "--no-decode", str(path)]) == 1
    assert "data section: data checksum mismatch" in capsys.readouterr().err


def test_the_checks_of_a_store_built_in_memory(saved):
    """A store not yet saved has no stored checksum to compare with: the check says to save it;
    a store without masks has no mask problems."""
    from gpucache.cli._checks import check_checksums, check_masks

    cache, path = saved
    with pytest.raises(ValueError, match=r"save it.*JpegCache\.open"):
        check_checksums(cache, progress=False)
    opened = JpegCache.open(path)
    assert check_checksums(opened, progress=False) == []
    assert opened.masks is None and check_masks(opened, progress=False) == []
