"""Bad samples never kill a run: each case has its documented outcome and the counts add up."""

import warnings

import pytest
import torch

from gpucache import BuildError, GpuCachedLoader, JpegCache, Kind, SampleError
from gpucache import transforms as T


def test_each_case_has_its_documented_outcome(bad_folder):
    cases = bad_folder["cases"]
    paths = sorted(cases)
    cache = JpegCache.from_files(paths, progress=False)
    report = cache.report
    skipped = {s.path: s.reason for s in report.skipped}
    for path, outcome in cases.items():
        assert (path in skipped) == (outcome == "skip"), (path, skipped.get(path))
    assert (
        report.total == len(paths) == report.kept + len(report.skipped) == len(cache) + len(skipped)
    )
    reasons = {p.rsplit("/", 1)[1]: r for p, r in skipped.items()}
    assert reasons["empty.jpg"] == "empty file"
    assert "no end-of-image marker" in reasons["truncated_body.jpg"]
    assert "not an image" in reasons["random.jpg"] and "not an image" in reasons["text.jpg"]
    assert "12-bit JPEG is not supported" in reasons["12bit.jpg"]
    assert "lossless JPEG" in reasons["lossless.jpg"]
    assert "truncated" in reasons["truncated_header.jpg"]
    kinds = {p.rsplit("/", 1)[1]: Kind(k).name for p, k in zip(cache.paths, cache.kinds())}
    assert kinds["png_named.jpg"] == "PNG" and kinds["progressive.jpg"] == "JPEG_PROGRESSIVE"
    comps = dict(zip((p.rsplit("/", 1)[1] for p in cache.paths), cache.samples["components"]))
    assert comps["cmyk.jpg"] == 4 and comps["gray.jpg"] == 1
    exif = cache.paths.index(next(p for p in cache.paths if p.endswith("exif6.jpg")))
    # stored 40 wide, 30 high with orientation 6: decoded (and planned) as 30 wide, 40 high
    assert (cache.samples["height"][exif], cache.samples["width"][exif]) == (40, 30)
    assert cache.samples["orientation"][exif] == 6


def test_raise_policy_reports_every_bad_file(bad_folder):
    with pytest.raises(BuildError) as info:
        JpegCache.from_files(sorted(bad_folder["cases"]), on_error="raise", progress=False)
    msg = str(info.value)
    bad = [p for p, o in bad_folder["cases"].items() if o == "skip"]
    assert all(p in msg for p in bad) and f"{len(bad)} of" in msg


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_finishes_the_epoch_and_counts(bad_folder, num_workers):
    cache = JpegCache.from_files(sorted(bad_folder["cases"]), progress=False)
    loader = GpuCachedLoader(
        cache,
        batch_size=4,
        num_workers=num_workers,
        device="cpu",
        transform=T.Compose([T.Resize((32, 32))]),
        return_metadata=True,
    )
    seen = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for images, labels, info in loader:
            assert images.shape[1:] == (3, 32, 32) and len(images) == len(labels)
            seen += info.paths
    loader.close()
    failing = [p for p, o in bad_folder["cases"].items() if o == "decode-fails"]
    assert loader.stats.skipped == len(failing)
    assert [i for i, _ in loader.stats.skipped_samples] == [cache.paths.index(p) for p in failing]
    assert any("corrupt_scan.jpg" in str(w.message) for w in caught)
    assert len(seen) + loader.stats.skipped == len(cache)  # counts in = counts out + reported
    assert sorted(seen) == sorted(p for p in cache.paths if p not in failing)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_raise_policy_names_the_file(bad_folder, num_workers):
    cache = JpegCache.from_files(sorted(bad_folder["cases"]), progress=False)
    loader = GpuCachedLoader(
        cache,
        batch_size=4,
        num_workers=num_workers,
        device="cpu",
        on_error="raise",
        multiprocessing_context="fork",
    )
    with pytest.raises(SampleError, match="corrupt_scan.jpg"):
        for _ in loader:
            pass


def test_odd_jpegs_decode_to_rgb(bad_folder):
    """CMYK, grayscale, progressive, EXIF-rotated and PNG-named-.jpg all come out RGB uint8."""
    from PIL import Image, ImageOps

    from gpucache.decode._sample import decode_sample

    cache = JpegCache.from_files(sorted(bad_folder["cases"]), progress=False)
    for i, path in enumerate(cache.paths):
        if path.endswith("corrupt_scan.jpg"):
            continue
        img = decode_sample(cache, i)
        assert img.dtype == torch.uint8 and img.shape[0] == 3
        assert tuple(img.shape[1:]) == (cache.samples["height"][i], cache.samples["width"][i])
        with Image.open(path) as im:
            ref = torch.from_numpy(
                __import__("numpy").asarray(ImageOps.exif_transpose(im).convert("RGB"))
            ).permute(2, 0, 1)
        tol = 12 if path.endswith("cmyk.jpg") else 1  # PIL's CMYK conversion differs slightly
        assert (img.float() - ref.float()).abs().mean() < tol, path


_BOMB_RUN = r"""
import json, resource, sys
from gpucache import GpuCachedLoader, JpegCache
from gpucache import transforms as T
from gpucache.testing import make_jpeg_folder
from tests.support.hostile import make_hostile_folder
from gpucache.testing._memory import status_bytes

root = sys.argv[1]
outcomes = make_hostile_folder(root, fifo=False)
make_jpeg_folder(root, 8, classes=("y",))
cache = JpegCache.from_folder(root, progress=False)
kept_bombs = [p for p in cache.paths if "bomb" in p.rsplit("/", 1)[1]]
if kept_bombs:  # decoding them would take gigabytes: stop here
    sys.exit(f"bombs kept at build: {kept_bombs}")
loader = GpuCachedLoader(cache, batch_size=4, num_workers=1, device="cpu", backend="cpu",
                         transform=T.Compose([T.Resize((32, 32))]))
seen = sum(len(images) for images, _ in loader)
loader.close()
# VmHWM, not ru_maxrss: Linux carries the launching process's peak RSS into ru_maxrss across
# exec, so after a test that held a large image this process would report pytest's peak
print(json.dumps({"seen": seen, "kept": len(cache), "skipped": loader.stats.skipped,
                  "self_mb": status_bytes("VmHWM") / 2**20,
                  "workers_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""


def test_decompression_bombs_keep_the_run_under_1_gb(tmp_path):
    """Build from a folder with 65500x65500 and 30000x30000 JPEG headers, a 65500x65500 and a
    real 144 Mpx PNG, then a CPU-backend epoch with one worker, in a fresh process: the bombs are
    skipped at build and the peak RSS of the process and of its worker stays under 1 GB."""
    import json
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", _BOMB_RUN, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["seen"] + out["skipped"] == out["kept"] and out["seen"] > 8
    assert out["self_mb"] < 1024 and out["workers_mb"] < 1024, out
