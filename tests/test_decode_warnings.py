"""Corrupt JPEG data that libjpeg decodes anyway is reported per sample, never silently.

A real JPEG whose scan was damaged mid-way (a stray restart marker: libjpeg warns "Corrupt JPEG
data: premature end of data segment" and fills the rest) is kept by the build (its headers are
fine). The loader logs it once per sample with index and path, counts it in ``loader.stats``, and
with ``on_error="skip_warned"`` leaves it out; libjpeg's own message never reaches stderr.

torchvision's deprecation notice (torchvision >= 0.29, on every decode call) never reaches the
user either, and keeping it away never touches the user's warning filters, from any thread.
"""

import contextlib
import io
import logging
import threading
import warnings

import pytest
import torch
from PIL import Image

from gpucache import GpuCachedLoader, JpegCache
from gpucache import transforms as T
from gpucache.decode import _roi
from gpucache.testing import make_jpeg_bytes, natural_image

needs_region_decoder = pytest.mark.skipif(
    not _roi._c_ok(), reason="compiled region decoder not built"
)


def damaged_jpeg(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(natural_image(96, 64, seed=seed)).save(buf, "JPEG", quality=90)
    b = bytearray(buf.getvalue())
    b[len(b) // 2 : len(b) // 2 + 2] = b"\xff\xd3"  # a restart marker where none belongs
    return bytes(b)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("warn")
    paths = []
    for k in range(4):
        p = root / f"{k}.jpg"
        if k == 2:
            p.write_bytes(damaged_jpeg(k))
        else:
            Image.fromarray(natural_image(96, 64, seed=k)).save(p, quality=90)
        paths.append(p)
    return JpegCache.from_files(paths, labels=[0, 1, 2, 3], progress=False)


@needs_region_decoder
@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize("transform", [T.RandomResizedCrop(32), None], ids=["crop", "full"])
def test_warned_sample_is_logged_once_and_counted(store, workers, transform, caplog, capfd):
    loader = GpuCachedLoader(
        store,
        batch_size=2,
        num_workers=workers,
        backend="cpu",
        seed=0,
        transform=transform,
        multiprocessing_context="spawn",
    )
    with caplog.at_level(logging.WARNING, logger="gpucache"), loader:
        for _ in range(2):  # two epochs: still one report
            n = sum(len(labels) for _, labels in loader)
            assert n == 4  # kept by default
    assert loader.stats.warned == 1 and list(loader.stats.warned_samples) == [2]
    reports = [r.getMessage() for r in caplog.records if "corrupt JPEG data" in r.getMessage()]
    assert len(reports) == 1 and "sample 2" in reports[0] and "2.jpg" in reports[0], reports
    assert "premature end of data segment" in reports[0]
    assert "Corrupt JPEG data" not in capfd.readouterr().err  # libjpeg's stderr line is gone


@needs_region_decoder
def test_skip_warned_leaves_the_sample_out(store):
    loader = GpuCachedLoader(
        store,
        batch_size=4,
        num_workers=0,
        backend="cpu",
        seed=0,
        transform=T.Compose([T.Resize(40), T.CenterCrop(32)]),
        on_error="skip_warned",
    )
    with pytest.warns(RuntimeWarning, match="skip_warned"):
        ((images, labels),) = list(loader)
    assert images.shape == (3, 3, 32, 32) and 2 not in labels.tolist()
    assert loader.stats.skipped == 1 and loader.stats.warned == 1


@needs_region_decoder
def test_unknown_policy_is_refused(store):
    with pytest.raises(ValueError, match="skip_warned"):
        GpuCachedLoader(store, batch_size=2, on_error="warn")


@needs_region_decoder
def test_damaged_scan_decodes_to_different_pixels(store):
    """The report matters: the damaged sample's pixels really are wrong."""
    good = JpegCache.from_files([store.paths[0]], progress=False)
    from gpucache.decode._sample import decode_sample

    bad = decode_sample(store, 2)
    ref = torch.from_numpy(natural_image(96, 64, seed=2)).permute(2, 0, 1)
    assert (bad.int() - ref.int()).abs().float().mean() > 10
    assert decode_sample(good, 0).shape == bad.shape


def _decode_in_a_loop(data: bytes, stop: threading.Event, decoded: threading.Semaphore) -> None:
    """Decode with torchvision's decoders, as the nvjpeg backend's threads do, until told;
    release ``decoded`` after each decode."""
    from gpucache.decode._jpeg import decode_jpeg
    from gpucache.decode.gpu._batched import torchvision_decoder

    tv = torchvision_decoder(torch.device("cpu"))
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    while not stop.is_set():
        tv.decode([t])
        decoded.release()
        decode_jpeg(t, use_torchcodec=False)
        decoded.release()


def test_decoding_in_a_thread_keeps_the_main_threads_warning_filters():
    """A decode thread must never save and restore the process's filter list (what
    ``warnings.catch_warnings`` does): a filter the main thread adds meanwhile would be lost.
    The main thread adds one filter each time the thread has decoded, so each lands while the
    next decode runs (300 rounds)."""
    data = make_jpeg_bytes(64, 48, seed=1)
    stop, decoded, errors = threading.Event(), threading.Semaphore(0), []

    def run() -> None:
        try:
            _decode_in_a_loop(data, stop, decoded)
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)
        finally:
            stop.set()
            decoded.release()  # wakes the main thread if it waits

    lost: list[str] = []
    with warnings.catch_warnings():  # the main thread's own save and restore, around it all
        thread = threading.Thread(target=run)
        thread.start()
        try:
            mine: list[str] = []
            while len(mine) < 300 and not lost:
                assert decoded.acquire(timeout=60), "the decode thread made no progress in 60 s"
                if stop.is_set():
                    break
                mine.append(f"gpucache test filter {len(mine)}")
                warnings.filterwarnings("ignore", message=mine[-1])
                # a snapshot (one C call): iterating the live list while the other thread
                # moves a filter to the front would skip an entry that is there
                present = {f[1].pattern for f in tuple(warnings.filters) if f[1] is not None}
                lost = [m for m in mine if m not in present]
        finally:
            stop.set()
            thread.join(timeout=60)
    assert not thread.is_alive() and not errors, errors
    assert not lost, f"filters of the main thread lost while another thread decoded: {lost[:3]}"


def test_torchvisions_notice_never_reaches_the_user(monkeypatch, jpeg_folder):
    """With the strictest filter of the user's ("error" for every warning), decoding with
    torchvision's decoders through the loader neither raises nor shows the notice."""
    from gpucache.decode import _jpeg
    from gpucache.decode.gpu import _batched
    from tests.support.emulated_cuda import EmulatedCuda

    def no_torchcodec(device):
        raise ImportError("TorchCodec left out by the test")

    monkeypatch.setattr(_jpeg, "_codec_decode_jpeg", None)  # the CPU path: torchvision's
    monkeypatch.setattr(_batched, "torchcodec_decoder", no_torchcodec)
    cache = JpegCache.from_folder(jpeg_folder, progress=False)
    tf = T.RandomResizedCrop(24)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("error")
        for kw in (
            dict(device="cpu", backend="cpu", num_workers=0),
            dict(device="cuda", backend="nvjpeg"),
        ):
            with EmulatedCuda(devices=1) if kw["device"] == "cuda" else contextlib.nullcontext():
                with GpuCachedLoader(cache, batch_size=8, seed=0, transform=tf, **kw) as loader:
                    assert sum(len(y) for _, y in loader) == len(cache)
                    assert loader.stats.skipped == 0
    assert not [w for w in seen if issubclass(w.category, DeprecationWarning)], seen


def test_the_stores_read_only_view_warns_nobody_and_keeps_every_filter(tmp_path):
    """The first byte view of a store (made in a decode thread by the nvjpeg backend) silences
    torch's read-only-buffer notice by one scoped filter, never by swapping the filter list:
    with warnings as errors it does not raise, and the filters the main thread adds while
    another thread makes views all stay (``catch_warnings`` there would restore a list that
    lacks them)."""
    import subprocess
    import sys

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.jpg").write_bytes(make_jpeg_bytes(32, 24, seed=2))
    code = (
        "import sys, threading, warnings\n"
        "from gpucache import JpegCache\n"
        f"cache = JpegCache.from_folder({str(tmp_path)!r}, progress=False)\n"
        "sys.setswitchinterval(1e-5)\n"
        "stop, made, errors = threading.Event(), [0], []\n"
        "def views():\n"
        "    try:\n"
        "        while not stop.is_set():\n"
        "            cache._tensor = None  # each call makes the view anew\n"
        "            assert len(cache._bytes_tensor(0)) > 0\n"
        "            made[0] += 1\n"
        "    except BaseException as err:\n"
        "        errors.append(repr(err)); stop.set()\n"
        "t = threading.Thread(target=views); t.start()\n"
        "mine, lost = [], []\n"
        "while (len(mine) < 2000 or made[0] < 2000) and not stop.is_set() and not lost:\n"
        "    mine.append(f'mine {len(mine)}')\n"
        "    warnings.filterwarnings('ignore', message=mine[-1])\n"
        "    snapshot = tuple(warnings.filters)  # the live list may shift under a loop\n"
        "    present = {f[1].pattern for f in snapshot if f[1] is not None}\n"
        "    lost = [m for m in mine if m not in present]\n"
        "stop.set(); t.join()\n"
        "assert not errors, errors\n"
        "assert not lost, f'filters lost while another thread made views: {lost[:3]}'\n"
        "print('ok', made[0])\n"
    )
    run = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stderr[-2000:]
