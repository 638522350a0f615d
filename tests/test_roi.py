"""ROI decode (decode only the crop box) is bit-exact with a full decode + the same plan.

Real JPEGs made here cover every chroma subsampling PIL writes, gray, CMYK, progressive and all eight
EXIF orientations (benchmarks/cpu_levers.py asserts the same on real photos). The fallback (no
nvImageCodec) is exercised in a subprocess where the import really fails.
"""

import io
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from PIL import Image

from gpucache import JpegCache
from gpucache.decode import _roi, _roi_rst
from gpucache.decode._apply import apply_plan
from gpucache.decode._core import decode_batch
from gpucache.decode._jpeg import decode_jpeg
from gpucache.decode._options import DecodeOptions
from gpucache.decode._sample import decode_sample
from gpucache.ingest._build import restart_store
from gpucache.testing import natural_image

needs_roi = pytest.mark.skipif(_roi.route() is None, reason="no region decoder here")
_roi_c_ok = _roi._c_ok()
ROUTES = [
    pytest.param(
        True,
        id="libjpeg-turbo",
        marks=pytest.mark.skipif(not _roi_c_ok, reason="compiled region decoder not built"),
    ),
    pytest.param(
        False,
        id="nvimgcodec",
        marks=pytest.mark.skipif(_roi._nvimgcodec is None, reason="nvImageCodec not installed"),
    ),
]


@pytest.fixture(params=ROUTES)
def use_c(request, monkeypatch):
    """Each region decoder in turn: without the compiled one, nvImageCodec's is chosen."""
    if not request.param:
        monkeypatch.setattr(_roi, "_c_ok", lambda: False)
    return request.param


def _jpeg(
    w: int,
    h: int,
    *,
    seed: int,
    mode: str = "RGB",
    subsampling: str | None = "4:2:0",
    progressive: bool = False,
    orientation: int | None = None,
) -> bytes:
    img = Image.fromarray(natural_image(w, h, seed=seed)).convert(mode)
    kw: dict = {"quality": 92, "progressive": progressive}
    if subsampling is not None and mode == "RGB":
        kw["subsampling"] = subsampling
    if orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
        kw["exif"] = exif.tobytes()
    buf = io.BytesIO()
    img.save(buf, "JPEG", **kw)
    return buf.getvalue()


CASES = {  # name -> jpeg kwargs; odd sizes so partial MCUs and edge upsampling are exercised
    "444": dict(subsampling="4:4:4"),
    "420": dict(subsampling="4:2:0"),
    "422": dict(subsampling="4:2:2"),
    "gray": dict(mode="L"),
    "cmyk": dict(mode="CMYK"),
    "progressive420": dict(progressive=True),
    "progressive444": dict(progressive=True, subsampling="4:4:4"),
    **{f"exif{o}_420": dict(orientation=o) for o in range(1, 9)},
    **{f"exif{o}_422": dict(orientation=o, subsampling="4:2:2") for o in (5, 6, 7, 8)},
}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("roi")
    paths = []
    for k, (name, kw) in enumerate(CASES.items()):
        p = root / f"{k:02d}_{name}.jpg"
        p.write_bytes(_jpeg(203 + 2 * k, 131 + 3 * k, seed=k, **kw))
        paths.append(p)
    return JpegCache.from_files(paths, progress=False)


def _plans(h: int, w: int, rng: np.random.Generator, n: int) -> np.ndarray:
    """Crop boxes of every kind: random, 1 px, at MCU boundaries, touching each edge; resized."""
    boxes = [
        (0, 0, h, w - 1),
        (0, 0, 1, 1),
        (h - 1, w - 1, 1, 1),
        (8, 16, 16, 16),
        (16, 8, h - 16, w - 8),
        (7, 15, 9, 17),
        (0, w - 17, h, 17),
        (h - 9, 0, 9, w),
    ]
    for _ in range(n):
        bh, bw = int(rng.integers(1, h + 1)), int(rng.integers(1, w + 1))
        boxes.append((int(rng.integers(0, h - bh + 1)), int(rng.integers(0, w - bw + 1)), bh, bw))
    out = []
    for k, (t, l, bh, bw) in enumerate(boxes):
        rh, rw = (bh, bw) if k % 3 == 0 else (int(rng.integers(8, 64)), int(rng.integers(8, 64)))
        out.append([t, l, bh, bw, rh, rw, 0, 0, rh, rw, k % 2])
    return np.asarray(out, dtype=np.int64)


def _check_exact(cache, i: int, plans: np.ndarray) -> int:
    full = decode_sample(cache, i)
    got = decode_batch(
        cache, np.full(len(plans), i), plans, DecodeOptions(on_error="raise"), stack=False
    )
    for plan, img in zip(plans, got.images):
        ref = apply_plan(full, plan)
        assert img.shape == ref.shape and torch.equal(img, ref), (cache.paths[i], plan.tolist())
    return got.roi_decoded


NV_CASES = ("444", "420", "422", "gray", "cmyk", "progressive420", "exif6_420", "exif7_422")


@pytest.mark.parametrize("name", list(CASES))
def test_roi_is_bit_exact(cache, name, use_c):
    if not use_c and name not in NV_CASES:
        pytest.skip("the fallback decoder runs a subset (time)")
    i = list(CASES).index(name)
    h, w = int(cache.samples["height"][i]), int(cache.samples["width"][i])
    if CASES[name].get("orientation", 1) >= 5:
        assert (h, w) == (131 + 3 * i, 203 + 2 * i)[::-1]  # the store's size is the oriented one
    plans = _plans(h, w, np.random.default_rng(i), 16)
    roi = _check_exact(cache, i, plans)
    comps = int(cache.samples["components"][i])
    assert roi == (len(plans) if _roi.region_decoder(comps) else 0)  # all took the ROI path


def test_uncropped_and_non_jpeg_samples_are_decoded_in_full(cache, tmp_path):
    png = tmp_path / "x.png"
    Image.fromarray(natural_image(40, 30, seed=1)).save(png)
    store = JpegCache.from_files([png, *cache.paths[:1]], progress=False)
    h, w = int(store.samples["height"][1]), int(store.samples["width"][1])
    plans = np.asarray(
        [[2, 3, 20, 20, 20, 20, 0, 0, 20, 20, 0], [0, 0, h, w, 20, 20, 0, 0, 20, 20, 1]],
        dtype=np.int64,
    )
    got = decode_batch(store, np.arange(2), plans, DecodeOptions(on_error="raise"), stack=True)
    assert got.roi_decoded == 0 and got.images.shape == (2, 3, 20, 20)
    for k in range(2):
        assert torch.equal(got.images[k], apply_plan(decode_sample(store, k), plans[k]))


def test_box_mapping_matches_orientation():
    """coded_box and orient agree: the box cut from the coded image, oriented, is the same pixels."""
    coded = torch.arange(5 * 7).reshape(1, 5, 7)
    for o in range(1, 9):
        oriented = _roi.orient(coded, o)
        h, w = oriented.shape[-2:]
        t, l, bh, bw = 1, 2, h - 2, w - 3
        ct, cl, ch, cw = _roi.coded_box(t, l, bh, bw, o, h, w)
        cut = _roi.orient(coded[:, ct : ct + ch, cl : cl + cw], o)
        assert torch.equal(cut, oriented[:, t : t + bh, l : l + bw]), o


FALLBACK = textwrap.dedent("""
    import logging, sys
    import numpy as np
    sys.modules["nvidia.nvimgcodec"] = None  # the package is absent: its import fails
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from gpucache import JpegCache
    from gpucache import _native
    from gpucache.decode import _roi
    from gpucache.decode._core import decode_batch
    from gpucache.decode._options import DecodeOptions
    _native._state["lib"] = None  # the compiled part was not built (no compiler at install)
    assert _roi.route() is None
    cache = JpegCache.open(sys.argv[1])
    plans = np.load(sys.argv[2])
    for _ in range(2):  # the notice is logged once, not per batch
        idx = np.zeros(len(plans), dtype=np.int64)
        d = decode_batch(cache, idx, plans, DecodeOptions(on_error="raise"), stack=True)
    assert d.roi_decoded == 0 and d.cpu_decoded == len(plans)
    np.save(sys.argv[3], d.images.numpy())
""")


def test_fallback_without_nvimgcodec_gives_the_same_output(cache, tmp_path):
    h, w = int(cache.samples["height"][1]), int(cache.samples["width"][1])
    plans = _plans(h, w, np.random.default_rng(5), 4)
    plans[:, 4:6] = plans[:, 8:10] = 24
    store = tmp_path / "s.gpucache"
    JpegCache.from_files(cache.paths[1:2], progress=False).save(store)
    np.save(tmp_path / "p.npy", plans)
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            FALLBACK,
            str(store),
            str(tmp_path / "p.npy"),
            str(tmp_path / "out.npy"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("decoded at full size before cropping") == 1, r.stderr
    here = decode_batch(
        cache,
        np.ones(len(plans), dtype=np.int64),
        plans,
        DecodeOptions(on_error="raise"),
        stack=True,
    )
    assert np.array_equal(np.load(tmp_path / "out.npy"), here.images.numpy())


def test_threads_decode_at_once(cache, use_c):
    """The nvjpeg backend's fallback thread and the main thread may both decode (one decoder each)."""
    from concurrent.futures import ThreadPoolExecutor

    i = list(CASES).index("420")
    h, w = int(cache.samples["height"][i]), int(cache.samples["width"][i])
    plans = _plans(h, w, np.random.default_rng(3), 30)
    ref = decode_batch(
        cache, np.full(len(plans), i), plans, DecodeOptions(on_error="raise"), stack=False
    )
    with ThreadPoolExecutor(4) as pool:
        outs = list(
            pool.map(
                lambda _: decode_batch(
                    cache,
                    np.full(len(plans), i),
                    plans,
                    DecodeOptions(on_error="raise"),
                    stack=False,
                ),
                range(8),
            )
        )
    for out in outs:
        assert out.roi_decoded == len(plans)
        assert all(torch.equal(a, b) for a, b in zip(out.images, ref.images))


needs_rst = pytest.mark.skipif(
    not (_roi.route() and _roi_rst.transcoder_available()),
    reason="no region decoder or no compiled transcoder",
)


@needs_rst
@pytest.mark.parametrize(
    "name", ["444", "420", "422", "gray", "cmyk", "progressive420", "exif6_420", "exif7_422"]
)
def test_restart_segments_decode_bit_exact(cache, name, use_c):
    """Transcoded losslessly (same pixels in full), then only the crop's segments decoded."""
    i = list(CASES).index(name)
    data, k = _roi_rst.transcode(cache[i])
    assert 1 <= k <= 4 and data[:2] == b"\xff\xd8"
    restart = np.frombuffer(data, dtype=np.uint8)
    full = decode_sample(cache, i)
    assert torch.equal(decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8)), full)
    h, w = full.shape[1:]
    lay = _roi_rst.Layout(restart, k)
    region = _roi.region_decoder(int(cache.samples["components"][i]))
    if region is None:
        pytest.skip("no region decoder for CMYK here")
    for plan in _plans(h, w, np.random.default_rng(100 + i), 20):
        t, l, bh, bw = plan[:4].tolist()
        got = _roi_rst.decode_crop(
            restart,
            k,
            (t, l, bh, bw),
            _roi.Oriented(h, w, CASES[name].get("orientation", 1)),
            region=region,
        )
        assert torch.equal(got, full[:, t : t + bh, l : l + bw]), plan.tolist()
    ct, cl, ch, cw = _roi.coded_box(h // 2, w // 2, 8, 8, CASES[name].get("orientation", 1), h, w)
    sub = _roi_rst.segment_jpeg(restart, lay, ct, cl, ch, cw)[0]
    assert len(sub) < len(data) / 2  # a small box's segments are a fraction of the file


@needs_rst
def test_restart_marker_store_gives_the_plain_stores_output(cache, tmp_path):
    png = tmp_path / "x.png"
    Image.fromarray(natural_image(64, 48, seed=2)).save(png)
    plain = JpegCache.from_files([*cache.paths, png], progress=False)
    rst = JpegCache.from_files([*cache.paths, png], progress=False, restart_markers=True)
    ks = _roi_rst.intervals(rst)
    assert ks is not None and (ks[:-1] > 0).all() and ks[-1] == 0  # the PNG stays as it was
    reopened = JpegCache.open(rst.save(tmp_path / "rst.gpucache"))
    assert np.array_equal(_roi_rst.intervals(reopened), ks)
    rng = np.random.default_rng(7)
    idx = rng.permutation(len(plain))
    h, w = plain.samples["height"][idx], plain.samples["width"][idx]
    from gpucache import transforms as T

    plans = T.Compose([T.RandomResizedCrop(48), T.RandomHorizontalFlip()]).plan(
        h.astype(np.int64), w.astype(np.int64), rng
    )
    want = decode_batch(plain, idx, plans, DecodeOptions(on_error="raise"), stack=True)
    for store in (rst, reopened):
        got = decode_batch(store, idx, plans, DecodeOptions(on_error="raise"), stack=True)
        assert torch.equal(got.images, want.images)
        assert got.roi_decoded >= len(idx) - 3  # all but the PNG and uncropped fallbacks


NO_TRANSCODER = textwrap.dedent("""
    import sys
    import numpy as np
    sys.modules["nvidia.nvimgcodec"] = None  # neither optional decoder part is here
    from gpucache import JpegCache
    from gpucache.ingest._build import restart_store
    from gpucache import _native
    from gpucache.decode import _roi, _roi_rst
    from gpucache.decode._core import decode_batch
    from gpucache.decode._options import DecodeOptions
    _native._state["lib"] = None  # the compiled part was not built
    plain = JpegCache.open(sys.argv[1])
    try:
        restart_store(plain)
        raise SystemExit("no error")
    except RuntimeError as err:
        assert "C compiler" in str(err) and "reinstall" in str(err), err
    rst = JpegCache.open(sys.argv[2])  # a restart-marker store still decodes (in full)
    plans = np.load(sys.argv[3])
    idx = np.arange(len(plans)) % len(rst)
    d = decode_batch(rst, idx, plans, DecodeOptions(on_error="raise"), stack=True)
    assert d.roi_decoded == 0
    np.save(sys.argv[4], d.images.numpy())
""")


@needs_rst
def test_restart_markers_without_the_optional_parts(cache, tmp_path):
    plain = JpegCache.from_files(cache.paths[:3], progress=False)
    plain.save(tmp_path / "plain.gpucache")
    restart_store(plain).save(tmp_path / "rst.gpucache")
    h, w = int(plain.samples["height"].min()), int(plain.samples["width"].min())
    plans = _plans(h, w, np.random.default_rng(9), 3)
    plans[:, 4:6] = plans[:, 8:10] = 16
    np.save(tmp_path / "p.npy", plans)
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            NO_TRANSCODER,
            str(tmp_path / "plain.gpucache"),
            str(tmp_path / "rst.gpucache"),
            str(tmp_path / "p.npy"),
            str(tmp_path / "out.npy"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    idx = np.arange(len(plans)) % len(plain)
    want = decode_batch(
        plain, idx, plans, DecodeOptions(on_error="raise"), stack=True
    ).images.numpy()
    assert np.array_equal(np.load(tmp_path / "out.npy"), want)
