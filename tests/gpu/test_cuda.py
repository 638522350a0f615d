"""CUDA-only checks of the GPU backends. Skipped (with the reason) where CUDA is absent.

benchmarks/gpu_check.py runs the same checks plus throughput and memory on a GPU machine.
"""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available on this machine", allow_module_level=True)

from gpucache import GpuCachedLoader, JpegCache  # noqa: E402
from gpucache import transforms as T  # noqa: E402
from gpucache.decode.cpu import decode_batch  # noqa: E402

BACKENDS = ["nvjpeg"] + (["dali"] if __import__("gpucache").decode.dali_available() else [])


@pytest.fixture(scope="module")
def cache(jpeg_folder):
    return JpegCache.from_folder(jpeg_folder, progress=False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_matches_cpu_decode(cache, backend):
    tf = T.Compose([T.Resize(64), T.CenterCrop(56)])
    loader = GpuCachedLoader(cache, batch_size=8, device="cuda", backend=backend,
                             transform=tf, return_metadata=True, seed=0)
    for images, labels, info in loader:
        assert images.is_cuda and images.dtype == torch.uint8
        idx = info.indices.numpy()
        ref = decode_batch(cache, idx, loader.plans(0, 0, idx), on_error="raise", stack=True)
        diff = (images.cpu().float() - ref.images.float()).abs().mean().item()
        assert diff <= 3.0, diff  # IDCT/upsampling differ by a few levels between decoders


@pytest.mark.parametrize("backend", BACKENDS)
def test_stream_ordering_under_load(cache, backend):
    loader = GpuCachedLoader(cache, batch_size=8, device="cuda", backend=backend, seed=1,
                             transform=T.Compose([T.RandomResizedCrop(32)]))
    ref = [x.sum().item() for x, _ in loader]
    heavy = torch.randn(2048, 2048, device="cuda")
    for _ in range(10):
        loader.set_epoch(0)
        for k, (x, _) in enumerate(loader):
            heavy @ heavy  # keep the consumer stream busy while the next batch decodes
            assert x.sum().item() == ref[k]


def test_gpu_memory_is_flat_across_epochs(cache):
    loader = GpuCachedLoader(cache, batch_size=8, device="cuda", backend="nvjpeg",
                             transform=T.Compose([T.RandomResizedCrop(32)]))
    used = []
    for _ in range(20):
        for _ in loader:
            pass
        torch.cuda.synchronize()
        used.append(torch.cuda.memory_allocated())
    assert max(used[5:]) <= used[4] * 1.05 + (1 << 20), used
    loader.close()
