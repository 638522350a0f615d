"""What a build holds beyond the data: bounded temporaries (no per-sample futures or objects),
a restart-marker build near one copy, and the progress it reports on the way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from gpucache import JpegCache
from gpucache.decode import _roi_rst
from gpucache.ingest._build import BytesSource, build
from gpucache.ingest._inputs import Samples
from gpucache.ingest._options import BuildOptions
from gpucache.testing import make_jpeg_bytes

REPO = Path(__file__).resolve().parent.parent
needs_proc = pytest.mark.skipif(
    not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc"
)

_PEAK_CHILD = textwrap.dedent("""
    import ctypes, gc, json, sys
    import numpy as np
    from gpucache import JpegCache
    from gpucache.testing._memory import reset_peak_rss, status_bytes

    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)
    before = reset_peak_rss()  # the peak RSS (VmHWM) is now the current RSS
    cache = JpegCache.from_folder(sys.argv[1], progress=False,
                                  restart_markers=sys.argv[2] == "rst")
    print(json.dumps({"peak": status_bytes("VmHWM") - before, "data": cache.nbytes, "n": len(cache),
                      "rst": int((cache.extra.get("rst", np.zeros(1)) > 0).sum())}))
""")


def _child(code: str, *args: str, cwd: Path) -> dict:
    """The JSON line a fresh interpreter running ``code`` with ``args`` prints last."""
    run = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _peak(root: Path, mode: str) -> dict:
    return _child(_PEAK_CHILD, str(root), mode, cwd=root)


@needs_proc
def test_small_file_build_holds_little_beyond_the_data(tmp_path):
    """10,000 small JPEGs in 50 folders: the build's peak beyond the data stays under 800 B a
    sample (the store's own index, the packed paths, the chunks in flight, fixed costs), where a
    future per file held about 2.4 KB. benchmarks/build_scale.py measures it at 100k-1.28M."""
    pool = [make_jpeg_bytes(16, 12, seed=k) for k in range(50)]
    for c in range(50):
        folder = tmp_path / f"c{c:02d}"
        folder.mkdir()
        for k in range(200):
            (folder / f"{k:04d}.jpg").write_bytes(pool[(c + k) % 50])
    out = _peak(tmp_path, "plain")
    assert out["n"] == 10_000
    beyond = (out["peak"] - out["data"]) / out["n"]
    print(f"peak beyond the data: {beyond:.0f} B/sample")
    assert beyond < 800, f"{beyond:.0f} B/sample beyond the data"


@needs_proc
@pytest.mark.skipif(not _roi_rst.transcoder_available(), reason="no compiled transcoder")
def test_restart_marker_build_peaks_near_one_copy(tmp_path):
    """A restart-marker build of ~25 MB of photos peaks at <= 1.5x its data (a list of every
    transcoded sample, then a buffer, then a read-only copy held about 4x)."""
    (tmp_path / "c").mkdir()
    photos = [make_jpeg_bytes(640, 480, seed=k, progressive=k % 5 == 0) for k in range(40)]
    for k in range(160):
        (tmp_path / "c" / f"{k:03d}.jpg").write_bytes(photos[k % 40])
    out = _peak(tmp_path, "rst")
    assert out["n"] == out["rst"] == 160 and out["data"] > 15e6
    print(f"restart-marker build peak / data: {out['peak'] / out['data']:.2f}")
    assert out["peak"] / out["data"] <= 1.5


_REENCODE_CHILD = textwrap.dedent("""
    import ctypes, gc, json, sys
    import numpy as np
    from gpucache import JpegCache
    from gpucache.ingest import _resize
    from gpucache.ingest._build import BytesSource, build
    from gpucache.ingest._inputs import Samples
    from gpucache.ingest._options import BuildOptions
    from gpucache.testing._memory import reset_peak_rss, status_bytes

    png = open(sys.argv[1], "rb").read()
    inputs = [BytesSource(f"{k}.png", png) for k in range(4)]
    _resize.MEMORY_BUDGET = 64 << 20
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)
    before = reset_peak_rss()
    cache = build(JpegCache, inputs, Samples(np.zeros(4, np.int64), ["a"]),
                  BuildOptions(on_error="raise", num_threads=4, progress=False, max_side=256))
    print(json.dumps({"peak": status_bytes("VmHWM") - before,
                      "resized": int(_resize.resized(cache).sum())}))
""")


@needs_proc
def test_reencode_memory_is_bounded_across_threads(tmp_path):
    """4 threads re-encoding 4 PNGs of 12 Mpx (46 MB of pixels each, 45 KB of file) under a
    64 MiB budget: one image decoded at a time, the peak about one image's pixels (1.1), where
    each thread held its decode and two copies of it (12 images' worth). The default budget is
    1 GiB; the 8 x 89 Mpx PNGs of docs/guides/stores.md peak 1.4 GiB with it. Measured in a
    fresh process: in the suite's own, memory other tests freed into other threads' malloc
    arenas is not reused by the build's threads, and their fresh arenas raise the peak."""
    h, w = 4000, 3000
    a = np.zeros((h, w, 3), np.uint8)
    a[..., 0] = (np.arange(w) // 300 * 25)[None, :]
    a[..., 1] = (np.arange(h) // 400 * 25)[:, None]
    Image.fromarray(a).save(tmp_path / "big.png", "PNG")
    del a
    out = _child(_REENCODE_CHILD, str(tmp_path / "big.png"), cwd=tmp_path)
    pixels = h * w * 4  # as PIL holds RGB
    print(f"re-encode peak: {out['peak'] / pixels:.2f} images of pixels")
    assert out["resized"] == 4 and out["peak"] < 2 * pixels


def test_progress_is_reported_in_order_and_can_stop_the_build():
    blobs = [make_jpeg_bytes(24, 16, seed=k) for k in range(8)]
    inputs = [BytesSource(f"b{k}", blobs[k % 8]) for k in range(3000)] + [BytesSource("x", b"?")]
    calls = []
    cache = build(
        JpegCache,
        inputs,
        Samples(np.zeros(len(inputs), np.int64), ["a"]),
        BuildOptions(on_error="skip", num_threads=2, progress=False),
        on_progress=lambda *a: calls.append(a),
    )
    total = sum(len(blobs[k % 8]) for k in range(3000)) + 1
    assert len(cache) == 3000 and calls[-1] == (3001, 3001, total)
    assert calls[0] == (0, 3001, 0) and len(calls) > 10  # heartbeats while sizing, then chunks
    assert all(a[0] <= b[0] and a[2] <= b[2] for a, b in zip(calls, calls[1:]))

    def stop(done, total, nbytes):
        if done > 1000:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build(
            JpegCache,
            inputs,
            Samples(np.zeros(len(inputs), np.int64), ["a"]),
            BuildOptions(on_error="skip", num_threads=2, progress=False),
            on_progress=stop,
        )
