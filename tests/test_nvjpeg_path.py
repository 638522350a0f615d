"""The nvjpeg backend's device-agnostic code on CPU tensors: staging, batched decode, plans,
fallback join and ordering. Only the CUDA stream/event lines are left to tests/gpu/."""

import numpy as np
import pytest
import torch

from gpucache import GpuCachedLoader, JpegCache, SampleError
from gpucache import transforms as T
from gpucache.decode.cpu import decode_batch
from gpucache.decode.nvjpeg import NvjpegBackend

CPU = torch.device("cpu")


def _plans(cache, indices, seed=0):
    compose = T.Compose([T.RandomResizedCrop(48), T.RandomHorizontalFlip()])
    s = cache.samples
    return compose.plan(s["height"][indices].astype(np.int64), s["width"][indices].astype(np.int64),
                        np.random.default_rng(seed))


def test_matches_cpu_backend_and_keeps_order(jpeg_folder):
    cache = JpegCache.from_folder(jpeg_folder, progress=False)
    backend = NvjpegBackend(cache, device=CPU, on_error="skip")
    batches = [np.arange(k, k + 6) for k in range(0, 18, 6)]
    for b, idx in enumerate(batches):  # three batches in flight before the first is taken
        backend.submit(idx, _plans(cache, idx, b), stack=True)
    assert len(backend) == 3
    for b, idx in enumerate(batches):
        got = backend.get()
        ref = decode_batch(cache, idx, _plans(cache, idx, b), on_error="skip", stack=True)
        assert np.array_equal(got.indices, idx)
        assert torch.equal(got.images, ref.images), b
        cmyk = int((cache.samples["components"][idx] == 4).sum())
        assert got.cpu_decoded == cmyk  # CMYK took the CPU path, the rest the batched decoder
    assert len(backend) == 0
    backend.close()
    backend.close()


def test_fallback_join_for_png_cmyk_and_corrupt(bad_folder):
    cache = JpegCache.from_files(sorted(bad_folder["cases"]), progress=False)
    idx = np.arange(len(cache))
    plans = T.Compose([T.Resize((24, 24))]).plan(cache.samples["height"].astype(np.int64),
                                                 cache.samples["width"].astype(np.int64),
                                                 np.random.default_rng(0))
    backend = NvjpegBackend(cache, device=CPU, on_error="skip")
    backend.submit(idx, plans, stack=True)
    out = backend.get()
    corrupt = [i for i, p in enumerate(cache.paths) if p.endswith("corrupt_scan.jpg")]
    assert [i for i, _ in out.failed] == corrupt and "could not be decoded" in out.failed[0][1]
    assert out.indices.tolist() == [i for i in idx.tolist() if i not in corrupt]
    assert out.images.shape == (len(cache) - 1, 3, 24, 24)
    non_gpu = (~cache.gpu_decodable()).sum()
    assert out.cpu_decoded == non_gpu
    ref = decode_batch(cache, idx, plans, on_error="skip", stack=True)
    assert torch.equal(out.images, ref.images)
    strict = NvjpegBackend(cache, device=CPU, on_error="raise")
    with pytest.raises(SampleError, match="corrupt_scan.jpg"):
        strict.submit(idx, plans, stack=False)


def test_list_output_when_sizes_vary(jpeg_folder):
    cache = JpegCache.from_folder(jpeg_folder, progress=False)
    idx = np.arange(5)
    plans = T.Compose([T.Resize(40)]).plan(cache.samples["height"][idx].astype(np.int64),
                                           cache.samples["width"][idx].astype(np.int64),
                                           np.random.default_rng(0))
    backend = NvjpegBackend(cache, device=CPU, on_error="skip")
    backend.submit(idx, plans, stack=False)
    out = backend.get()
    assert isinstance(out.images, list) and [min(im.shape[1:]) for im in out.images] == [40] * 5


def test_auto_selection_and_device_errors(jpeg_folder):
    cache = JpegCache.from_folder(jpeg_folder, progress=False)
    loader = GpuCachedLoader(cache, batch_size=4, device="cpu")
    assert loader.backend_name == "cpu"
    with pytest.raises(ValueError, match="backend='nvjpeg' decodes on a CUDA device"):
        GpuCachedLoader(cache, batch_size=4, device="cpu", backend="nvjpeg")
    from gpucache.decode import resolve

    assert resolve("auto", torch.device("cuda")) in ("dali", "nvjpeg")
    assert resolve("auto", CPU) == "cpu"
