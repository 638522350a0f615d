"""Mask PNGs that libpng's image-data reader fails on, and palettes it does not unpack: what the
fuzz harness over the input paths found (``benchmarks/fuzz/run.py --inputs``).

- torchvision's ``decode_png`` crashed the process (SIGSEGV) on a PNG whose image data fails
  its CRC, is not a zlib stream, has a row with an unknown filter type or ends early. The build
  refuses such a mask (PIL took one whose image data fails its CRC), and a store altered after
  its build that holds one gets a skipped sample with the reason, never a crash. These run in a
  subprocess, so a crash fails the test instead of ending pytest.
- a palette mask of 1, 2 or 4 bits came back as other bytes than its indices; its values are
  now PIL's indices, exactly.
"""

from __future__ import annotations

import io
import os
import struct
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from gpucache import GpuCachedLoader, JpegCache
from gpucache.store._png import stream_problem
from gpucache.testing import make_jpeg_bytes, make_mask_png

H, W = 24, 32
REPO = Path(__file__).resolve().parent.parent
SIG = b"\x89PNG\r\n\x1a\n"


def _chunk(kind: bytes, body: bytes, crc: int | None = None) -> bytes:
    c = zlib.crc32(kind + body) if crc is None else crc
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", c)


def _png(depth: int, colour: int, raw: bytes, palette: bytes = b"", idat_crc=None) -> bytes:
    head = struct.pack(">IIBBBBB", W, H, depth, colour, 0, 0, 0)
    plte = _chunk(b"PLTE", palette) if palette else b""
    data = _chunk(b"IDAT", zlib.compress(raw), idat_crc)
    return SIG + _chunk(b"IHDR", head) + plte + data + _chunk(b"IEND", b"")


def _rows(filter_type: int = 0, rows: int = H) -> bytes:
    return b"".join(bytes([filter_type]) + bytes(range(W)) for _ in range(rows))


DAMAGED = {  # name: (PNG, what the reason says)
    "image data fails its CRC": (_png(8, 0, _rows(), idat_crc=0), "fails its CRC-32"),
    "not a zlib stream": (
        SIG
        + _chunk(b"IHDR", struct.pack(">IIBBBBB", W, H, 8, 0, 0, 0, 0))
        + _chunk(b"IDAT", b"\x78\x9c" + bytes(40))
        + _chunk(b"IEND", b""),
        "not a zlib stream",
    ),
    "unknown filter type": (_png(8, 0, _rows(9)), "unknown filter type"),
    "image data ends early": (_png(8, 0, _rows(0, 5)), "ends before"),
    "a zlib bomb behind its size": (_png(8, 0, _rows() * 2000), "zlib bomb"),
}


#: the damaged PNGs PIL reads without a word (it checks no CRC of the image data, stops
#: inflating at the image's size, and took a stream that ends early without a word)
PIL_TAKES = ("image data fails its CRC", "image data ends early", "a zlib bomb behind its size")


@pytest.mark.parametrize("name", DAMAGED)
def test_a_damaged_mask_png_is_refused_at_build_with_the_reason(tmp_path, name):
    png, said = DAMAGED[name]
    assert said in (stream_problem(png) or "")
    images = [make_jpeg_bytes(W, H, seed=k) for k in range(3)]
    masks = [make_mask_png(np.full((H, W), 1, np.uint8)), png, make_mask_png(np.ones((H, W)))]
    cache = JpegCache.from_files(images, [0, 1, 2], masks=masks, progress=False)
    assert cache.labels.tolist() == [0, 2]
    assert cache.report is not None
    [skipped] = cache.report.skipped
    assert skipped.index == 1
    if name in PIL_TAKES:  # PIL read its pixels: the PNG's own check refuses it
        assert "the mask's PNG is damaged" in skipped.reason and said in skipped.reason
    else:
        assert "the mask is not an image PIL can read" in skipped.reason


_ALTERED = textwrap.dedent("""
    import sys, warnings
    import numpy as np
    from gpucache import GpuCachedLoader, JpegCache
    from gpucache.store import _format
    from gpucache.store._masks import DATA, OFFSETS
    from gpucache.testing import make_jpeg_bytes, make_mask_png
    sys.path.insert(0, sys.argv[1])
    from tests.test_damaged_masks import DAMAGED, H, W

    images = [make_jpeg_bytes(W, H, seed=k) for k in range(3)]
    masks = [make_mask_png(np.full((H, W), k + 1, np.uint8)) for k in range(3)]
    cache = JpegCache.from_files(images, [0, 1, 2], masks=masks, progress=False)
    for name, (png, said) in DAMAGED.items():
        pieces = [bytes(cache.masks[k]) for k in range(3)]
        pieces[1] = png  # in a store altered after its build, its checksums valid
        arrays = cache._stored()
        offsets = np.concatenate([[0], np.cumsum([len(p) for p in pieces])]).astype(np.int64)
        arrays = arrays.with_sections({DATA: np.frombuffer(b"".join(pieces), np.uint8),
                                       OFFSETS: offsets})
        with open(sys.argv[2], "wb") as f:
            _format.write(f, arrays)
        store = JpegCache.open(sys.argv[2])
        for workers in (0, 2):
            loader = GpuCachedLoader(store, batch_size=3, num_workers=workers, masks=True,
                                     on_error="skip", multiprocessing_context="fork")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = [m for _, ms in loader for m in ms]
            [(index, reason)] = loader.stats.skipped_samples
            loader.close()
            ok = index == 1 and "damaged" in reason and said in reason
            ok = ok and [int(m.max()) for m in got] == [1, 3]
            print("OK" if ok else "BAD", name, workers, reason)
""")


def test_a_damaged_mask_png_in_an_altered_store_is_a_skipped_sample_not_a_crash(tmp_path):
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    proc = subprocess.run(
        [sys.executable, "-c", _ALTERED, str(REPO), str(tmp_path / "altered.gpucache")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, f"rc {proc.returncode}: {proc.stderr[-3000:]}"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("OK", "BAD"))]
    assert len(lines) == 2 * len(DAMAGED) and all(ln.startswith("OK") for ln in lines), lines


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_a_palette_mask_of_few_bits_comes_back_as_its_indices(depth):
    per_byte = 8 // depth
    indices = (np.arange(H * W).reshape(H, W) * 7 // 3) % (2**depth)
    packed = b""
    for row in indices:
        bits = "".join(format(int(v), f"0{depth}b") for v in row)
        bits += "0" * (-len(bits) % 8)
        packed += b"\0" + int(bits, 2).to_bytes(len(bits) // 8, "big")
    assert len(packed) == H * (1 + -(-W // per_byte))
    png = _png(depth, 3, packed, palette=bytes(3 * 2**depth))
    assert (np.asarray(Image.open(io.BytesIO(png))) == indices).all()  # PIL reads the indices
    cache = JpegCache.from_files([make_jpeg_bytes(W, H, seed=0)], masks=[png], progress=False)
    [(_, masks)] = list(GpuCachedLoader(cache, batch_size=1, num_workers=0, masks=True))
    assert (masks[0].numpy() == indices).all()
