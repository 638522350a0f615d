"""JpegDataset: the store behind a plain torch DataLoader, real workers under each start method.

Copies held are measured like tests/test_memory.py does: a fresh child process runs one DataLoader
epoch (1 persistent worker, alive when measured) over the same 40 JPEGs repeated SMALL and BIG
times; (PSS without libraries, big - small) / (data bytes, big - small) is the number of times the
image data sits in RAM across parent and workers. Every byte is read in the epoch (each sample is
decoded), so every page of the store is counted wherever it is mapped.
"""

from __future__ import annotations

import os
import pickle
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from gpucache import JpegCache, JpegDataset
from gpucache.decode._sample import decode_sample
from gpucache.testing import make_jpeg_folder

REPO = Path(__file__).resolve().parent.parent
MAX_COPIES = 1.05
SMALL, BIG = 2, 8


@pytest.fixture(scope="module")
def cache(jpeg_folder):
    return JpegCache.from_folder(jpeg_folder, progress=False)


def test_getitem_matches_the_decoder_in_each_output(cache):
    ds = JpegDataset(cache)
    assert len(ds) == len(cache)
    for i in range(len(cache)):
        img, label = ds[i]
        ref = decode_sample(cache, i)
        assert torch.equal(img, ref) and label == int(cache.labels[i])
        s = cache.samples[i]
        assert img.shape == (3, s["height"], s["width"])  # EXIF orientation applied
    rgb, _ = JpegDataset(cache, output="numpy")[3]
    bgr, _ = JpegDataset(cache, output="numpy", bgr=True)[3]
    assert rgb.flags.c_contiguous and rgb.dtype == np.uint8 and rgb.shape[2] == 3
    assert np.array_equal(rgb, decode_sample(cache, 3).permute(1, 2, 0).numpy())
    assert np.array_equal(bgr, rgb[..., ::-1])
    pil, _ = JpegDataset(cache, output="pil")[3]
    assert pil.mode == "RGB" and np.array_equal(np.asarray(pil), rgb)
    assert torch.equal(ds[-1][0], ds[len(ds) - 1][0])
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_transforms_and_info(tmp_path):
    import torchvision.transforms.v2 as v2

    folder = make_jpeg_folder(tmp_path, 6, classes=("a", "b"), seed=4)
    files = sorted(str(p) for p in folder.rglob("*.jpg"))
    cache = JpegCache.from_files(
        files, [0, 1, 0, 1, 0, 1], [f"m{k}" for k in range(6)], progress=False
    )
    ds = JpegDataset(
        cache,
        transform=v2.Compose([v2.Resize(32), v2.CenterCrop(32)]),
        target_transform=lambda t: t + 10,
        return_info=True,
    )
    img, target, info = ds[2]
    assert img.shape == (3, 32, 32) and target == 10
    assert info == {"index": 2, "path": files[2], "metadata": "m2"}
    batch = next(iter(DataLoader(ds, batch_size=3)))
    assert batch[0].shape == (3, 3, 32, 32) and batch[1].tolist() == [10, 11, 10]
    assert batch[2]["path"] == files[:3] and batch[2]["metadata"] == ["m0", "m1", "m2"]


def test_bad_arguments_name_what_is_accepted(cache):
    with pytest.raises(ValueError, match="'tensor', 'numpy', 'pil'"):
        JpegDataset(cache, output="cv2")
    with pytest.raises(TypeError, match="callable"):
        JpegDataset(cache, transform=[1, 2])
    with pytest.raises(TypeError, match="JpegCache"):
        JpegDataset([b"\xff\xd8"])


def test_pickles_in_constant_size(tmp_path, jpeg_folder):
    saved = JpegCache.open(
        JpegCache.from_folder(jpeg_folder, progress=False).save(tmp_path / "s.gpucache")
    )
    small = len(pickle.dumps(JpegDataset(saved)))
    assert small < 2000 < saved.nbytes
    mem = JpegCache.from_folder(jpeg_folder, progress=False)
    assert not mem.is_shared
    blob = pickle.dumps(JpegDataset(mem))  # moves the store into shared memory once
    try:
        assert mem.is_shared and len(blob) < 2000
        # once: a second pickle (a second worker's) names the same shared copy
        assert pickle.dumps(JpegDataset(mem)) == blob
        again = pickle.loads(blob)
        assert torch.equal(again[5][0], JpegDataset(saved)[5][0])
    finally:
        mem.close()


def _channel_means(x: torch.Tensor) -> torch.Tensor:
    return x.float().mean((1, 2))


# spawn and forkserver both pickle the dataset to each worker (JpegDataset.__getstate__ shares the
# store; the worker attaches to it), so spawn covers that path in the default run; forkserver,
# whose workers each import torch too, runs with `-m slow`.
@pytest.mark.parametrize(
    "context", ["fork", "spawn", pytest.param("forkserver", marks=pytest.mark.slow)]
)
def test_dataloader_workers_each_start_method(context, jpeg_folder):
    """Real DataLoader workers decode exactly what the main process decodes (in-memory store).
    One worker: a second one unpickles the same dataset (test_pickles_in_constant_size: the
    same bytes), and under spawn each worker is one more interpreter that imports torch."""
    cache = JpegCache.from_folder(jpeg_folder, progress=False)
    ds = JpegDataset(cache, transform=_channel_means)
    loader = DataLoader(ds, batch_size=5, num_workers=1, multiprocessing_context=context)
    got = torch.cat([x for x, _ in loader])
    ref = torch.stack([_channel_means(decode_sample(cache, i)) for i in range(len(cache))])
    assert torch.equal(got, ref)
    assert cache.is_shared == (context != "fork")  # fork pickles nothing, needs no shared memory
    cache.close()


def test_photos_of_every_kind_under_spawn(photo_folder):
    photos = sorted(str(p) for p in photo_folder.rglob("*.jpg"))
    cache = JpegCache.from_files(photos, progress=False)
    ds = JpegDataset(cache, output="numpy")  # one spawned worker decodes every kind
    loader = DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context="spawn")
    shapes = [img.shape for img, _ in loader]
    assert len(shapes) == len(photos)
    assert shapes == [(s["height"], s["width"], 3) for s in cache.samples]
    cache.close()


# ------------------------------------------------------------------------------- copies held
_CHILD = textwrap.dedent("""
    import gc, os, signal, sys
    import psutil
    from torch.utils.data import DataLoader
    from gpucache import JpegCache, JpegDataset
    from gpucache.testing._memory import tree_pss

    def shape(x):  # keep batches tiny: the measurement is about the store, not the images
        return x.shape[1]

    def main(context, repeat, src):
        files = sorted(os.path.join(r, f) for r, _, fs in os.walk(src) for f in fs
                       if f.endswith(".jpg"))
        cache = JpegCache.from_files(files * int(repeat), progress=False)
        ds = JpegDataset(cache, transform=shape)
        loader = DataLoader(ds, batch_size=16, num_workers=1, persistent_workers=True,
                            multiprocessing_context=context)
        n = sum(len(b) for b, _ in loader)
        assert n == len(cache), (n, len(cache))
        gc.collect()
        print(tree_pss(), cache.nbytes, tree_pss(without_libraries=True), cache.is_shared,
              flush=True)
        # measured: the workers are killed rather than shut down in order (seconds of torch's
        # teardown in each, which nothing here checks), and the interpreter leaves at once
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the DataLoader's: a killed worker fails
        workers = psutil.Process().children()
        for worker in workers:
            worker.kill()
        psutil.wait_procs(workers, timeout=30)
        cache.close()
        os._exit(0)

    if __name__ == "__main__":
        main(*sys.argv[1:4])
""")


@pytest.fixture(scope="module")
def copies_src(tmp_path_factory) -> Path:
    return make_jpeg_folder(tmp_path_factory.mktemp("ds_copies"), 40, seed=3)


def _measure(script: Path, context: str, repeat: int, src: Path) -> subprocess.Popen:
    """The fresh child of one run, started; :func:`_measured` reads its result."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="65536")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return subprocess.Popen(
        [sys.executable, str(script), context, str(repeat), str(src)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _measured(child: subprocess.Popen) -> tuple[int, int, int]:
    """(PSS, data bytes, PSS without libraries) of one child run."""
    stdout, stderr = child.communicate(timeout=240)
    assert child.returncode == 0, f"stdout:\n{stdout}\nstderr:\n{stderr[-4000:]}"
    pss, data, nolib, shared = stdout.strip().splitlines()[-1].split()
    assert shared == "True", "the in-memory store was not moved to shared memory when pickled"
    return int(pss), int(data), int(nolib)


def _copies(script, context, src) -> tuple[float, str]:
    # the two runs at once, as in tests/test_memory.py (no page they share is counted)
    runs = [_measure(script, context, r, src) for r in (SMALL, BIG)]
    try:
        small, big = (_measured(child) for child in runs)
    finally:
        for child in runs:
            child.kill()  # a failed or timed-out run takes the other with it
    data = big[1] - small[1]
    assert data >= 30e6, f"the two runs differ by only {data / 1e6:.1f} MB of data"
    copies = (big[2] - small[2]) / data
    return copies, (
        f"{copies:.3f} (PSS without libraries {small[2] / 1e6:.1f} -> "
        f"{big[2] / 1e6:.1f} MB, data {small[1] / 1e6:.1f} -> {big[1] / 1e6:.1f} MB)"
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PSS is measured the Linux way")
# One worker: a worker that copied the store instead of attaching to its shared pages would hold
# a second copy (2.0 against the bound of 1.05), as each of two would (3.0); with two, each run
# started two more interpreters that import torch. That a second pickle (a second worker's)
# names the same shared copy is test_pickles_in_constant_size.
@pytest.mark.timeout(900)  # two to six fresh processes with workers: slow on a loaded machine
@pytest.mark.parametrize("context", ["spawn", pytest.param("forkserver", marks=pytest.mark.slow)])
def test_dataloader_workers_hold_one_copy(tmp_path, copies_src, context):
    script = tmp_path / "ds_child.py"
    script.write_text(_CHILD)
    copies, detail = _copies(script, context, copies_src)
    details = [detail]
    if copies > MAX_COPIES:  # noise: the median of three, the bound stays
        more = [_copies(script, context, copies_src) for _ in range(2)]
        copies = statistics.median([copies] + [c for c, _ in more])
        details += [d for _, d in more]
    print(f"copies held: JpegDataset in DataLoader, {context}, 1 worker: {copies:.3f}")
    assert copies <= MAX_COPIES, (
        f"JpegDataset ({context}, 1 worker) holds {copies:.3f} copies "
        f"(bound {MAX_COPIES}): " + "; ".join(details)
    )
