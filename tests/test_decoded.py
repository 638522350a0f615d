"""The decoded tier (``GpuCachedLoader(decoded=S)``, docs/guides/decoded.md) on real JPEGs made
here: the eval pipeline as the raw path's exact decode, the fallbacks (budget, file-size limit,
read-only folder), one file per node reused across loaders and attached by spawn workers,
masks and boxes through the tier's scale, resume, the file format's checks, the device tier on
the emulated GPU."""

from __future__ import annotations

import gc
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import warnings

import numpy as np
import pytest
import torch

from gpucache import CacheFormatError, GpuCachedLoader, JpegCache
from gpucache import transforms as T
from gpucache.loader import _tier_build
from gpucache.store._decoded import FROM_STORE, open_tier
from gpucache.testing import make_jpeg_folder, make_mask_png

EVAL = [T.Resize(64), T.CenterCrop(56)]
TRAIN = [T.RandomResizedCrop(48), T.RandomHorizontalFlip()]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    # 20 photos: grayscale, CMYK, progressive and EXIF-rotated ones among them
    return make_jpeg_folder(tmp_path_factory.mktemp("decoded") / "img", 20)


@pytest.fixture(scope="module")
def cache(folder):
    return JpegCache.from_folder(folder, progress=False)


def _batches(loader):
    return [(x.clone(), y.clone()) for x, y in loader]


def test_eval_from_the_tier_matches_the_raw_exact_decode(cache):
    with GpuCachedLoader(
        cache, batch_size=8, num_workers=0, device="cpu", decoded=64, transform=EVAL
    ) as tier:
        assert tier.tier == "decoded" and tier.tier_reason is None
        got = _batches(tier)
        p = tier._tier.pixels
        s = cache.samples
        short = np.minimum(p.heights, p.widths)
        assert np.all(short == np.minimum(64, np.minimum(s["height"], s["width"])))
        assert "tier: decoded (short side 64" in str(tier.stats)
    with GpuCachedLoader(
        cache, batch_size=8, num_workers=0, device="cpu", exact=True, transform=EVAL
    ) as raw:
        ref = _batches(raw)
    for (x, y), (rx, ry) in zip(got, ref, strict=True):
        assert torch.equal(y, ry)
        diff = (x.int() - rx.int()).abs()
        assert diff.amax(dim=(1, 2, 3)).max() <= 2 and diff.float().mean() <= 0.5


def test_long_side_for_letterbox_pipelines(cache):
    kw = dict(batch_size=8, num_workers=0, device="cpu", transform=[T.Letterbox(64)])
    with GpuCachedLoader(cache, decoded=64, decoded_side="long", **kw) as tier:
        p = tier._tier.pixels
        assert np.all(np.maximum(p.heights, p.widths) <= 64)
        got = _batches(tier)
    with GpuCachedLoader(cache, exact=True, **kw) as raw:
        ref = _batches(raw)
    for (x, _), (rx, _) in zip(got, ref, strict=True):
        assert (x.int() - rx.int()).abs().max() <= 2


def test_over_budget_is_the_raw_tier_with_the_bytes_and_identical_batches(cache):
    kw = dict(batch_size=8, num_workers=0, device="cpu", seed=3, shuffle=True, transform=TRAIN)
    with pytest.warns(RuntimeWarning, match=r"needs [\d,]+ bytes .* decoded_budget=10,000"):
        loader = GpuCachedLoader(cache, decoded=64, decoded_budget=10_000, **kw)
    with loader, GpuCachedLoader(cache, **kw) as raw:
        assert loader.tier == "raw" and "decoded_budget" in loader.tier_reason
        for (x, y), (rx, ry) in zip(_batches(loader), _batches(raw), strict=True):
            assert torch.equal(x, rx) and torch.equal(y, ry)


def test_one_file_per_node_reused_and_attached_by_spawn_workers(cache, tmp_path):
    kw = dict(batch_size=8, device="cpu", seed=1, shuffle=True, transform=TRAIN, decoded=64)
    with GpuCachedLoader(cache, num_workers=0, **kw) as inline:  # anonymous memory
        assert inline._tier.pixels.path is None
        ref = _batches(inline)
    # one spawn worker attaches the file as any other would (each worker unpickles the tier's
    # descriptor, below 2 KiB, and maps the file)
    with GpuCachedLoader(
        cache, num_workers=1, multiprocessing_context="spawn", cache_dir=tmp_path, **kw
    ) as spawned:
        pixels = spawned._tier.pixels
        assert spawned.tier == "decoded" and pixels.path.parent == tmp_path
        assert len(pickle.dumps(pixels)) < 2048  # its descriptor, not its pixels
        for (x, y), (rx, ry) in zip(_batches(spawned), ref, strict=True):
            assert torch.equal(x, rx) and torch.equal(y, ry)
        first = os.stat(pixels.path)
    with GpuCachedLoader(cache, num_workers=0, cache_dir=tmp_path, **kw) as again:
        assert again._tier.pixels.path == pixels.path  # reused, not built again
    assert os.stat(pixels.path).st_ino == first.st_ino
    assert [p.suffix for p in tmp_path.iterdir()] == [".pixels"]  # no lock or temp file left


def test_ranks_of_a_node_build_once_and_share_the_file(cache, tmp_path, monkeypatch):
    calls = []
    real = _tier_build.into_file

    def counted(*a, **k):
        calls.append(threading.get_ident())
        return real(*a, **k)

    monkeypatch.setattr(_tier_build, "into_file", counted)
    start, out = threading.Barrier(2), {}

    def rank(r: int) -> None:
        start.wait()
        loader = GpuCachedLoader(
            cache, batch_size=4, num_workers=0, device="cpu", decoded=48, cache_dir=tmp_path,
            num_replicas=2, rank=r, transform=EVAL,
        )  # fmt: skip
        out[r] = os.fstat(loader._tier.pixels.handle.fd).st_ino

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and out[0] == out[1]


# One child process (one torch import) runs the loader of each start method in turn under the
# limit, fork first, each with its own fresh cache_dir: the tier each one gets, the samples of
# its epoch, its warnings and its reason, one line each.
_LIMITED = """
import resource, sys, warnings
from gpucache import GpuCachedLoader, JpegCache
from gpucache import transforms as T

def main():
    cache = JpegCache.from_folder(sys.argv[1], progress=False)
    # the raw tier's spawn workers map a store file (saved before the limit)
    saved = JpegCache.open(cache.save(sys.argv[2] + ".gpucache"))
    resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
    for method in sys.argv[3:]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loader = GpuCachedLoader(
                saved if method == "spawn" else cache, batch_size=8, num_workers=1,
                multiprocessing_context=method, device="cpu", decoded=256,
                cache_dir=sys.argv[2] + "-" + method, transform=[T.RandomResizedCrop(32)],
            )
        n = sum(len(y) for y in [b[1] for b in loader])
        print(method, loader.tier, n, len(caught), "|", loader.tier_reason, flush=True)
        loader.close()

if __name__ == "__main__":
    main()
"""
METHODS = ("fork", "spawn")


@pytest.fixture(scope="module")
def file_size_limited(folder, tmp_path_factory) -> dict:
    """The line of each of :data:`METHODS`, by method, from one child under the limit."""
    tmp = tmp_path_factory.mktemp("limited")
    script = tmp / "limited.py"
    script.write_text(textwrap.dedent(_LIMITED))
    run = subprocess.run(
        [sys.executable, str(script), str(folder), str(tmp / "fresh"), *METHODS],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr
    lines = [line.split(None, 1) for line in run.stdout.splitlines()]
    return {method: line for method, line in lines}


# One worker: the tier a loader gets under the limit does not depend on how many it starts
# (fork inherits the tier built in memory, spawn workers could only map a file).
@pytest.mark.parametrize("method", METHODS)
def test_a_file_size_limit_never_crashes(file_size_limited, method):
    tier, n, warned, reason = file_size_limited[method].replace("|", " | ").split(None, 3)
    assert int(n) == 20 and int(warned) >= 1
    assert "file-size limit" in reason and "65,536" in reason
    assert tier == ("decoded" if method == "fork" else "raw")


def test_a_folder_it_cannot_write_falls_back(cache, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)  # read-only for its owner
    if os.geteuid() == 0:  # root writes anywhere: a folder of another user's is refused instead
        os.chown(ro, 65534, 65534)
    kw = dict(batch_size=4, num_workers=0, device="cpu", decoded=64, cache_dir=ro)
    # one rank of two: a copy in each rank's memory is not one copy a node, so the raw tier
    with pytest.warns(RuntimeWarning, match="cannot be used|failed"):
        loader = GpuCachedLoader(cache, num_replicas=2, rank=0, **kw)
    with loader:
        assert loader.tier == "raw" and str(ro) in loader.tier_reason
        assert sum(len(y) for _, y in loader) == len(cache) // 2
    with pytest.warns(RuntimeWarning, match="memory"):
        alone = GpuCachedLoader(cache, **kw)  # one process, no workers: in memory
    with alone:
        assert alone.tier == "decoded" and alone._tier.pixels.path is None
        assert sum(len(y) for _, y in alone) == len(cache)


def test_a_corrupt_tier_file_is_rebuilt_and_the_format_is_checked(cache, tmp_path):
    kw = dict(batch_size=8, num_workers=0, device="cpu", decoded=48, cache_dir=tmp_path)
    with GpuCachedLoader(cache, **kw) as loader:
        path = loader._tier.pixels.path
    good = path.read_bytes()
    for bad in (good[:-100], good[:40] + b"\xff" + good[41:], good[:200] + b"\x07" + good[201:]):
        path.write_bytes(bad)
        with pytest.raises(CacheFormatError, match=str(path)):
            open_tier(path)
        with GpuCachedLoader(cache, **kw) as loader:  # rebuilt, same content
            assert loader.tier == "decoded"
        assert path.read_bytes() == good
    assert open_tier(path).verify()


def test_masks_and_boxes_follow_the_tiers_scale(tmp_path):
    images, masks = [], []
    for k in range(3):
        img = make_jpeg_folder(tmp_path / f"m{k}", 1, seed=k)  # one photo a folder
        path = next(img.rglob("*.jpg"))
        from PIL import Image

        with Image.open(path) as im:
            size = im.size
        yy, xx = np.mgrid[: size[1], : size[0]]
        masks.append(make_mask_png(((yy // 7 + xx // 5) % 3).astype(np.uint8), "L"))
        images.append(path)
    store = JpegCache.from_files(images, masks=masks, progress=False)
    kw = dict(batch_size=3, num_workers=0, device="cpu", transform=EVAL, return_metadata=True)
    with (
        GpuCachedLoader(store, decoded=64, **kw) as tier,
        GpuCachedLoader(store, exact=True, **kw) as raw,
    ):
        (x, m, info), (rx, rm, rinfo) = next(iter(tier)), next(iter(raw))
    assert (x.int() - rx.int()).abs().max() <= 2
    assert torch.equal(m, rm)  # nearest to the tier's size, then the plan: the raw masks
    box = np.array([[10.0, 12.0, 40.0, 50.0]])
    for p, rp in zip(info.plans, rinfo.plans):
        np.testing.assert_allclose(T.map_boxes(box, p), T.map_boxes(box, rp), atol=1e-6)


def test_resume_mid_epoch_on_the_tier(cache):
    kw = dict(batch_size=4, num_workers=0, device="cpu", seed=5, shuffle=True, transform=TRAIN)
    with GpuCachedLoader(cache, decoded=64, **kw) as a:
        it = iter(a)
        next(it), next(it)
        state = a.state_dict()
        rest = [(x.clone(), y.clone()) for x, y in it]
    with GpuCachedLoader(cache, decoded=64, **kw) as b:
        b.load_state_dict(state)
        for (x, y), (rx, ry) in zip(_batches(b), rest, strict=True):
            assert torch.equal(x, rx) and torch.equal(y, ry)


def test_a_sample_libjpeg_warns_about_is_decoded_from_the_store(tmp_path):
    root = make_jpeg_folder(tmp_path / "img", 6)
    victim = sorted(root.rglob("*.jpg"))[5]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = b"\x00" * 64  # corrupt entropy-coded data
    victim.write_bytes(bytes(data))
    store = JpegCache.from_folder(root, progress=False)
    kw = dict(batch_size=6, num_workers=0, device="cpu", transform=EVAL, exact=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with GpuCachedLoader(store, decoded=64, **kw) as tier:
            p = tier._tier.pixels
            got = _batches(tier)
            warned_tier = dict(tier.stats.warned_samples)
        with GpuCachedLoader(store, **kw) as raw:
            ref = _batches(raw)
            warned_raw = dict(raw.stats.warned_samples)
    assert set(np.flatnonzero(p.status == FROM_STORE)) == set(warned_raw)
    assert warned_tier == warned_raw
    for (x, y), (rx, ry) in zip(got, ref, strict=True):
        assert torch.equal(y, ry) and (x.int() - rx.int()).abs().max() <= 2


def test_device_tier_on_the_emulated_gpu(cache):
    from tests.support.emulated_cuda import EmulatedCuda

    with GpuCachedLoader(
        cache, batch_size=8, num_workers=0, device="cpu", decoded=64, transform=TRAIN, seed=2
    ) as cpu:
        ref = _batches(cpu)
    with EmulatedCuda(devices=1):
        for budget, tier in ((1 << 30, "device"), (1000, "decoded")):
            with warnings.catch_warnings():  # the device tier over its budget says so
                warnings.simplefilter("ignore")
                gpu = GpuCachedLoader(
                    cache, batch_size=8, device="cuda", decoded=64, device_budget=budget,
                    transform=TRAIN, seed=2,
                )  # fmt: skip
            with gpu:
                assert gpu.tier == tier
                for (x, y), (rx, ry) in zip(gpu, ref, strict=True):
                    assert x.device.type == "cuda" and torch.equal(y.cpu(), ry)
                    assert (x.cpu().int() - rx.int()).abs().max() <= 1
                held = gpu._backend.device_bytes
                assert held == (gpu._tier.pixels.nbytes if tier == "device" else 0)


def test_the_device_tier_pads_with_the_fill_itself(cache):
    """On the emulated GPU the tier's backend paints its own padding with ``fill`` (the loader
    paints nothing after a backend): its batched resize, and its samples decoded from the store,
    as the cpu backend does on the same tier."""
    from tests.support.emulated_cuda import EmulatedCuda

    tf = [T.Resize(64), T.CenterCrop(200)]  # wider and taller than every resized image
    kw = dict(batch_size=8, decoded=64, transform=tf, seed=2, fill=9)
    with GpuCachedLoader(cache, num_workers=0, device="cpu", **kw) as cpu:
        ref = _batches(cpu)
    with EmulatedCuda(devices=1):
        for budget, tier in ((1 << 30, "device"), (1000, "decoded")):
            with warnings.catch_warnings():  # the device tier over its budget says so
                warnings.simplefilter("ignore")
                gpu = GpuCachedLoader(cache, device="cuda", device_budget=budget, **kw)
            with gpu:
                assert gpu.tier == tier
                got = [(x.cpu(), y.cpu()) for x, y in gpu]
            for (x, y), (rx, ry) in zip(got, ref, strict=True):
                assert torch.equal(y, ry) and (x.int() - rx.int()).abs().max() <= 1
                for edge in (x[:, :, 0, :], x[:, :, -1, :], x[:, :, :, 0], x[:, :, :, -1]):
                    assert (edge == 9).all(), tier


def test_arguments_are_checked(cache):
    for bad, match in (
        (dict(decoded=0), "decoded should be a side"),
        (dict(decoded=64, decoded_side="wide"), "decoded_side must be"),
        (dict(decoded=64, decoded_budget=-1), "decoded_budget should be bytes"),
        (dict(decoded=64, device_budget=2.0), "device_budget should be"),
    ):
        with pytest.raises(ValueError, match=match):
            GpuCachedLoader(cache, batch_size=2, **bad)


def test_info_lists_the_stores_decoded_tiers(cache, tmp_path, capsys):
    from gpucache.cli import main

    store = cache.save(tmp_path / "s.gpucache")
    opened = JpegCache.open(store)
    assert main(["info", str(store), "--cache-dir", str(tmp_path / "nc")]) == 0
    assert "decoded tiers: none" in capsys.readouterr().out
    with GpuCachedLoader(opened, batch_size=4, decoded=40, cache_dir=tmp_path / "nc"):
        pass
    assert main(["info", str(store), "--cache-dir", str(tmp_path / "nc")]) == 0
    assert "decoded tier: short side 40, 20 images" in capsys.readouterr().out


def test_cache_clean_removes_unused_tiers_and_keeps_one_in_use(cache, tmp_path):
    from gpucache.node._clean import clean, entries

    kw = dict(batch_size=4, num_workers=0, device="cpu", cache_dir=tmp_path)
    GpuCachedLoader(cache, decoded=40, **kw).close()
    old = next(tmp_path.glob("*.pixels"))
    gc.collect()  # the closed loader's tier is no longer mapped
    with GpuCachedLoader(cache, decoded=48, **kw) as held:
        listed = {e.path: e for e in entries(tmp_path)}
        assert listed[held._tier.pixels.path].in_use and not listed[old].in_use
        removed = clean(tmp_path, everything=True)
        assert [e.path for e in removed.stores] == [old]
        assert held._tier.pixels.path.exists() and not old.exists()


def test_device_tier_batches_cost_ops_that_do_not_grow_with_the_batch(cache):
    """Every aten op (views excluded) while the device tier makes a batch on the emulated GPU:
    the batched resample's few chunks, never ops an image, and no upload after the first."""
    from benchmarks.batched_transforms import CountOps
    from gpucache.decode._options import DecodeOptions
    from gpucache.decode.gpu._pixels import PixelBackend
    from tests.support.emulated_cuda import EmulatedCuda

    with GpuCachedLoader(cache, batch_size=4, num_workers=0, decoded=64) as host:
        pixels = host._tier.pixels
    with EmulatedCuda(devices=1), CountOps() as counter:
        backend = PixelBackend(
            cache, pixels, device=torch.device("cuda", 0), resident=True, options=DecodeOptions()
        )
        ops = {}
        for n in (4, 16, 16):
            idx = np.arange(n)
            rows = np.asarray(T.Compose(TRAIN).plan(
                pixels.heights[idx].astype(np.int64), pixels.widths[idx].astype(np.int64),
                np.random.default_rng(n),
            ))  # fmt: skip
            counter.counts.clear()
            backend.submit(idx, rows, True)
            out = backend.get().images
            assert out.shape == (n, 3, 48, 48) and out.device.type == "cuda"
            ops[n] = sum(counter.counts.values())
    assert ops[16] < 4 * 16 and ops[16] <= 2 * ops[4], ops


def test_node_shares_play_every_sample_once_from_their_tiers(tmp_path, monkeypatch):
    from gpucache.testing import make_jpeg_bytes

    root = tmp_path / "train"
    for i in range(11):  # one sample a class: a label names its sample
        (root / f"c{i:02d}").mkdir(parents=True)
        (root / f"c{i:02d}" / "x.jpg").write_bytes(make_jpeg_bytes(40 + i, 30, seed=i))
    stores = []
    for node in range(2):
        env = dict(WORLD_SIZE=4, LOCAL_WORLD_SIZE=2, GROUP_RANK=node, RANK=2 * node, LOCAL_RANK=0)
        with monkeypatch.context() as mp:
            for k, v in env.items():
                mp.setenv(k, str(v))
            stores.append(
                JpegCache.from_folder(
                    root, shard="node", cache_dir=tmp_path / f"n{node}", progress=False
                )
            )
    kw = dict(batch_size=2, shuffle=True, seed=7, num_workers=0, transform=TRAIN, decoded=24)
    seen, padding = [], 0
    for r in range(4):
        with GpuCachedLoader(stores[r // 2], num_replicas=4, rank=r, **kw) as lo:
            assert lo.tier == "decoded" and lo._tier.pixels.path.parent == tmp_path / f"n{r // 2}"
            seen += [int(y) for _, labels in lo for y in labels]
            padding += lo.epoch_padding
    assert sorted(set(seen)) == list(range(11)) and len(seen) == 11 + padding
