"""The nvjpeg backend's background submission thread, on a CPU device: same batches in the same
order as the synchronous path, errors propagate and stop the thread, close() and garbage
collection stop it. (Speed is benchmarks/overlap.py's job, not a test's.)"""

import gc
import threading

import numpy as np
import pytest
import torch

from gpucache import GpuCachedLoader, JpegCache, SampleError
from gpucache import transforms as T
from gpucache.decode._options import DecodeOptions
from gpucache.decode.gpu._nvjpeg import NvjpegBackend

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def cache(small_folder):
    return JpegCache.from_folder(small_folder, progress=False)


def _run(backend, batches, plans, stack, ahead=3):
    """Drive a backend as the loader does: up to ``ahead`` batches in flight."""
    out, submitted = [], 0
    for b in range(len(batches)):
        while submitted < len(batches) and submitted < b + ahead:
            backend.submit(batches[submitted], plans[submitted], stack)
            submitted += 1
        out.append(backend.get())
    return out


def _threads():
    return [t for t in threading.enumerate() if t.name.startswith("gpucache-nvjpeg")]


@pytest.mark.parametrize("stack", [True, False])
def test_threaded_path_returns_the_same_batches_in_order(cache, stack):
    rng = np.random.default_rng(0)
    order = rng.permutation(len(cache))
    batches = [order[k : k + 7] for k in range(0, len(order), 7)]  # last batch is short
    tf = T.Compose([T.RandomResizedCrop(24), T.RandomHorizontalFlip()] if stack else [T.Resize(30)])
    s = cache.samples
    plans = [
        tf.plan(
            s["height"][b].astype(np.int64),
            s["width"][b].astype(np.int64),
            np.random.default_rng(k),
        )
        for k, b in enumerate(batches)
    ]
    sync = NvjpegBackend(cache, options=DecodeOptions(on_error="raise"), device=CPU, threaded=False)
    threaded = NvjpegBackend(cache, options=DecodeOptions(on_error="raise"), device=CPU)
    ref, got = _run(sync, batches, plans, stack), _run(threaded, batches, plans, stack)
    assert threaded.thread_alive and not sync.thread_alive
    for r, g, b in zip(ref, got, batches):
        assert np.array_equal(g.indices, b) and np.array_equal(r.indices, b)
        if stack:
            assert torch.equal(r.images, g.images)
        else:
            assert all(torch.equal(x, y) for x, y in zip(r.images, g.images))
    threaded.close()
    assert not threaded.thread_alive
    threaded.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        threaded.submit(batches[0], plans[0], stack)


def test_error_propagates_and_stops_the_thread(bad_folder):
    bad = JpegCache.from_files(sorted(bad_folder["cases"]), progress=False)
    corrupt = next(i for i, p in enumerate(bad.paths) if p.endswith("corrupt_scan.jpg"))
    idx = np.arange(len(bad))
    plans = T.Compose([T.Resize((16, 16))]).plan(
        bad.samples["height"].astype(np.int64),
        bad.samples["width"].astype(np.int64),
        np.random.default_rng(0),
    )
    backend = NvjpegBackend(bad, options=DecodeOptions(on_error="raise"), device=CPU)
    good = np.array([i for i in idx if i != corrupt])
    backend.submit(good, plans[good], True)
    backend.submit(idx, plans, True)  # fails in the thread
    backend.submit(good, plans[good], True)  # queued behind the failure: dropped
    assert backend.get().indices.tolist() == good.tolist()
    with pytest.raises(SampleError, match="corrupt_scan.jpg"):
        backend.get()
    assert not backend.thread_alive and len(backend) == 0


def test_drain_and_garbage_collection_stop_work(cache):
    idx = np.arange(8)
    plans = T.Compose([T.Resize((16, 16))]).plan(
        cache.samples["height"][idx].astype(np.int64),
        cache.samples["width"][idx].astype(np.int64),
        np.random.default_rng(0),
    )
    backend = NvjpegBackend(cache, options=DecodeOptions(on_error="raise"), device=CPU)
    for _ in range(4):
        backend.submit(idx, plans, True)
    backend.drain()
    assert len(backend) == 0
    backend.submit(idx, plans, True)
    assert backend.get().indices.tolist() == idx.tolist()
    threads = list(backend._threads)  # the pipeline's stages: decode, transform (no CPU work)
    assert len(threads) >= 2 and all(t.is_alive() for t in threads)
    del backend
    gc.collect()
    for thread in threads:
        thread.join(timeout=10)
        assert not thread.is_alive()


def test_loader_break_and_close_leave_no_thread(cache, monkeypatch):
    """The loader's GPU wiring with the backend swapped in on a CPU device (no CUDA here)."""
    from gpucache.loader import _iteration

    monkeypatch.setattr(
        _iteration,
        "_make_backend",
        lambda ld: NvjpegBackend(ld.cache, options=DecodeOptions(on_error=ld.on_error), device=CPU),
    )
    before = set(_threads())  # an earlier test's thread may still be ending: count only ours
    loader = GpuCachedLoader(
        cache, batch_size=4, device="cpu", seed=0, transform=T.Compose([T.RandomResizedCrop(16)])
    )
    ref = GpuCachedLoader(
        cache, batch_size=4, device="cpu", seed=0, transform=T.Compose([T.RandomResizedCrop(16)])
    )
    for (x, y), (rx, ry) in zip(loader, ref):
        assert torch.equal(x, rx) and torch.equal(y, ry)
    for k, _ in enumerate(loader):  # leave an epoch early, then start another
        if k == 1:
            break
    assert sum(1 for _ in loader) == len(loader)
    loader.close()
    ref.close()
    assert set(_threads()) - before == set()


@pytest.mark.parametrize("prefetch_factor, want", [(2, 3), (5, 5)])
def test_the_loader_keeps_three_batches_in_flight(cache, monkeypatch, prefetch_factor, want):
    """While the loop trains on batch k, batch k+1 is transformed and k+2 decoded: the loader
    holds at least three batches in the GPU backend (prefetch_factor when larger)."""
    from tests.support.emulated_cuda import EmulatedCuda

    in_flight, most = [0], [0]
    submit, get = NvjpegBackend.submit, NvjpegBackend.get

    def counted_submit(self, *args):
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        return submit(self, *args)

    def counted_get(self):
        out = get(self)
        in_flight[0] -= 1
        return out

    monkeypatch.setattr(NvjpegBackend, "submit", counted_submit)
    monkeypatch.setattr(NvjpegBackend, "get", counted_get)
    tf = T.Compose([T.RandomResizedCrop(16)])
    with EmulatedCuda(devices=1):
        with GpuCachedLoader(
            cache,
            batch_size=2,
            device="cuda",
            backend="nvjpeg",
            seed=0,
            transform=tf,
            prefetch_factor=prefetch_factor,
        ) as loader:
            assert len(loader) > want
            assert sum(len(y) for _, y in loader) == len(cache)
    assert most[0] == want and in_flight[0] == 0
