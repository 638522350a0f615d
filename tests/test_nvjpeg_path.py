"""The nvjpeg backend's device-agnostic code on CPU tensors: staging, batched decode, plans,
fallback join and ordering, EXIF orientation after a decoder that ignores it, the pixel budget, and
the hand-over rule on a non-CPU device (meta). The CUDA branches (decode/gpu/_streams.CudaStreams,
device indices) run under EmulatedCuda in tests/test_emulated_cuda.py; tests/gpu/ runs them on CUDA."""

import numpy as np
import pytest
import torch

from gpucache import GpuCachedLoader, JpegCache, SampleError
from gpucache import transforms as T
from gpucache.decode._core import decode_batch
from gpucache.decode._options import DecodeOptions
from gpucache.decode.gpu._batched import default_decoder, make_decoder, torchvision_decoder
from gpucache.decode.gpu._nvjpeg import NvjpegBackend
from gpucache.decode.gpu._streams import HostStreams
from gpucache.ingest._sniff import Kind
from gpucache.testing import make_jpeg_bytes
from gpucache.transforms._orientation import orient

CPU = torch.device("cpu")


def _within_one_level(images, ref) -> None:
    """The batched transforms compute in float (as on CUDA); the CPU backend's per-image resize
    in fixed point: the two agree within one level."""
    assert images.shape == ref.shape
    assert (images.int() - ref.int()).abs().max() <= 1


def _progressive(cache, idx) -> int:
    return int((cache.samples["kind"][idx] == Kind.JPEG_PROGRESSIVE).sum())


def _plans(cache, indices, seed=0):
    compose = T.Compose([T.RandomResizedCrop(48), T.RandomHorizontalFlip()])
    s = cache.samples
    return compose.plan(
        s["height"][indices].astype(np.int64),
        s["width"][indices].astype(np.int64),
        np.random.default_rng(seed),
    )


def test_matches_cpu_backend_and_keeps_order(jpeg_folder):
    cache = JpegCache.from_folder(jpeg_folder, progress=False)
    backend = NvjpegBackend(cache, device=CPU)
    batches = [np.arange(k, k + 6) for k in range(0, 18, 6)]
    refs = [
        decode_batch(cache, idx, _plans(cache, idx, b), stack=True) for b, idx in enumerate(batches)
    ]
    for b, idx in enumerate(batches):  # three batches in flight before the first is taken
        backend.submit(idx, _plans(cache, idx, b), stack=True)
    assert len(backend) == 3
    for b, idx in enumerate(batches):
        got = backend.get()
        ref = refs[b]
        assert np.array_equal(got.indices, idx)
        _within_one_level(got.images, ref.images)
        cmyk = int((cache.samples["components"][idx] == 4).sum())
        # CMYK and progressive took the CPU path, the rest the batched decoder
        assert got.cpu_decoded == cmyk + _progressive(cache, idx)
    assert len(backend) == 0
    backend.close()
    backend.close()


def test_fallback_join_for_png_cmyk_and_corrupt(bad_folder):
    cache = JpegCache.from_files(sorted(bad_folder["cases"]), progress=False)
    idx = np.arange(len(cache))
    plans = T.Compose([T.Resize((24, 24))]).plan(
        cache.samples["height"].astype(np.int64),
        cache.samples["width"].astype(np.int64),
        np.random.default_rng(0),
    )
    ref = decode_batch(cache, idx, plans, stack=True)
    backend = NvjpegBackend(cache, device=CPU)
    backend.submit(idx, plans, stack=True)
    out = backend.get()
    corrupt = [i for i, p in enumerate(cache.paths) if p.endswith("corrupt_scan.jpg")]
    assert [i for i, _ in out.failed] == corrupt and "could not be decoded" in out.failed[0][1]
    assert out.indices.tolist() == [i for i in idx.tolist() if i not in corrupt]
    assert out.images.shape == (len(cache) - 1, 3, 24, 24)
    non_gpu = (~cache.gpu_decodable()).sum()
    assert out.cpu_decoded == non_gpu + _progressive(cache, idx)
    _within_one_level(out.images, ref.images)
    strict = NvjpegBackend(cache, options=DecodeOptions(on_error="raise"), device=CPU)
    strict.submit(idx, plans, stack=False)  # decoded in the background thread
    with pytest.raises(SampleError, match="corrupt_scan.jpg"):
        strict.get()
    assert not strict.thread_alive and len(strict) == 0  # an error stops the thread


def test_list_output_when_sizes_vary(jpeg_folder):
    cache = JpegCache.from_folder(jpeg_folder, progress=False)
    idx = np.arange(5)
    plans = T.Compose([T.Resize(40)]).plan(
        cache.samples["height"][idx].astype(np.int64),
        cache.samples["width"][idx].astype(np.int64),
        np.random.default_rng(0),
    )
    backend = NvjpegBackend(cache, device=CPU)
    backend.submit(idx, plans, stack=False)
    out = backend.get()
    assert isinstance(out.images, list) and [min(im.shape[1:]) for im in out.images] == [40] * 5


def test_auto_selection_and_device_errors(jpeg_folder):
    cache = JpegCache.from_folder(jpeg_folder, progress=False)
    loader = GpuCachedLoader(cache, batch_size=4, device="cpu")
    assert loader.backend_name == "cpu"
    with pytest.raises(ValueError, match="backend='nvjpeg'.*CUDA"):
        GpuCachedLoader(cache, batch_size=4, device="cpu", backend="nvjpeg")
    from gpucache.decode import resolve

    assert resolve("auto", torch.device("cuda")) == "nvjpeg"  # DALI installed or not
    assert resolve("auto", CPU) == "cpu"


# ---------------------------------------------------------------- EXIF, hand-over, pixel budget
def _tv_decode(data, exif):
    import warnings

    from torchvision.io import ImageReadMode, decode_jpeg

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return decode_jpeg(data, mode=ImageReadMode.RGB, apply_exif_orientation=exif)


def test_orient_is_the_exif_transform_for_all_8_orientations():
    for o in range(1, 9):
        data = torch.frombuffer(
            bytearray(make_jpeg_bytes(40, 24, seed=o, exif_orientation=o)), dtype=torch.uint8
        )
        raw, shown = _tv_decode(data, False), _tv_decode(data, True)
        assert raw.shape[1:] == (24, 40)
        assert torch.equal(orient(raw, o), shown), o


@pytest.fixture(scope="module")
def rotated(tmp_path_factory):
    """Every EXIF orientation, non-square and square (a square rotated image keeps its size)."""
    root = tmp_path_factory.mktemp("rotated")
    paths = []
    for o in range(1, 9):
        for w, h in ((56, 32), (40, 40)):
            paths.append(root / f"o{o}_{w}x{h}.jpg")
            paths[-1].write_bytes(make_jpeg_bytes(w, h, seed=o * w, exif_orientation=o))
    return JpegCache.from_files(paths, progress=False)


def test_decoder_that_ignores_exif_still_orients_every_sample(rotated):
    """torchvision's CUDA decode_jpeg ignores EXIF; emulated by its CPU decode without it."""
    emulated = torchvision_decoder(CPU)
    assert not emulated.applies_exif  # measured by decoding a tagged probe, not assumed
    idx = np.arange(len(rotated))
    plans = _plans(rotated, idx)
    ref = decode_batch(rotated, idx, plans, DecodeOptions(on_error="raise"), stack=True)
    for decoder in (emulated, default_decoder(CPU)):
        backend = NvjpegBackend(
            rotated, options=DecodeOptions(on_error="raise"), device=CPU, decoder=decoder
        )
        backend.submit(idx, plans, stack=True)
        out = backend.get()
        backend.close()
        assert out.failed == [] and out.cpu_decoded == 0, decoder.name
        _within_one_level(out.images, ref.images)


def _emulated_gpu_decoder(device, rejects=()):
    """A decoder "on" ``device`` (meta: not the CPU, like CUDA) that rejects the JPEGs whose
    bytes are in ``rejects``, as nvJPEG rejects some JPEGs that libjpeg-turbo decodes; it ignores
    EXIF like torchvision's."""
    rejects = set(rejects)

    def decode(data):
        if any(bytes(d.numpy()) in rejects for d in data):
            raise RuntimeError("emulated nvJPEG: unsupported JPEG")
        return [x.to(device) for x in _tv_decode(data, False)]

    return make_decoder("emulated-gpu", device, decode)


def test_cpu_retry_result_reaches_hand_over_on_the_device(jpeg_folder):
    cache = JpegCache.from_folder(jpeg_folder, progress=False)
    meta = torch.device("meta")
    progressive = int((cache.samples["kind"] == Kind.JPEG_PROGRESSIVE).sum())
    assert progressive >= 1
    gray = [cache[i].tobytes() for i in np.flatnonzero(cache.samples["components"] == 1)]
    assert gray  # rejected by the decoder, rescued on the CPU
    backend = NvjpegBackend(
        cache,
        options=DecodeOptions(on_error="raise"),
        device=meta,
        decoder=_emulated_gpu_decoder(meta, gray),
    )
    idx = np.arange(len(cache))
    backend.submit(idx, _plans(cache, idx), stack=True)
    out = backend.get()  # the hand-over checks every tensor is on the device, as CUDA needs
    assert out.images.device == meta and out.images.shape == (len(cache), 3, 48, 48)
    cmyk = int((cache.samples["components"] == 4).sum())
    gray_seq = int(
        (
            (cache.samples["components"] == 1) & (cache.samples["kind"] != Kind.JPEG_PROGRESSIVE)
        ).sum()
    )
    assert gray_seq >= 1
    assert out.cpu_decoded == progressive + cmyk + gray_seq and out.failed == []
    with pytest.raises(RuntimeError, match="moved to the device first"):
        HostStreams(meta).hand_over(None, [torch.zeros(1)])


def test_pixel_budget_refuses_before_any_decoder(jpeg_folder):
    cache = JpegCache.from_folder(jpeg_folder, progress=False)
    s = cache.samples
    pixels = s["height"].astype(np.int64) * s["width"]
    cache.max_pixels = int(pixels[s["components"] == 4].min()) - 1  # the CMYK sample is refused
    over = set(np.flatnonzero(pixels > cache.max_pixels).tolist())
    assert 0 < len(over) < len(cache)
    assert any((s["components"] == 4) & (pixels > cache.max_pixels))  # a CPU-path sample too
    seen = []
    real = torchvision_decoder(CPU)
    spy = make_decoder(
        "spy", CPU, lambda data: seen.extend(len(d) for d in data) or real.decode(data)
    )
    idx = np.arange(len(cache))
    backend = NvjpegBackend(cache, device=CPU, decoder=spy)
    backend.submit(idx, _plans(cache, idx), stack=True)
    out = backend.get()
    assert {i for i, _ in out.failed} == over
    assert all("max_pixels" in why for _, why in out.failed)
    assert sorted(out.indices.tolist() + sorted(over)) == idx.tolist()
    decoded_sizes = sorted(seen[1:])  # the first call is the EXIF probe
    cpu_path = (s["components"] == 4) | (s["kind"] == Kind.JPEG_PROGRESSIVE)
    assert decoded_sizes == sorted(
        len(cache[i]) for i in idx.tolist() if i not in over and not cpu_path[i]
    )
    assert out.cpu_decoded == int((cpu_path & (pixels <= cache.max_pixels)).sum())
    strict = NvjpegBackend(cache, options=DecodeOptions(on_error="raise"), device=CPU, decoder=spy)
    strict.submit(idx, _plans(cache, idx), stack=True)
    with pytest.raises(SampleError, match="max_pixels"):
        strict.get()


def test_out_of_memory_inside_the_batched_decode_is_never_a_bad_sample(jpeg_folder):
    """torchvision catches std::exception in its CUDA batched decode and rethrows it as
    RuntimeError("Error while decoding JPEG images: CUDA out of memory ..."): it must reach the
    user as torch.OutOfMemoryError with advice, without per-image retries or the CPU."""
    cache = JpegCache.from_folder(jpeg_folder, progress=False)
    calls = []

    def oom(data):
        calls.append(len(data))
        raise RuntimeError(
            "Error while decoding JPEG images: CUDA out of memory. Tried to "
            "allocate 20.00 MiB (GPU 0; 79.11 GiB total capacity)"
        )

    idx = np.arange(8)
    for threaded in (True, False):
        calls.clear()
        backend = NvjpegBackend(
            cache,
            device=CPU,
            threaded=threaded,
            decoder=make_decoder("oom", CPU, oom, applies_exif=False),
        )
        with pytest.raises(
            torch.OutOfMemoryError,
            match="ran out of memory.*lower batch_size.*Tried to allocate 20.00 MiB",
        ):
            backend.submit(idx, _plans(cache, idx), stack=True)
            backend.get()
        assert len(calls) == 1 and calls[0] > 1  # one batched call, no retry one by one
        backend.close()
