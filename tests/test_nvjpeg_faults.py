"""The nvjpeg backend against the machine's faults, on the emulated CUDA and on the CPU device:
nvJPEG's own allocator failing (status 5) is out of memory, never a bad sample, after one
emptying of torch's cache and one retry of the batch; out of memory in the EXIF probe at
construction; an autocast region around the synchronous path; the CPU stage's threads."""

import logging
import os

import numpy as np
import pytest
import torch

from gpucache import JpegCache
from gpucache import transforms as T
from gpucache.decode._core import decode_batch
from gpucache.decode._options import DecodeOptions
from gpucache.decode.gpu._batched import make_decoder, torchvision_decoder
from gpucache.decode.gpu._faults import allocator_failure
from gpucache.decode.gpu._nvjpeg import NvjpegBackend, default_cpu_threads
from gpucache.ingest._sniff import Kind
from gpucache.testing import make_jpeg_folder
from tests.support.emulated_cuda import EmulatedCuda
from tests.support.emulated_nvjpeg import DECODER_BYTES

CPU = torch.device("cpu")
MiB = 2**20


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """Synthetic photos, most of them baseline JPEGs (the nvJPEG path)."""
    root = make_jpeg_folder(tmp_path_factory.mktemp("faults"), 12, classes=("a",), seed=5)
    return JpegCache.from_folder(root, progress=False)


def _batch(cache, n=4, tf=None):
    on_gpu = np.flatnonzero(cache.gpu_decodable() & (cache.samples["kind"] == Kind.JPEG))[:n]
    assert len(on_gpu) == n
    s = cache.samples
    tf = tf or T.Compose([T.RandomResizedCrop(24), T.RandomHorizontalFlip()])
    plans = tf.plan(
        s["height"][on_gpu].astype(np.int64),
        s["width"][on_gpu].astype(np.int64),
        np.random.default_rng(0),
    )
    return on_gpu, plans


def _work(cache, idx):
    s = cache.samples
    return int((3 * s["height"][idx].astype(np.int64) * s["width"][idx]).sum())


@pytest.mark.parametrize(
    "message",
    [
        "Error while decoding JPEG images: Failed to decode batch: 5",
        "Error while decoding JPEG images: Failed to initialize batch decoding: 5",
        "Error while decoding JPEG images: Failed to decode jpeg stream: 5",
    ],
)
def test_status_5_is_the_decoders_allocator(message):
    assert allocator_failure(RuntimeError(message))
    assert not allocator_failure(RuntimeError(message[:-1] + "7"))  # another status
    assert not allocator_failure(RuntimeError(message + "1"))  # status 51
    # nvJPEG that cannot start is a broken setup, said so elsewhere
    assert not allocator_failure(
        RuntimeError("Failed to initialize nvjpeg with hardware backend: 5")
    )


def test_status_5_empties_torchs_cache_once_and_the_batch_decodes(cache, caplog):
    """torch's cache holds the memory nvJPEG's cudaMalloc needs: emptied once, the batch
    decodes on the GPU, with no sample retried alone or on the CPU."""
    idx, plans = _batch(cache)
    held = 4 * MiB
    total = DECODER_BYTES + held + _work(cache, idx) // 2
    with EmulatedCuda(devices=1, total_memory=total) as emu:
        dev = torch.device("cuda", 0)
        backend = NvjpegBackend(cache, device=dev, decoder=torchvision_decoder(dev))
        x = torch.empty(held, dtype=torch.uint8, device=dev)
        del x  # cached by torch's allocator, not used
        with caplog.at_level(logging.WARNING, logger="gpucache"):
            backend.submit(idx, plans, True)
            got = backend.get()
        assert emu.empty_caches == 1 and emu.decode_calls == 2
        assert got.cpu_decoded == 0 and not got.failed and np.array_equal(got.indices, idx)
        images = got.images.cpu()
        backend.close()
    assert not [r for r in caplog.records if "could not decode" in r.getMessage()]
    ref = decode_batch(cache, idx, plans, DecodeOptions(on_error="raise"), stack=True)
    assert (images.float() - ref.images.float()).abs().max() <= 1


@pytest.mark.parametrize("how", ["memory in use", "always"])
def test_status_5_again_is_out_of_memory_not_bad_samples(cache, how):
    """After one emptying and one retry of the batch: torch.OutOfMemoryError with the advice,
    and no sample decoded alone (the decoder saw two calls) or on the CPU."""
    idx, plans = _batch(cache)
    held = 4 * MiB
    kw = (
        {"total_memory": DECODER_BYTES + held + _work(cache, idx) // 2}
        if how == "memory in use"
        else {"decoder_fault": "alloc"}
    )
    with EmulatedCuda(devices=1, **kw) as emu:
        dev = torch.device("cuda", 0)
        backend = NvjpegBackend(cache, device=dev, decoder=torchvision_decoder(dev))
        x = torch.empty(held, dtype=torch.uint8, device=dev)  # in use: emptying frees nothing
        backend.submit(idx, plans, True)
        with pytest.raises(torch.OutOfMemoryError) as info:
            backend.get()
        assert emu.empty_caches == 1 and emu.decode_calls == 2
        backend.close()
        del x
    text = str(info.value)
    assert "status 5" in text and "retrying once" in text and "lower batch_size" in text
    assert ": 5" in text.rsplit("The allocator said:", 1)[1]


@pytest.mark.parametrize("fault", ["oom", "alloc"])
def test_out_of_memory_in_the_exif_probe_is_said_so(cache, fault):
    """A decoder whose EXIF handling is unknown is probed at construction: out of memory there
    is torch.OutOfMemoryError with advice too, not a bare RuntimeError."""
    with EmulatedCuda(devices=1, decoder_fault=fault) as emu:
        dev = torch.device("cuda", 0)
        probed = make_decoder("custom", dev, torchvision_decoder(dev).decode)
        with pytest.raises(torch.OutOfMemoryError, match="EXIF orientation.*lower batch_size"):
            NvjpegBackend(cache, device=dev, decoder=probed)
        assert emu.decode_calls == (2 if fault == "alloc" else 1)


def test_autocast_around_the_synchronous_path_leaves_the_pixels_alone(cache):
    """threaded=False runs the transforms on the caller's thread: a bfloat16 autocast region
    there must not reach the batched resize's matrix products."""
    idx, plans = _batch(cache, 8, T.Compose([T.RandomResizedCrop(40)]))
    backend = NvjpegBackend(
        cache, options=DecodeOptions(on_error="raise"), device=CPU, threaded=False
    )
    backend.submit(idx, plans, True)
    ref = backend.get().images
    with torch.autocast("cpu", dtype=torch.bfloat16):
        backend.submit(idx, plans, True)
        got = backend.get().images
    backend.close()
    assert got.dtype == torch.uint8 and torch.equal(got, ref)


@pytest.mark.parametrize(
    "cores, machine, ranks, want",
    [(16, 16, None, 14), (2, 2, None, 2), (16, 16, "4", 2), (8, 32, "4", 6), (64, 64, "2", 30)],
)
def test_the_cpu_stage_scales_with_the_ranks_cores(cache, monkeypatch, cores, machine, ranks, want):
    """The rank's share of the cores (its affinity, divided among the node's ranks when each
    sees every core) less two, at least 2."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: machine)
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_RANK", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(name, raising=False)
    if ranks is not None:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
        monkeypatch.setenv("LOCAL_RANK", "0")
    assert default_cpu_threads() == want
    backend = NvjpegBackend(cache, options=DecodeOptions(on_error="raise"), device=CPU)
    assert backend.cpu_threads == want and backend._pools["cpu"]._max_workers == want
    backend.close()


def test_a_batchs_cpu_samples_split_among_threads_keep_their_order(jpeg_folder):
    """Progressive, CMYK and gray samples take the CPU stage in chunks, one a thread: joined in
    batch order, the same as the synchronous path."""
    cache = JpegCache.from_folder(jpeg_folder, progress=False)
    idx = np.arange(len(cache))
    s = cache.samples
    plans = T.Compose([T.RandomResizedCrop(24)]).plan(
        s["height"][idx].astype(np.int64),
        s["width"][idx].astype(np.int64),
        np.random.default_rng(1),
    )
    sync = NvjpegBackend(cache, device=CPU, threaded=False)
    threaded = NvjpegBackend(cache, device=CPU, cpu_threads=3)
    assert (~threaded.gpu_mask).sum() >= 3  # the stage has something to split
    for be in (sync, threaded):
        be.submit(idx, plans, True)
    ref, got = sync.get(), threaded.get()
    sync.close()
    threaded.close()
    assert np.array_equal(ref.indices, got.indices) and torch.equal(ref.images, got.images)
    assert ref.cpu_decoded == got.cpu_decoded > 0 and got.times["fallback"] > 0
