"""The nvjpeg backend's concurrent decode stage and its streams, on the emulated CUDA.

TorchCodec gives each concurrent ``decode_jpeg`` call a decoder of its own, torchvision keeps one
global decoder behind a mutex, and the emulation models both (``tests/support/emulated_nvjpeg.py``):
a batch's sub-batches must decode at once, which the emulation counts (a rendezvous makes the
overlap seen however the threads are scheduled; a decoder that serialises can never meet it). A
status-5 retry waits for the failed call's queued work, and no stream of the backend is the
decoder's or another of its own."""

import threading

import numpy as np
import pytest
import torch

from gpucache import JpegCache
from gpucache import transforms as T
from gpucache.decode._options import DecodeOptions
from gpucache.decode.gpu import _nvjpeg, _streams
from gpucache.decode.gpu._batched import sub_batches, torchcodec_decoder, torchvision_decoder
from gpucache.decode.gpu._nvjpeg import NvjpegBackend
from tests.support.emulated_cuda import EmulatedCuda, StreamOrderError
from tests.support.emulated_nvjpeg import DECODER_BYTES

MiB = 2**20
DEV = torch.device("cuda", 0)


@pytest.fixture(scope="module")
def cache(small_folder):
    return JpegCache.from_folder(small_folder, progress=False)  # baseline RGB: all on the GPU


def _plans(cache, idx, seed=0):
    s = cache.samples
    return T.Compose([T.RandomResizedCrop(24), T.RandomHorizontalFlip()]).plan(
        s["height"][idx].astype(np.int64),
        s["width"][idx].astype(np.int64),
        np.random.default_rng(seed),
    )


def _decoder(name: str):
    return (torchcodec_decoder if name == "torchcodec" else torchvision_decoder)(DEV)


def test_sub_batches_cut_a_batch_in_order_by_pixels():
    cut = sub_batches(np.ones(256), 4)
    assert [(s.start, s.stop) for s in cut] == [(0, 64), (64, 128), (128, 192), (192, 256)]
    # a heavy first half: the first run ends earlier, but keeps the least size
    heavy = np.r_[np.full(16, 9.0), np.ones(16)]
    assert [(s.start, s.stop) for s in sub_batches(heavy, 2)] == [(0, 9), (9, 32)]
    assert [(s.start, s.stop) for s in sub_batches(heavy, 2, least=12)] == [(0, 12), (12, 32)]
    assert sub_batches(np.ones(15), 2) == [slice(0, 15)]  # too small for two of 8
    assert sub_batches(np.ones(40), 1) == [slice(0, 40)]
    for n, m in ((3, 100), (4, 33), (8, 64)):
        cut = sub_batches(np.random.default_rng(n).uniform(1, 9, m), n)
        assert cut[0].start == 0 and cut[-1].stop == m and len(cut) == min(n, m // 8)
        assert all(a.stop == b.start for a, b in zip(cut, cut[1:]))
        assert all(s.stop - s.start >= 8 for s in cut)


def _one_batch(cache, idx, *, decoder: str, decoders: int | None, emu=None, timeout_s=10.0):
    """One threaded batch on the emulated GPU, the rendezvous of two calls armed after the
    backend was made (its EXIF probe is a call of its own)."""
    backend = NvjpegBackend(
        cache,
        options=DecodeOptions(on_error="raise"),
        device=DEV,
        decoder=_decoder(decoder),
        decode_threads=decoders,
    )
    try:
        if emu is not None:
            emu.decode_rendezvous, emu.rendezvous_timeout_s = 2, timeout_s
            emu.decode_overlap = 0
        backend.submit(idx, _plans(cache, idx), True)
        out = backend.get()
        names = sorted({t.name.rsplit("_", 1)[0] for t in backend._threads})
        return out.images.cpu(), out.cpu_decoded, names
    finally:
        backend.close()


def test_torchcodec_decodes_a_batchs_sub_batches_at_once(cache):
    """TorchCodec's default of two decoders: the batch's two sub-batches are decoding at the
    same time (two calls inside the decoder at once), each on a decoder thread of its own, and
    the batch equals the synchronous path's, with no stream-order violation."""
    idx = np.arange(16)
    with EmulatedCuda(devices=1) as emu:
        ref = NvjpegBackend(
            cache,
            options=DecodeOptions(on_error="raise"),
            device=DEV,
            decoder=_decoder("torchcodec"),
            threaded=False,
        )
        ref.submit(idx, _plans(cache, idx), True)
        want = ref.get().images.cpu()
        ref.close()
        images, cpu_decoded, names = _one_batch(
            cache, idx, decoder="torchcodec", decoders=None, emu=emu
        )
        assert emu.rendezvous_met and not emu.rendezvous_missed
        assert emu.decode_overlap >= 2, emu.decode_overlap
        assert emu.codec_decoders_built >= 2  # one decoder a concurrent call
    assert emu.violations == [] and cpu_decoded == 0
    assert "gpucache-nvjpeg-decoder" in names
    assert torch.equal(images, want)


@pytest.mark.parametrize(
    "decoder, decoders, serialise",
    [
        ("torchvision", 2, None),  # its global mutex: sub-batches queue on it
        ("torchcodec", 1, None),  # one call a batch
        ("torchcodec", 2, "one sub-batch"),  # the decode stage no longer splits
        ("torchcodec", 2, "one decoder thread"),  # the sub-batches run one after another
    ],
)
def test_a_decode_stage_that_serialises_never_overlaps(
    cache, monkeypatch, decoder, decoders, serialise
):
    """What the overlap test above guards against: a decoder that serialises calls, or a decode
    stage that makes one call at a time, never has two calls inside at once (the rendezvous
    waits its deadline out and the overlap stays 1), while the pixels stay the same."""
    if serialise == "one sub-batch":
        monkeypatch.setattr(_nvjpeg, "sub_batches", lambda pixels, n: [slice(0, len(pixels))])
    if serialise == "one decoder thread":
        real = NvjpegBackend.__init__

        def one_thread(self, *args, **kwargs):
            real(self, *args, **kwargs)
            if "decoders" in self._pools:
                self._pools["decoders"].shutdown()
                self._pools["decoders"] = _nvjpeg.ThreadPoolExecutor(1, "gpucache-nvjpeg-decoder")

        monkeypatch.setattr(NvjpegBackend, "__init__", one_thread)
    idx = np.arange(16)
    with EmulatedCuda(devices=1) as emu:
        _, cpu_decoded, _ = _one_batch(
            cache, idx, decoder=decoder, decoders=decoders, emu=emu, timeout_s=0.3
        )
        assert emu.rendezvous_missed and emu.decode_overlap == 1
    assert emu.violations == [] and cpu_decoded == 0


def test_decoders_is_one_for_torchvision_and_two_for_torchcodec(cache):
    with EmulatedCuda(devices=1):
        for name, want in (("torchvision", 1), ("torchcodec", 2)):
            backend = NvjpegBackend(
                cache, options=DecodeOptions(on_error="raise"), device=DEV, decoder=_decoder(name)
            )
            assert backend.decoders == want and ("decoders" in backend._pools) == (want > 1)
            backend.close()
        sync = NvjpegBackend(
            cache,
            options=DecodeOptions(on_error="raise"),
            device=DEV,
            decoder=_decoder("torchcodec"),
            threaded=False,
        )
        assert sync.decoders == 1 and not sync._pools
        sync.close()


def _unsynchronised_release(self) -> None:
    with torch.cuda.device(self.device):
        torch.cuda.empty_cache()  # the retry as it was: no wait for the failed call's work


@pytest.mark.parametrize("fixed", [True, False], ids=["synchronised", "not-synchronised"])
@pytest.mark.parametrize("decoder", ["torchcodec", "torchvision"])
def test_a_status_5_retry_waits_for_the_failed_calls_work(cache, monkeypatch, decoder, fixed):
    """nvJPEG's allocator fails (status 5) inside nvjpegDecodeBatched after the call allocated
    its outputs and queued writes into them; the outputs are freed with the writes still
    queued, and torch's cache keeps their small blocks, which the retry's outputs reuse. The
    retry synchronises the device first: TorchCodec's retry takes another decoder (a failed one
    is destroyed), whose engine writes from another stream than the failed one's, so without
    that wait the emulation sees the retry's writes race the failed call's. torchvision's retry
    writes from its one private stream, in order with the failed call's either way."""
    if not fixed:
        monkeypatch.setattr(_streams.CudaStreams, "release_cached", _unsynchronised_release)
    idx = np.arange(8)
    s = cache.samples
    work = int((3 * s["height"][idx].astype(np.int64) * s["width"][idx]).sum())
    held = 8 * MiB
    assert 2 * work < held  # the retry fits once torch's cache gave the held block back
    total = DECODER_BYTES + held + work // 2
    race = decoder == "torchcodec" and not fixed
    with EmulatedCuda(devices=1, total_memory=total, fail_mid_decode=True) as emu:
        backend = NvjpegBackend(cache, device=DEV, decoder=_decoder(decoder), threaded=False)
        x = torch.empty(held, dtype=torch.uint8, device=DEV)
        del x  # cached by torch's allocator, not used
        calls = emu.decode_calls
        backend.submit(idx, _plans(cache, idx), True)
        got = backend.get()
        assert emu.empty_caches == 1 and emu.reuses >= len(idx)
        backend.close()
        if race:
            assert emu.violations and "reused from a freed tensor" in str(emu.violations[0])
            emu.violations.clear()
        else:
            assert emu.decode_calls == calls + 2 and got.cpu_decoded == 0
            syncs = [h for h in emu.host_syncs if h.reason == "torch.cuda.synchronize"]
            assert bool(syncs) == fixed
    assert emu.violations == []


def test_a_violation_of_the_unsynchronised_retry_fails_the_block(cache, monkeypatch):
    """The race above, as CI meets it: the violation the backend swallowed (it retries the
    sub-batch one sample at a time) is raised when the emulated block ends."""
    monkeypatch.setattr(_streams.CudaStreams, "release_cached", _unsynchronised_release)
    idx = np.arange(8)
    s = cache.samples
    work = int((3 * s["height"][idx].astype(np.int64) * s["width"][idx]).sum())
    with pytest.raises(StreamOrderError, match="nvJPEG decode .* writes .*reused from a freed"):
        with EmulatedCuda(
            devices=1, total_memory=DECODER_BYTES + 8 * MiB + work // 2, fail_mid_decode=True
        ):
            backend = NvjpegBackend(
                cache, device=DEV, decoder=_decoder("torchcodec"), threaded=False
            )
            x = torch.empty(8 * MiB, dtype=torch.uint8, device=DEV)
            del x
            backend.submit(idx, _plans(cache, idx), True)
            backend.get()
            backend.close()


def _side_is_the_decoders_stream(cache) -> bool:
    """torch's pool of 2 streams a priority, torchvision's decoder taking its stream from it
    (its builds before the stable-ABI rewrite): after the backend's side and allocation
    streams, the decoder's is the pool's first again."""
    with EmulatedCuda(devices=1, stream_pool=2, decoder_stream_from_pool=True) as emu:
        backend = NvjpegBackend(
            cache,
            options=DecodeOptions(on_error="raise"),
            device=DEV,
            decoder=_decoder("torchvision"),
            threaded=False,
        )
        idx = np.arange(8)
        backend.submit(idx, _plans(cache, idx), True)
        backend.get()
        streams = backend._streams
        private = emu._tv_decoder[1]
        assert streams.alloc is not streams.side
        collides = streams.side is private
        backend.close()
    assert emu.violations == []
    return collides


def test_the_side_stream_is_never_the_decoders(cache, monkeypatch):
    """Decode and transforms would run one after the other on one stream: gpucache's streams
    come from the pool of their own priority, which torchvision's decoder never draws from."""
    assert not _side_is_the_decoders_stream(cache)
    monkeypatch.setattr(_streams, "STREAM_PRIORITY", 0)  # the default pool, as before
    assert _side_is_the_decoders_stream(cache)


def test_no_two_streams_of_a_backend_are_one(monkeypatch):
    """A round-robin pool of 3 streams of gpucache's priority: side, one thread's allocation
    stream, then a stream someone else takes; the next thread's draw comes back to the side
    stream and is drawn again until it is none of the backend's (the other user's here)."""
    with EmulatedCuda(devices=1, stream_pool=3):
        st = _streams.CudaStreams(DEV)
        first = st.alloc
        other = torch.cuda.Stream(priority=_streams.STREAM_PRIORITY)
        got: list = []
        t = threading.Thread(target=lambda: got.append(st.alloc))
        t.start()
        t.join(timeout=30)
        assert got and got[0] is other
        assert len({id(st.side), id(first), id(got[0])}) == 3
