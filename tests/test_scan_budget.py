"""The scan limit bounds decoding work, not only the count of scans: a JPEG whose scans repeat
what earlier ones coded is refused, and so is one whose scans visit more blocks than the work
budget allows (``store._jpeg.read_scans``, ``store._limits.over_work``), at build and before
every decode, with the reason in the build report; the scripts encoders write fit at
``max_pixels``."""

import math

import pytest

from gpucache import JpegCache
from gpucache.decode._sample import decode_sample
from gpucache.ingest._sniff import sniff
from gpucache.store._jpeg import ARITHMETIC_WEIGHT, WORK_PER_PIXEL
from gpucache.store._limits import DEFAULT_MAX_PIXELS, check_pixels, over_work
from tests.support.hostile import (
    CMYK_SCRIPT,
    COLOUR_SCRIPT,
    arithmetic_dc_repeats,
    flat_progressive,
)

SIDE = math.isqrt(DEFAULT_MAX_PIXELS)  # 9459: the largest square within the default budget
# the DC of 3 components by successive approximation, Al 13 down to 0: 14 distinct valid scans
DC_BY_BITS = (((0, 1, 2), 0, 0, 0, 13), *(((0, 1, 2), 0, 0, a, a - 1) for a in range(13, 0, -1)))


def _build(tmp_path, files: dict[str, bytes], **kw) -> tuple[JpegCache, list[str]]:
    paths = []
    for name, data in files.items():
        paths.append(str(tmp_path / name))
        (tmp_path / name).write_bytes(data)
    return JpegCache.from_files(paths, progress=False, **kw), paths


def test_repeated_dc_scan_of_an_arithmetic_jpeg_is_refused_at_build(tmp_path):
    """The attack on the 100-scan limit: 9456 x 9456 (within max_pixels), arithmetic-coded, its
    first DC scan 98 times in 1.5 KB: 9-10 s and +680 MB per decode. Left out at build with the
    reason (the repeat named), the good sample beside it kept; nothing is decoded."""
    attack = arithmetic_dc_repeats()
    assert len(attack) < 2500
    good = flat_progressive(32, 48, COLOUR_SCRIPT)
    cache, paths = _build(tmp_path, {"attack.jpg": attack, "good.jpg": good})
    assert list(cache.paths) == [paths[1]]
    [skipped] = cache.report.skipped
    assert skipped.path == paths[0]
    assert "scan 2 codes again coefficients 0-0 of component 1" in skipped.reason
    assert "jpegtran" in skipped.reason


def test_distinct_scans_over_the_work_budget_are_refused_at_build(tmp_path):
    """14 valid distinct DC scans (successive approximation) over 9459 x 9459: 84 samples a pixel
    of work, arithmetic-coded (42 Huffman-coded, within the budget of 64); the same script over
    4000 x 4000 costs a fifth of the budget and is kept, and ``max_pixels=None`` keeps both."""
    heavy = flat_progressive(SIDE, SIDE, DC_BY_BITS, arithmetic=True)
    files = {
        "heavy.jpg": heavy,
        "huffman.jpg": flat_progressive(SIDE, SIDE, DC_BY_BITS),
        "smaller.jpg": flat_progressive(4000, 4000, DC_BY_BITS, arithmetic=True),
    }
    cache, paths = _build(tmp_path, files)
    assert list(cache.paths) == paths[1:]
    [skipped] = cache.report.skipped
    assert skipped.path == paths[0]
    assert "JPEG whose 14 scans cost" in skipped.reason
    assert f"max_pixels={DEFAULT_MAX_PIXELS:,}" in skipped.reason
    assert "raise max_pixels=" in skipped.reason  # the fix for a genuine one
    work = sniff(memoryview(heavy)).work
    assert work > WORK_PER_PIXEL * DEFAULT_MAX_PIXELS
    assert work == 14 * 3 * math.ceil(SIDE / 8) ** 2 * 64 * ARITHMETIC_WEIGHT
    unbounded, _ = _build(tmp_path, files, max_pixels=None)
    assert len(unbounded) == 3 and not unbounded.report.skipped


def test_decode_guard_holds_a_stored_sample_to_the_work_budget(tmp_path):
    """A store built without the budget (``max_pixels=None``) and opened with the default one
    refuses the heavy sample before any decoder sees it, with the same reason."""
    files = {
        "heavy.jpg": flat_progressive(SIDE, SIDE, DC_BY_BITS, arithmetic=True),
        "good.jpg": flat_progressive(32, 48, COLOUR_SCRIPT),
    }
    cache, _ = _build(tmp_path, files, max_pixels=None)
    cache.save(tmp_path / "s.gpucache")
    opened = JpegCache.open(tmp_path / "s.gpucache")
    check_pixels(opened, 1)
    for guarded in (check_pixels, decode_sample):
        with pytest.raises(ValueError, match="14 scans"):
            guarded(opened, 0)
    assert decode_sample(opened, 1).shape == (3, 32, 48)


@pytest.mark.parametrize(
    "script, comps", [(COLOUR_SCRIPT, 3), (CMYK_SCRIPT, 4)], ids=["colour", "cmyk"]
)
@pytest.mark.parametrize("arithmetic", [False, True], ids=["huffman", "arithmetic"])
def test_encoders_scripts_fit_the_budget_at_max_pixels(script, comps, arithmetic):
    """libjpeg's progressive scripts (10 scans for colour, 18 for CMYK, the heaviest) at 4:4:4
    over the largest square within max_pixels fit the work budget, arithmetic-coded too (the
    frame header says SOF10; the sniffer reads scan headers only)."""
    data = bytearray(flat_progressive(SIDE, SIDE, script, comps=comps))
    if arithmetic:
        data[data.index(b"\xff\xc2") + 1] = 0xCA
    info = sniff(memoryview(bytes(data)))
    assert info.scans == len(script)
    assert over_work(info.scans, info.work, DEFAULT_MAX_PIXELS) is None
    assert info.work <= 0.8 * WORK_PER_PIXEL * DEFAULT_MAX_PIXELS
