"""A store whose ``rst`` section (restart interval per sample) does not match its bytes loses no
sample: the loader decodes such a sample's crops without restart markers and warns once naming
it; ``gpucache verify`` decodes by the loader's route and reports each one."""

import warnings

import numpy as np
import pytest
import torch

from gpucache import GpuCachedLoader, JpegCache
from gpucache import transforms as T
from gpucache.cli import main
from gpucache.decode import _roi, _roi_rst
from gpucache.decode._options import DecodeOptions
from gpucache.testing import make_jpeg_bytes

needs_c = pytest.mark.skipif(
    _roi.region_decoder(3) is not _roi._c_region or not _roi_rst.transcoder_available(),
    reason="the compiled decoder (gpucache/_jpeg_regions.c) is not built",
)
N = 16


@pytest.fixture()
def plain(tmp_path) -> JpegCache:
    paths = []
    for i in range(N):
        paths.append(tmp_path / f"{i:02d}.jpg")
        paths[-1].write_bytes(make_jpeg_bytes(96 + 8 * (i % 3), 64, seed=i))
    return JpegCache.from_files(paths, progress=False)


def _with_rst(cache: JpegCache, rst: np.ndarray, path) -> JpegCache:
    bad = cache._replace(extra={**cache.extra, "rst": rst.astype("<i4")})
    return JpegCache.open(bad.save(path))


def _epoch(cache: JpegCache, workers: int) -> tuple[torch.Tensor, list[int]]:
    loader = GpuCachedLoader(
        cache,
        batch_size=5,
        shuffle=True,
        seed=1,
        num_workers=workers,
        device="cpu",
        return_metadata=True,
        transform=[T.RandomResizedCrop(32)],
        on_error="skip",
    )
    with loader:
        out = [(x.clone(), info.indices.tolist()) for x, _, info in loader]
        again = [info.indices.tolist() for _, _, info in loader]  # a second epoch
    assert sorted(sum(again, [])) == list(range(len(cache)))
    return torch.cat([x for x, _ in out]), sum((ix for _, ix in out), [])


@needs_c
@pytest.mark.parametrize("workers", [0, 1])
def test_a_wrong_interval_loses_no_sample_and_is_warned_once(plain, tmp_path, workers):
    """An ``rst`` of 1 on plain JPEGs: every sample of the epoch comes, with the pixels of the
    plain store, and one warning a sample names it (none in the second epoch)."""
    bad = _with_rst(plain, np.ones(N), tmp_path / "bad.gpucache")
    want, order = _epoch(plain, workers)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, got_order = _epoch(bad, workers)
    assert got_order == order and len(order) == N
    assert torch.equal(got, want)
    said = [str(w.message) for w in caught if "restart interval" in str(w.message)]
    assert len(said) == N, said
    for i in range(N):
        [line] = [m for m in said if f"sample {i} ({bad.paths[i]})" in m]
        assert "restart interval of 1 MCUs" in line and "gpucache verify" in line


@needs_c
def test_verify_takes_the_loader_s_route_and_reports_a_wrong_interval(plain, tmp_path, capsys):
    """``verify`` decodes a sample with an interval through its restart segments, as the loader's
    crops do: a restart-marker store verifies clean; the same store with the interval of two
    samples changed (and a plain store given one) reports those samples."""
    rst = JpegCache.open(
        JpegCache.from_files(plain.paths, progress=False, restart_markers=True).save(
            tmp_path / "rst.gpucache"
        )
    )
    ks = _roi_rst.intervals(rst)
    assert ks is not None and (ks > 0).all()
    assert main(["verify", str(tmp_path / "rst.gpucache")]) == 0
    assert f"{N} of {N} samples decode" in capsys.readouterr().out
    wrong = ks.copy()
    wrong[[3, 9]] = ks[[3, 9]] + 1
    _with_rst(rst, wrong, tmp_path / "wrong.gpucache")
    assert main(["verify", str(tmp_path / "wrong.gpucache")]) == 1
    out = capsys.readouterr()
    assert f"{N - 2} of {N} samples decode" in out.out
    lines = [ln for ln in out.err.splitlines() if "restart interval" in ln]
    assert len(lines) == 2 and "sample 3 (" in lines[0] and "sample 9 (" in lines[1], lines
    assert f"of {int(ks[3]) + 1} MCUs" in lines[0] and "section 'rst'" in lines[0]
    _with_rst(plain, np.ones(N), tmp_path / "ones.gpucache")
    assert main(["verify", str(tmp_path / "ones.gpucache")]) == 1
    assert f"0 of {N} samples decode" in capsys.readouterr().out


@needs_c
def test_the_gpu_backends_cpu_fallback_decodes_and_warns_too(plain, tmp_path):
    """A GPU backend hands the samples its decoder does not take to the CPU, one at a time
    (``_fallback.decode_on_cpu``): a wrong interval there is decoded and warned about too."""
    from gpucache.decode.gpu._fallback import decode_on_cpu

    bad = _with_rst(plain, np.ones(N), tmp_path / "bad.gpucache")
    idx = np.arange(3)
    h, w = bad.samples["height"][idx], bad.samples["width"][idx]
    plans = T.Compose([T.RandomResizedCrop(32)]).plan(
        h.astype(np.int64), w.astype(np.int64), np.random.default_rng(0)
    )
    with pytest.warns(RuntimeWarning) as caught:
        got = decode_on_cpu(bad, idx, plans, range(3), DecodeOptions(on_error="raise"))
    want = decode_on_cpu(plain, idx, plans, range(3), DecodeOptions(on_error="raise"))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    said = [str(w.message) for w in caught if "restart interval of 1 MCUs" in str(w.message)]
    assert [f"sample {i} (" in m for i, m in enumerate(said)] == [True] * 3
