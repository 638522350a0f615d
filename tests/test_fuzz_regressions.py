"""Inputs that once crashed or misled the compiled decoder (gpucache/_jpeg_regions.c).

Each runs in a subprocess, so a crash (double free, out-of-bounds read) shows as a failed test with
the signal, not a dead pytest. The inputs are real JPEGs made here (or kept under tests/data/).
"""

import importlib.util
import io
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from gpucache.decode import _roi, _roi_rst
from gpucache.testing import natural_image

needs_c = pytest.mark.skipif(not _roi._c_ok(), reason="compiled region decoder not built")


def corrupt_luma_dc(data: bytes) -> bytes:
    """``data`` with every luma DC Huffman symbol set to category 11: headers stay valid, the
    scan decodes (with warnings) to DC values the baseline encoder cannot code again."""
    b, pos = bytearray(data), 2
    while pos + 4 <= len(b) and b[pos + 1] != 0xDA:
        length = (b[pos + 2] << 8) | b[pos + 3]
        if b[pos + 1] == 0xC4:  # DHT: class/id, 16 counts, symbols; maybe several tables
            q = pos + 4
            while q < pos + 2 + length:
                n = sum(b[q + 1 : q + 17])
                if b[q] == 0x00:
                    b[q + 17 : q + 17 + n] = bytes([11]) * n
                q += 17 + n
        pos += 2 + length
    return bytes(b)


def big_metadata_jpeg(seed: int = 3) -> bytes:
    """A 160 x 120 JPEG with 9 KB of EXIF (real photos carry EXIF, ICC and XMP of this size)."""
    buf = io.BytesIO()
    Image.fromarray(natural_image(160, 120, seed=seed)).save(
        buf, "JPEG", quality=90, exif=b"Exif\x00\x00" + bytes(9000)
    )
    return buf.getvalue()


def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


BUILD = """
    import sys
    from pathlib import Path
    from gpucache import JpegCache
    from gpucache.decode import _roi_rst
    try:
        _roi_rst.transcode(Path(sys.argv[1]).read_bytes())
        raise SystemExit("transcoded a corrupt scan")
    except ValueError as err:
        assert "DCT coefficient out of range" in str(err), err
    store = JpegCache.from_files(sys.argv[1:], progress=False, restart_markers=True)
    print(len(store), *_roi_rst.intervals(store).tolist())
"""


@needs_c
def test_transcode_error_after_the_output_grew_is_a_bad_input_not_a_crash(tmp_path):
    """libjpeg fails in the transcoder after > 4 KiB of output (the metadata) was written."""
    bad, good = tmp_path / "bad.jpg", tmp_path / "good.jpg"
    bad.write_bytes(corrupt_luma_dc(big_metadata_jpeg()))
    good.write_bytes(big_metadata_jpeg(seed=4))
    r = _run(BUILD, str(bad), str(good))
    assert r.returncode == 0, f"build died (signal {-r.returncode}): {r.stderr[-2000:]}"
    n, k_bad, k_good = map(int, r.stdout.split())
    assert (n, k_bad) == (2, 0) and k_good > 0  # the bad one is kept as it was, not transcoded


HUGE = """
    import sys
    import numpy as np
    from gpucache.decode import _roi, _roi_rst
    data = np.fromfile(sys.argv[1], dtype=np.uint8)
    k = int(sys.argv[2])
    big = 2**31 - 5
    for box in [(big, 0, 10, 8), (0, big, 8, 10), (big, big, 8, 8), (-1, 0, 4, 4), (0, 0, 0, 4)]:
        for name, call in [
            ("segments", lambda b: _roi_rst.decode_crop(data, k, b, _roi.Oriented(120, 160),
                                                       region=_roi._c_region)),
            ("region", lambda b: _roi._c_region(data, *b, height=120, width=160))]:
            try:
                call(box)
                raise SystemExit(f"{name} {box}: no error")
            except ValueError as err:
                assert "outside" in str(err), (name, box, err)
    print("ok")
"""


@needs_c
def test_boxes_near_int_max_are_refused_not_read_out_of_bounds(tmp_path):
    data, k = _roi_rst.transcode(big_metadata_jpeg())
    (tmp_path / "r.jpg").write_bytes(data)
    r = _run(HUGE, str(tmp_path / "r.jpg"), str(k))
    assert r.returncode == 0 and r.stdout.strip() == "ok", (
        f"rc {r.returncode}: {r.stdout[-500:]} {r.stderr[-2000:]}"
    )


@needs_c
def test_crops_of_a_progressive_jpeg_with_an_incomplete_scan_script_equal_the_whole():
    """A valid progressive JPEG (found by fuzzing) whose scans never refine the DC or the last
    luma AC bits: libjpeg's block smoothing, which looks at neighbouring blocks, made its crops
    differ from the crop of the whole image by up to 6 levels at every scale. It is off, so each
    crop equals the same part of the whole decode, at 1, 1/2, 1/4 and 1/8."""
    data = (Path(__file__).parent / "data" / "progressive_incomplete.jpg").read_bytes()
    rng = np.random.default_rng(0)
    for d in (1, 2, 4, 8):
        h, w = -(-61 // d), -(-101 // d)
        whole = _roi._c_region(data, 0, 0, h, w, height=h, width=w, denom=d)
        for _ in range(60):
            bh, bw = int(rng.integers(1, h + 1)), int(rng.integers(1, w + 1))
            t, l = int(rng.integers(0, h - bh + 1)), int(rng.integers(0, w - bw + 1))
            got = _roi._c_region(data, t, l, bh, bw, height=h, width=w, denom=d)
            assert torch.equal(got, whole[:, t : t + bh, l : l + bw]), (d, t, l, bh, bw)


LOOP = Path(__file__).resolve().parents[1] / "benchmarks" / "fuzz" / "loop.py"


def _two_gib_of_address_space() -> None:  # an input that asks for 12 GB fails, not the machine
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


@needs_c
def test_fuzz_harness_holds_inputs_to_the_library_s_limits(tmp_path):
    """The fuzz loop once passed a 1.7 KB JPEG claiming 35830 x 58024 to the transcoder, which
    asked for 12 GB and was killed for memory (no sanitizer report). The library refuses such
    bytes (a JPEG with more than MAX_SCANS scans, or whose scans cost more decoding work than
    the budget, too) before any decoder sees them; the loop now does too, and still runs a good
    input through every target. Replayed with the installed (unsanitized) library under a 2 GiB
    address-space limit."""
    from gpucache.ingest._sniff import MAX_SCANS
    from gpucache.testing import make_jpeg_bytes
    from tests.support.hostile import extra_scans, flat_progressive, patch_sof

    bomb = patch_sof(make_jpeg_bytes(16, 16, seed=2, quality=50), height=35830, width=58024)
    scans = extra_scans(make_jpeg_bytes(48, 32, seed=1, progressive=True), MAX_SCANS)
    dc_by_bits = [((0, 1, 2), 0, 0, 0, 13)] + [
        ((0, 1, 2), 0, 0, a, a - 1) for a in range(13, 0, -1)
    ]
    work = flat_progressive(9459, 9459, dc_by_bits, arithmetic=True)  # 14 valid scans, 1.5 KB
    files = []
    inputs = [("bomb", bomb), ("scans", scans), ("work", work), ("good", big_metadata_jpeg())]
    for name, data in inputs:
        files.append(tmp_path / f"{name}.jpg")
        files[-1].write_bytes(data)
    lib = importlib.util.find_spec("gpucache._jpeg_regions").origin
    r = subprocess.run(
        [sys.executable, str(LOOP), lib, "--replay", *map(str, files)],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_two_gib_of_address_space,
    )
    assert r.returncode == 0, f"rc {r.returncode}: {r.stderr[-2000:]}"
    out = json.loads(r.stdout.splitlines()[-1])
    assert (out["iterations"], out["refused"]) == (4, 3), out
    assert out["calls"] >= 8 and out["errors"] == 0, out  # the good one: every target, no error


RESTART = """
    import numpy as np
    from gpucache import BuildError, JpegCache
    from gpucache.ingest._build import BytesSource, build
    from gpucache.ingest._inputs import Samples
    from gpucache.store._format import Columns
    from gpucache.ingest._options import BuildOptions
    from gpucache.ingest._build import restart_store
    from gpucache.testing import make_jpeg_bytes
    from tests.support.hostile import patch_sof

    import resource  # 2 GiB of address space beyond what is mapped now: 12 GB fails fast
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmSize"))
    resource.setrlimit(resource.RLIMIT_AS, ((kib << 10) + (2 << 30),) * 2)
    bomb = patch_sof(make_jpeg_bytes(16, 16, seed=2, quality=50), height=35830, width=58024)
    loose = build(JpegCache, [BytesSource("bomb.jpg", bomb)], Samples(np.zeros(1, np.int64), ["a"]),
                  BuildOptions(on_error="raise", num_threads=1, progress=False, max_pixels=None))
    lying = JpegCache(Columns(data=loose._data, offsets=loose._offsets, labels=loose.labels,
                      samples=loose.samples, classes=["a"], paths=loose._paths))  # default budget
    try:
        restart_store(lying, num_threads=1)
        raise SystemExit("transcoded a sample over the store's pixel budget")
    except BuildError as err:
        assert "bomb.jpg" in str(err) and "max_pixels=89,478,485" in str(err), err
    print("ok")
"""


@needs_c
def test_restart_store_holds_samples_to_the_store_s_pixel_budget():
    """``restart_store`` rebuilt a store with no pixel budget: a sample claiming 35830 x 58024
    (a store opened with a lower max_pixels, or a crafted one) went to the transcoder, which
    allocates the whole image's coefficients (12 GB). It is refused with its path and reason.
    Run with an address-space limit, so the old behaviour fails fast instead of swapping."""
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(RESTART)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", (
        f"rc {r.returncode}: {r.stdout[-500:]} {r.stderr[-2000:]}"
    )
