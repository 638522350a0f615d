"""CUDA-only checks of the GPU backends. Skipped (with the reason) where CUDA is absent.

None of these has run on a GPU yet (see README "GPU status"). benchmarks/gpu_check.py runs the
same kinds of checks plus throughput, overlap and memory in one call on a GPU machine.
"""

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available on this machine", allow_module_level=True)

from gpucache import GpuCachedLoader, JpegCache  # noqa: E402
from gpucache import transforms as T  # noqa: E402
from gpucache.decode import dali_available  # noqa: E402
from gpucache.decode._core import decode_batch  # noqa: E402
from gpucache.decode._options import DecodeOptions  # noqa: E402
from gpucache.decode.gpu._batched import default_decoder, make_decoder  # noqa: E402
from gpucache.decode.gpu._nvjpeg import NvjpegBackend  # noqa: E402
from gpucache.testing import make_jpeg_bytes  # noqa: E402

BACKENDS = ["nvjpeg"] + (["dali"] if dali_available() else [])
CUDA = torch.device("cuda", torch.cuda.current_device())
TOLERANCE = 3.0  # mean absolute difference per image, levels (IDCT/upsampling differ)


@pytest.fixture(scope="module")
def cache(jpeg_folder):
    return JpegCache.from_folder(jpeg_folder, progress=False)


def _plans(cache, idx, tf, seed=0):
    s = cache.samples
    return tf.plan(
        s["height"][idx].astype(np.int64),
        s["width"][idx].astype(np.int64),
        np.random.default_rng(seed),
    )


def _assert_close(images, ref):
    for a, b in zip(images, ref):
        assert a.is_cuda and a.shape == b.shape
        assert (a.cpu().float() - b.float()).abs().mean().item() <= TOLERANCE


@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_matches_cpu_decode(cache, backend):
    tf = T.Compose([T.Resize(64), T.CenterCrop(56)])
    loader = GpuCachedLoader(
        cache,
        batch_size=8,
        device="cuda",
        backend=backend,
        transform=tf,
        return_metadata=True,
        seed=0,
    )
    for images, _labels, info in loader:
        idx = info.indices.numpy()
        ref = decode_batch(
            cache, idx, loader.plans(0, 0, idx), DecodeOptions(on_error="raise"), stack=True
        )
        assert images.dtype == torch.uint8
        _assert_close(images, ref.images)
    loader.close()


def test_every_exif_orientation_on_the_gpu_decoder(tmp_path):
    paths = []
    for o in range(1, 9):
        for w, h in ((56, 32), (40, 40)):
            paths.append(tmp_path / f"o{o}_{w}x{h}.jpg")
            paths[-1].write_bytes(make_jpeg_bytes(w, h, seed=o * w, exif_orientation=o))
    rotated = JpegCache.from_files(paths, progress=False)
    idx = np.arange(len(rotated))
    plans = _plans(rotated, idx, T.Compose([T.RandomResizedCrop(24)]))
    backend = NvjpegBackend(rotated, options=DecodeOptions(on_error="raise"), device=CUDA)
    backend.submit(idx, plans, stack=True)
    out = backend.get()
    backend.close()
    assert out.failed == [] and out.cpu_decoded == 0
    _assert_close(
        out.images,
        decode_batch(rotated, idx, plans, DecodeOptions(on_error="raise"), stack=True).images,
    )


def test_cpu_retry_joins_on_the_device(cache):
    """nvJPEG rejecting a sample (emulated for progressive JPEGs) sends it to the CPU decoder;
    its CPU tensor is moved to the device before record_stream."""
    real = default_decoder(CUDA)

    def picky(data):
        if any(b"\xff\xc2" in bytes(d.numpy()) for d in data):
            raise RuntimeError("emulated nvJPEG rejection")
        return real.decode(data)

    idx = np.arange(len(cache))
    plans = _plans(cache, idx, T.Compose([T.RandomResizedCrop(32)]))
    backend = NvjpegBackend(
        cache,
        options=DecodeOptions(on_error="raise"),
        device=CUDA,
        decoder=make_decoder("picky", CUDA, picky),
    )
    backend.submit(idx, plans, stack=True)
    out = backend.get()
    backend.close()
    assert out.images.is_cuda and out.failed == [] and out.cpu_decoded >= 2
    _assert_close(
        out.images,
        decode_batch(cache, idx, plans, DecodeOptions(on_error="raise"), stack=True).images,
    )


def test_unindexed_cuda_device_given_to_decoder_and_backend(cache):
    """torch.device("cuda") for both (what a user, and gpu_check, passes): normalised alike."""
    dev = torch.device("cuda")
    backend = NvjpegBackend(
        cache, options=DecodeOptions(on_error="raise"), device=dev, decoder=default_decoder(dev)
    )
    idx = np.arange(8)
    plans = _plans(cache, idx, T.Compose([T.RandomResizedCrop(32)]))
    backend.submit(idx, plans, True)
    out = backend.get()
    backend.close()
    assert backend.device == CUDA and out.images.device == CUDA
    _assert_close(
        out.images,
        decode_batch(cache, idx, plans, DecodeOptions(on_error="raise"), stack=True).images,
    )


@pytest.mark.parametrize("threaded", [True, False])
def test_busy_side_stream_never_lets_the_decoder_reuse_live_memory(cache, threaded):
    """The side stream is kept busy (not the consumer) and nothing synchronises per step: a
    decoder output allocated over memory the side stream still reads changes the checksums."""
    tf = T.Compose([T.RandomResizedCrop(32), T.RandomHorizontalFlip()])
    batches = [np.arange(k, k + 8) for k in range(0, len(cache) - 7, 8)]
    plans = [_plans(cache, b, tf, k) for k, b in enumerate(batches)]
    ref_backend = NvjpegBackend(
        cache, options=DecodeOptions(on_error="raise"), device=CUDA, threaded=False
    )
    ref = []
    for b, p in zip(batches, plans):
        ref_backend.submit(b, p, True)
        ref.append(ref_backend.get().images.to(torch.int64).sum().item())
        torch.cuda.synchronize()
    backend = NvjpegBackend(
        cache, options=DecodeOptions(on_error="raise"), device=CUDA, threaded=threaded
    )
    side = backend._streams.side
    heavy = torch.randn(4096, 4096, device=CUDA)
    sums = []
    for _ in range(20):
        for _k, (b, p) in enumerate(zip(batches, plans)):
            with torch.cuda.stream(side):
                for _ in range(3):
                    heavy = torch.tanh(heavy @ heavy)
            backend.submit(b, p, True)
            if len(backend) >= 2:
                sums.append(backend.get().images.to(torch.int64).sum())
        while len(backend):
            sums.append(backend.get().images.to(torch.int64).sum())
    backend.close()
    got = [int(s.item()) for s in sums]  # one synchronisation, at the end
    assert got == ref * 20


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_backend_on_another_device_than_the_current_one(cache):
    idx = np.arange(8)
    plans = _plans(cache, idx, T.Compose([T.RandomResizedCrop(32)]))
    dev = torch.device("cuda", 1)
    with torch.cuda.device(0):
        backend = NvjpegBackend(cache, options=DecodeOptions(on_error="raise"), device=dev)
        backend.submit(idx, plans, True)
        out = backend.get()
        backend.close()
    assert out.images.device == dev
    _assert_close(
        out.images,
        decode_batch(cache, idx, plans, DecodeOptions(on_error="raise"), stack=True).images,
    )


def test_gpu_memory_is_flat_across_epochs(cache):
    loader = GpuCachedLoader(
        cache,
        batch_size=8,
        device="cuda",
        backend="nvjpeg",
        transform=T.Compose([T.RandomResizedCrop(32)]),
    )
    used, reserved = [], []
    for _ in range(20):
        for _ in loader:
            pass
        torch.cuda.synchronize()
        used.append(torch.cuda.memory_allocated())
        reserved.append(torch.cuda.memory_reserved())  # each stream keeps its own pool
    assert max(used[5:]) <= used[4] * 1.05 + (1 << 20), used
    assert max(reserved[5:]) <= reserved[4] * 1.05 + (16 << 20), reserved
    loader.close()


@pytest.mark.parametrize("tf32", [False, True])
def test_batched_and_per_image_transforms_agree_with_tf32_off_and_on(cache, tf32):
    """The batched matrix products against the per-image float filter on the same GPU decode:
    at most 1 level apart, TF32 matmuls or not (gpu_check's transforms part does it at scale)."""
    idx = np.arange(len(cache))
    plans = _plans(cache, idx, T.Compose([T.RandomResizedCrop(40), T.RandomHorizontalFlip()]))
    backend = NvjpegBackend(
        cache, options=DecodeOptions(on_error="raise"), device=CUDA, threaded=False
    )
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        backend.submit(idx, plans, True)
        batched = backend.get()
        backend.submit(idx, plans, False)
        single = backend.get()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
        backend.close()
    assert np.array_equal(batched.indices, single.indices)
    d = (batched.images.float() - torch.stack(single.images).float()).abs()
    assert d.max().item() <= 1


def test_autocast_around_the_synchronous_path_leaves_the_pixels_alone(cache):
    idx = np.arange(8)
    plans = _plans(cache, idx, T.Compose([T.RandomResizedCrop(40)]))
    backend = NvjpegBackend(
        cache, options=DecodeOptions(on_error="raise"), device=CUDA, threaded=False
    )
    backend.submit(idx, plans, True)
    ref = backend.get().images
    with torch.autocast("cuda", dtype=torch.bfloat16):
        backend.submit(idx, plans, True)
        got = backend.get().images
    backend.close()
    assert torch.equal(got, ref)


def test_emptying_torchs_cache_between_decodes(cache):
    """What the backend does on nvJPEG's status 5: torch's cached blocks go back, and the
    decoder and the streams work on."""
    backend = NvjpegBackend(cache, options=DecodeOptions(on_error="raise"), device=CUDA)
    idx = np.arange(8)
    plans = _plans(cache, idx, T.Compose([T.RandomResizedCrop(32)]))
    backend.submit(idx, plans, True)
    first = backend.get().images.clone()
    x = torch.empty(64 << 20, dtype=torch.uint8, device=CUDA)
    del x
    before = torch.cuda.memory_reserved(CUDA)
    backend._streams.release_cached()
    assert torch.cuda.memory_reserved(CUDA) <= before - (64 << 20)
    backend.submit(idx, plans, True)
    assert torch.equal(backend.get().images, first)
    backend.close()


@pytest.mark.parametrize("decoders", [1, 2, 4])
def test_concurrent_decoder_calls_give_one_calls_pixels(cache, decoders):
    """The decode stage's sub-batches, decoded at once (TorchCodec: a decoder a call;
    torchvision: queued on its mutex), give the pixels of one call for the whole batch, every
    sample on the GPU decoder, with the backend's streams distinct from one another."""
    idx = np.flatnonzero(cache.gpu_decodable())[:32]
    plans = _plans(
        cache, idx, T.Compose([T.RandomResizedCrop((48, 32)), T.RandomHorizontalFlip(1)])
    )
    ref_backend = NvjpegBackend(
        cache, options=DecodeOptions(on_error="raise"), device=CUDA, decode_threads=1
    )
    ref_backend.submit(idx, plans, stack=True)
    ref = ref_backend.get().images.cpu()
    ref_backend.close()
    backend = NvjpegBackend(
        cache, options=DecodeOptions(on_error="raise"), device=CUDA, decode_threads=decoders
    )
    backend.submit(idx, plans, stack=True)
    out = backend.get()
    mine = backend._streams._mine  # the side stream, the EXIF probe's, each decoding thread's
    assert len({s.cuda_stream for s in mine}) == len(mine) and 2 <= len(mine) <= 2 + decoders
    backend.close()
    assert backend.decoders == decoders and out.failed == []
    assert torch.equal(out.images.cpu(), ref)
