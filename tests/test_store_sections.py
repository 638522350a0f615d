"""Optional sections of a store file: type, shape, values and companions are checked at open.

Each bad store is a real saved store with one section changed (written by the store writer, which
does not check what it is given, or edited in the file's bytes with the checksums recomputed), so
what stops it is the validation behind the checksums. A store whose sample record disagrees with
its image bytes opens (open reads no image data) and fails at decode, per sample, by name.
"""

from __future__ import annotations

import dataclasses
import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from gpucache import CacheFormatError, GpuCachedLoader, JpegCache, SampleError, with_targets
from gpucache.cli import main
from gpucache.decode._core import decode_batch
from gpucache.decode._options import DecodeOptions
from gpucache.decode._sample import decode_sample
from gpucache.store import _format, _save
from gpucache.testing import make_jpeg_bytes

N = 6


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> JpegCache:
    root = tmp_path_factory.mktemp("sections")
    files = []
    for i in range(N):
        p = root / f"{i}.jpg"
        p.write_bytes(make_jpeg_bytes(40 + 8 * i, 32 + 4 * i, seed=i))
        files.append(str(p))
    png = io.BytesIO()
    Image.new("RGB", (30, 20), (200, 10, 10)).save(png, "PNG")
    (root / "red.png").write_bytes(png.getvalue())
    files[-1] = str(root / "red.png")
    return JpegCache.from_files(files, [0, 1] * (N // 2), classes=["a", "b"], progress=False)


def _craft(tmp_path, cache: JpegCache, **changes):
    """``cache`` saved with some arrays (``extra``, ``samples``) replaced, unchecked."""
    path = tmp_path / "crafted.gpucache"
    _save.save_atomic(path, dataclasses.replace(cache._stored(), **changes))
    return path


def _ragged_offsets() -> np.ndarray:
    return np.arange(N + 1, dtype="<i8") * 2  # two rows a sample


def _with(cache, **sections) -> dict:
    """The sections ``cache`` saves (its build report's among them), some replaced or (None)
    removed."""
    out = {**cache._stored().extra, **sections}
    return {k: v for k, v in out.items() if v is not None}


def _negative(offsets: np.ndarray) -> np.ndarray:
    out = offsets.copy()
    out[3] = -4  # sample 2 would own rows 4..-4 of others, sample 3 rows -4..6
    return out


def _rst(values) -> dict:
    return {"rst": np.asarray(values, dtype="<i4")}


def _resized(rows) -> dict:
    return {"resized": np.asarray(rows, dtype="<u4"), "resized.args": np.array([64, 90], "<i8")}


RAGGED = {"targets_ragged": np.zeros((2 * N, 5), "<f4")}
CASES = {  # case: (sections added to the store's own or removed, what the error says)
    "targets rows": (
        {"targets": np.zeros((2, 3), "<f4")},
        r"section 'targets' \(float targets, one row per sample\) holds <f4 \(2, 3\),"
        rf" not <f4 \({N}, any\) for {N} samples",
    ),
    "targets dtype": ({"targets": np.zeros((N, 3), "<f8")}, r"'targets' .* holds <f8"),
    "targets 1-D": ({"targets": np.zeros(N, "<f4")}, r"'targets' .* holds <f4 \(6,\)"),
    "ragged offsets negative": (
        {**RAGGED, "targets_ragged.offsets": _negative(_ragged_offsets())},
        "'targets_ragged.offsets' must start at 0, never decrease and "
        "end at the 12 rows of 'targets_ragged'.*sample 2 goes from row 4"
        " to -4",
    ),
    "ragged offsets short": (
        {**RAGGED, "targets_ragged.offsets": _ragged_offsets() - 1},
        "it goes from -1 to 11",
    ),
    "ragged offsets rows": (
        {**RAGGED, "targets_ragged.offsets": np.zeros(N, "<i8")},
        r"'targets_ragged.offsets' .* holds <i8 \(6,\), not <i8 \(7,\)",
    ),
    "ragged without offsets": (
        RAGGED,
        "'targets_ragged' is present without 'targets_ragged.offsets'",
    ),
    "resized.args alone": (
        {"resized.args": np.array([64, 90], "<i8")},
        "'resized.args' is present without 'resized'",
    ),
    "resized rows": (_resized(np.zeros((N - 1, 3))), r"'resized' .* holds <u4 \(5, 3\)"),
    "resized half a row": (
        _resized([[0, 0, 0]] * 4 + [[40, 0, 900], [0, 0, 0]]),
        "'resized' breaks its rule .* first sample 4: \\[40, 0, 900\\]",
    ),
    "resized.args quality": (
        {**_resized(np.zeros((N, 3))), "resized.args": np.array([64, 0], "<i8")},
        "'resized.args' holds \\[64, 0\\]",
    ),
    "rst negative": (_rst([0, 0, -8, 0, 0, 0]), "'rst' breaks its rule .* first sample 2: -8"),
    "rst too large": (_rst([0, 1 << 16, 0, 0, 0, 0]), "'rst' breaks its rule"),
    "rst dtype": ({"rst": np.zeros(N, "<i8")}, "'rst' .* holds <i8"),
    "report part": ({"report.totals": None}, "'report.kinds' is present without 'report.totals'"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_bad_optional_section_is_refused_at_open(cache, tmp_path, capsys, case):
    sections, match = CASES[case]
    path = _craft(tmp_path, cache, extra=_with(cache, **sections))
    with pytest.raises(CacheFormatError, match=match) as err:
        JpegCache.open(path)
    assert str(err.value).startswith(f"{path}: ") and "rebuild it" in str(err.value)
    capsys.readouterr()
    for command in ("info", "verify"):  # a clear message and status 2, never a KeyError
        assert main([command, str(path)]) == 2
        assert "rebuild it" in capsys.readouterr().err


def test_report_skipping_an_index_beyond_the_inputs_is_refused(cache, tmp_path):
    extra = _with(cache)
    extra["report.totals"] = np.array([N + 1, N], "<i8")
    extra["report.skipped"] = np.array([N + 5], "<i8")
    extra["report.offsets"] = np.array([0, 1, 2], "<u8")
    extra["report.text"] = np.frombuffer(b"xy", np.uint8)
    path = _craft(tmp_path, cache, extra=extra)
    with pytest.raises(
        CacheFormatError,
        match=r"report.*skipped input indices are not ascending "
        r"within 0..6",
    ):
        JpegCache.open(path)


def _patch_section(
    raw: bytes, name: str, *, data: bytes | None = None, dtype: bytes | None = None
) -> bytes:
    """``raw`` with optional section ``name``'s bytes or element type replaced, every checksum
    recomputed."""
    b = bytearray(raw)
    f = list(_format.HEAD_V2.unpack_from(b))
    directory, count = f[22], f[23]
    for k in range(count):
        at = directory + k * _format.ENTRY.size
        entry = list(_format.ENTRY.unpack_from(b, at))
        if entry[0].rstrip(b"\0").decode() == name:
            if data is not None:
                assert len(data) == entry[3]
                b[entry[2] : entry[2] + entry[3]] = data
                entry[6] = zlib.crc32(data)
            entry[1] = entry[1] if dtype is None else dtype
            _format.ENTRY.pack_into(b, at, *entry)
    f[24] = zlib.crc32(bytes(b[directory : directory + count * _format.ENTRY.size]))
    _format.HEAD_V2.pack_into(b, 0, *f)
    _format.CRC.pack_into(b, _format.HEAD_V2.size, zlib.crc32(bytes(b[: _format.HEAD_V2.size])))
    return bytes(b)


def test_a_negative_ragged_offset_edited_into_the_file_is_refused(cache, tmp_path):
    """The bytes of a valid store with ragged targets, one offset made negative, CRCs fixed: it
    gave one sample 10 rows of the others' boxes without an error."""
    boxes = [np.full((2, 5), i, np.float32) for i in range(N)]
    good = with_targets(cache, ragged=boxes).save(tmp_path / "good.gpucache")
    bad = tmp_path / "bad.gpucache"
    bad.write_bytes(
        _patch_section(
            good.read_bytes(), "targets_ragged.offsets", data=_negative(_ragged_offsets()).tobytes()
        )
    )
    with pytest.raises(CacheFormatError, match="sample 2 .*4 .*-4"):
        JpegCache.open(bad)
    assert main(["verify", str(bad)]) == 2


def test_checksums_of_another_type_edited_into_the_file_are_refused(cache, tmp_path):
    good = cache.save(tmp_path / "good.gpucache")
    bad = tmp_path / "bad.gpucache"
    bad.write_bytes(_patch_section(good.read_bytes(), "sample.crc32", dtype=b"<i4"))
    with pytest.raises(
        CacheFormatError,
        match=r"'sample.crc32' \(CRC-32 per sample\) holds "
        r"<i4 \(6,\), not <u4 \(6,\)",
    ):
        JpegCache.open(bad)


def test_an_in_memory_store_with_a_bad_section_is_refused_before_it_is_saved(cache):
    with pytest.raises(ValueError, match=r"'targets' .* holds <f4 \(2, 3\).*with_targets"):
        cache._replace(extra={"targets": np.zeros((2, 3), np.float32)})
    with pytest.raises(ValueError, match="'resized.args'.*without 'resized'"):
        cache._replace(extra={"resized.args": np.array([64, 90])})
    ok = with_targets(cache, targets=np.ones(N), ragged=[np.zeros((i, 4)) for i in range(N)])
    assert ok.extra["targets"].shape == (N, 1)


def test_the_section_rules_use_the_names_their_owners_write(cache):
    from gpucache.decode import _roi_rst
    from gpucache.ingest import _resize
    from gpucache.shares import _record
    from gpucache.store import _masks, _report, _sections, _targets

    names = {
        *_masks.SECTIONS,
        *_record.SECTIONS,
        _resize.SECTION,
        _resize.ARGS,
        _roi_rst.SECTION,
        _targets.DENSE,
        _targets.RAGGED,
        _targets.OFFSETS,
        _format.SAMPLE_CRC,
        *_report.report_sections(cache.report),
    }
    assert names == set(_sections.SPECS)
    assert _sections.problem(_report.report_sections(cache.report), N) is None


def _half_record(cache) -> np.ndarray:
    s = cache.samples.copy()
    s["height"] //= 2
    s["width"] //= 2
    return s


def _whole(samples: np.ndarray) -> np.ndarray:
    """Plans that keep the whole image at its recorded size (t, l, h, w, h, w, 0, 0, h, w, 0)."""
    h, w = samples["height"].astype(np.int64), samples["width"].astype(np.int64)
    z = np.zeros_like(h)
    return np.stack([z, z, h, w, h, w, z, z, h, w, z], axis=1)


def test_a_sample_record_smaller_than_its_image_is_a_clear_error_at_decode(cache, tmp_path, capsys):
    """A record at half the real size opens (its checksums are right) and used to decode the
    top-left quarter of each JPEG as if it were the whole image, without an error."""
    half = _half_record(cache)
    path = _craft(tmp_path, cache, samples=half)
    opened = JpegCache.open(path)
    d = decode_batch(opened, np.arange(N), _whole(half), stack=False)
    assert len(d.indices) == 0 and [i for i, _ in d.failed] == list(range(N))
    h, w = int(cache.samples["height"][0]), int(cache.samples["width"][0])
    assert (
        f"sample 0 ({cache.paths[0]}) could not be decoded: CacheFormatError: {path}: the "
        f"store's record of sample 0 says {w // 2}x{h // 2} but its image header says "
        f"{w}x{h} (as decoded): the store is corrupt or was altered after it was built; run "
        "`gpucache verify` on it and rebuild it"
    ) in d.failed[0][1]
    assert "says 15x10 but its image header says 30x20" in d.failed[N - 1][1]
    crop = _whole(half)
    crop[:, 2:4] //= 2  # a crop inside the recorded size: decoded from the real image before
    crop[:, 4:6] = crop[:, 8:10] = crop[:, 2:4]
    assert len(decode_batch(opened, np.arange(N), crop, stack=False).failed) == N
    with pytest.raises(SampleError, match="sample 1 .*record of sample 1 says"):
        decode_batch(
            opened, np.array([1]), _whole(half)[1:2], DecodeOptions(on_error="raise"), stack=False
        )
    with pytest.raises(CacheFormatError, match="record of sample 3"):
        decode_sample(opened, 3)
    loader = GpuCachedLoader(opened, batch_size=N, num_workers=0, device="cpu")
    with pytest.warns(RuntimeWarning, match=r"skipped sample \d .*the store is corrupt"):
        list(loader)
    assert loader.stats.skipped == N and loader.stats.samples == 0
    capsys.readouterr()
    assert main(["verify", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"sample 2 ({cache.paths[2]}): CacheFormatError" in err and "record of sample 2" in err


def test_an_orientation_out_of_range_is_refused_at_open(cache, tmp_path):
    s = cache.samples.copy()
    s["orientation"][4] = 9
    with pytest.raises(CacheFormatError, match=r"sample 4 has an invalid record .*orientation 9"):
        JpegCache.open(_craft(tmp_path, cache, samples=s))


def test_rotated_records_still_decode(cache, tmp_path):
    """The check compares the record with the header turned by the record's orientation."""
    data = bytearray(make_jpeg_bytes(48, 20, seed=9))
    exif = (
        b"Exif\0\0II*\0"
        + struct.pack("<IH", 8, 1)
        + struct.pack("<HHII", 0x0112, 3, 1, 6)
        + b"\0\0\0\0"
    )
    app1 = b"\xff\xe1" + struct.pack(">H", len(exif) + 2) + exif
    rotated = JpegCache.from_files([bytes(data[:2] + app1 + data[2:])], progress=False)
    assert rotated.samples[["orientation", "height", "width"]].tolist() == [(6, 48, 20)]
    assert tuple(decode_sample(rotated, 0).shape) == (3, 48, 20)
