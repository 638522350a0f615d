"""Crop geometry at the edges of what libjpeg upsamples like the full image.

libjpeg-turbo upsamples a subsampled component with the fancy (triangle) filter only when it has
more than 2 samples across, so a crop or a restart-marker sub-image narrower than that would come
out differently from the full decode. These cases pin the rules that keep ROI decode bit-exact:
mixed 2:1 + 4:1 horizontal sampling (crops <= 3 px wide), and a restart-marker image whose last segment column
is <= 4 px wide. CMYK through nvImageCodec is held to its stated tolerance (<= 1 level).
"""

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from gpucache.decode import _roi, _roi_rst
from gpucache.decode._jpeg import decode_jpeg
from gpucache.testing import natural_image

needs_c = pytest.mark.skipif(not _roi._c_ok(), reason="compiled region decoder not built")
needs_nv = pytest.mark.skipif(_roi._nvimgcodec is None, reason="nvImageCodec not installed")


def _jpeg(w: int, h: int, *, seed: int = 0, mode: str = "RGB", subsampling: int = 2) -> bytes:
    buf = io.BytesIO()
    kw = {"subsampling": subsampling} if mode == "RGB" else {}
    Image.fromarray(natural_image(w, h, seed=seed)).convert(mode).save(
        buf, "JPEG", quality=90, **kw
    )
    return buf.getvalue()


#: 157 x 45, luma 4x1, Cb 2x1, Cr 1x1 (2:1 and 4:1 horizontally at once), quality 90, written
#: by libjpeg-turbo 2.1.5's jpeg_set_defaults + those factors from gpucache.testing.natural_image(
#: 157, 45, seed=1). Pillow cannot write such sampling.
MIXED = Path(__file__).parent / "data" / "sampling_41_21_11.jpg"


def _full(data: bytes) -> torch.Tensor:
    return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8))


def _narrow_boxes(h: int, w: int):
    """Every crop 1-3 px wide at each column of the first and last 40, a few heights."""
    for bw in (1, 2, 3):
        for left in [*range(0, 40), *range(w - 40 - bw, w - bw + 1)]:
            yield (h // 3, left, 5, bw)
        yield (0, w - bw, h, bw)


@needs_c
def test_mixed_2_1_and_4_1_sampling_crops_up_to_3_px_wide_are_bit_exact():
    data = MIXED.read_bytes()
    full = _full(data)
    h, w = full.shape[1:]
    bad = [
        b
        for b in _narrow_boxes(h, w)
        if not torch.equal(
            _roi._c_region(data, *b, height=h, width=w),
            full[:, b[0] : b[0] + b[2], b[1] : b[1] + b[3]],
        )
    ]
    assert not bad, f"{len(bad)} crops differ, e.g. {bad[:3]}"


@pytest.mark.parametrize(
    "route", [pytest.param("c", marks=needs_c), pytest.param("nv", marks=needs_nv)]
)
@pytest.mark.parametrize("width", [98, 99, 100, 97])  # last segment column 2, 3, 4 and 1 px wide
def test_restart_marker_crops_in_a_narrow_last_segment_column(route, width):
    data, k = _roi_rst.transcode(_jpeg(width, 40, seed=width))
    assert k == 1  # 7 MCUs per row: segments 16 px wide, the last one width - 96
    full = _full(data)
    arr = np.frombuffer(data, dtype=np.uint8)
    region = _roi._c_region if route == "c" else _roi._nv_region
    for bw in range(1, width - 95):
        for top, bh in ((0, 40), (17, 3)):
            box = (top, width - bw, bh, bw)
            got = _roi_rst.decode_crop(arr, k, box, _roi.Oriented(40, width), region=region)
            assert torch.equal(got, full[:, top : top + bh, width - bw :]), box


@needs_nv
def test_cmyk_through_nvimgcodec_is_within_one_level():
    rng = np.random.default_rng(0)
    for seed, sub in ((1, 0), (2, 2)):
        data = _jpeg(131, 77, seed=seed, mode="CMYK", subsampling=sub)
        full = _full(data).int()
        for _ in range(10):
            bh, bw = int(rng.integers(1, 78)), int(rng.integers(1, 132))
            t, l = int(rng.integers(0, 78 - bh)), int(rng.integers(0, 132 - bw))
            got = _roi._nv_region(data, t, l, bh, bw, height=77, width=131).int()
            assert (got - full[:, t : t + bh, l : l + bw]).abs().max() <= 1
