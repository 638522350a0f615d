"""The build-time re-encode and the CPU decode of non-JPEG images give the pixels the store
records: one orientation rule (the store's, matched to libjpeg-turbo's decoders), and 16-bit
images scaled to 8 bits, not clipped to white."""

from __future__ import annotations

import io
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

from gpucache import JpegCache
from gpucache.decode._sample import decode_sample
from gpucache.ingest._resize import Budget, Reencode, resized
from gpucache.ingest._sniff import sniff
from gpucache.testing import make_jpeg_bytes
from tests.support.hostile import after_soi, exif_app1, xmp_app1


def _jpeg(*segments: bytes) -> bytes:
    # quality 98 so that a re-encode at 80 is smaller and kept; stored 96 wide, 64 tall
    return after_soi(make_jpeg_bytes(96, 64, seed=3, quality=98), *segments)


ORIENTATION_CASES = {  # EXIF layouts PIL reads as orientation 6 and libjpeg-turbo as none
    "exif_after_xmp.jpg": _jpeg(xmp_app1(1), exif_app1(6)),
    "exif_long_mm.jpg": _jpeg(exif_app1(6, order=b"MM", long=True)),
    "xmp_orientation.jpg": _jpeg(xmp_app1(6)),
    "exif_6.jpg": _jpeg(exif_app1(6)),  # both rules: turned
}


@pytest.mark.parametrize(
    "kw", [{"jpeg_quality": 80}, {"max_side": 48}], ids=["jpeg_quality", "max_side"]
)
def test_reencoded_samples_keep_the_plain_stores_orientation(tmp_path, kw):
    """The plain store decodes ``exif_after_xmp.jpg`` 96 wide (TorchCodec's rule); the
    re-encode turned it with PIL's EXIF reader to 64 wide while its ``resized`` record said 96."""
    paths = []
    for name, data in ORIENTATION_CASES.items():
        paths.append(tmp_path / name)
        paths[-1].write_bytes(data)
    plain = JpegCache.from_files(paths, progress=False)
    redone = JpegCache.from_files(paths, progress=False, **kw)
    assert resized(redone).all()
    rec = redone.extra["resized"]
    for i, name in enumerate(ORIENTATION_CASES):
        shape = tuple(decode_sample(plain, i).shape[1:])
        assert shape == (plain.samples["height"][i], plain.samples["width"][i]), name
        assert shape == ((96, 64) if name == "exif_6.jpg" else (64, 96)), name
        assert tuple(rec[i][:2]) == shape, name  # the record states the plain size
        got = tuple(decode_sample(redone, i).shape[1:])
        if "max_side" in kw:
            assert got == tuple(round(s * 48 / 96) for s in shape), name  # same turn, smaller
        else:
            assert got == shape, name
        out = bytes(redone[i])
        assert sniff(memoryview(out)).orientation == 1, name
        with Image.open(io.BytesIO(out)) as im:
            assert im.getexif().get(0x0112) is None and "xmp" not in im.info, name


def _png16(arr: np.ndarray, color_type: int) -> bytes:
    """A 16-bit PNG of ``arr`` (H, W, C) uint16, written chunk by chunk (PIL writes 16-bit gray
    only); color type 0 gray, 2 RGB, 4 gray+alpha, 6 RGBA."""
    h, w = arr.shape[:2]
    rows = arr.astype(">u2").reshape(h, -1)
    raw = b"".join(b"\x00" + rows[y].tobytes() for y in range(h))

    def chunk(cid: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data))
            + cid
            + data
            + struct.pack(">I", zlib.crc32(cid + data) & 0xFFFFFFFF)
        )

    ihdr = struct.pack(">IIBBBBB", w, h, 16, color_type, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )


def _saved(im: Image.Image, fmt: str) -> bytes:
    out = io.BytesIO()
    im.save(out, fmt)
    return out.getvalue()


def _sixteen_bit_cases() -> dict[str, bytes]:
    """Every value 0-65535 once, shuffled (so that a re-encode is smaller than the PNG): its
    8-bit image has mean 127.5 exactly; clipped, 254.5."""
    v = np.random.default_rng(0).permutation(65536).astype(np.uint16).reshape(256, 256)
    alpha = np.full_like(v, 65535)
    return {
        "gray_I16.png": _saved(Image.fromarray(v), "PNG"),  # PIL's mode I;16
        "gray_I16B.tif": _saved(
            Image.frombytes("I;16B", (256, 256), v.astype(">u2").tobytes()), "TIFF"
        ),
        "gray_I32.tif": _saved(Image.fromarray(v.astype(np.int32)), "TIFF"),  # mode I
        "rgb16.png": _png16(np.stack([v, v[::-1], v.T], axis=-1), 2),
        "la16.png": _png16(np.stack([v, alpha], axis=-1), 4),
    }


@pytest.mark.parametrize(
    "kw", [{}, {"jpeg_quality": 90}, {"max_side": 128}], ids=["plain", "jpeg_quality", "max_side"]
)
def test_sixteen_bit_images_are_scaled_to_eight_bits(tmp_path, kw):
    cases = _sixteen_bit_cases()
    paths = []
    for name, data in cases.items():
        paths.append(tmp_path / name)
        paths[-1].write_bytes(data)
    with Image.open(paths[0]) as im, Image.open(paths[1]) as im_b, Image.open(paths[2]) as im_i:
        assert (im.mode, im_b.mode, im_i.mode) == ("I;16", "I;16B", "I")  # the modes covered
    cache = JpegCache.from_files(paths, progress=False, **kw)
    if kw:
        assert resized(cache).all()  # the re-encode ran on every one
    for i, name in enumerate(cases):
        img = decode_sample(cache, i).float()
        tol = 0.01 if not kw else 1.5  # JPEG and resampling move the mean a little
        assert abs(float(img.mean()) - 127.5) < tol, (name, float(img.mean()))
        if not kw:  # no loss: each 8-bit value 256 times per channel
            assert (
                np.bincount(img[0].flatten().int().numpy(), minlength=256).tolist() == [256] * 256
            ), name


def test_an_image_larger_than_the_whole_budget_still_runs():
    """Threads share the re-encode's memory budget; one image over all of it runs alone, and
    every image is re-encoded (no thread waits forever)."""
    step = Reencode(32, budget=Budget(1))
    data = [make_jpeg_bytes(200, 150, seed=k) for k in range(8)]
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda b: step(b, sniff(memoryview(b))), data))
    for (out, info, rec), original in zip(outs, data):
        assert rec["resized"] == (150, 200, len(original))
        assert max(info.height, info.width) == 32 and sniff(memoryview(out)) == info
    assert step.budget.used == 0
