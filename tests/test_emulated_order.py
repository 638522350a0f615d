"""EmulatedCuda's stream-order rules (tests/support/emulated_cuda.py): happens-before between streams,
the caching allocator's reuse of freed blocks, pinned and non_blocking copies, host syncs, the
emulated nvJPEG decoder (private stream, faults, rebuilds), and three mutations of the stream
helper that each make the real nvjpeg backend fail."""

import contextlib
import re
import threading

import numpy as np
import pytest
import torch

from gpucache import JpegCache
from gpucache import transforms as T
from gpucache.decode._jpeg import quiet_torchvision_deprecation
from gpucache.decode._options import DecodeOptions
from gpucache.decode.gpu import _streams
from gpucache.decode.gpu._batched import torchvision_decoder
from gpucache.decode.gpu._nvjpeg import NvjpegBackend
from gpucache.testing import make_jpeg_bytes
from tests.support.emulated_cuda import EmulatedCuda, StreamOrderError

TF = T.Compose([T.RandomResizedCrop(24), T.RandomHorizontalFlip()])


def _violation(emu, match: str):
    """The emulation's violations so far (cleared), after checking there is one matching."""
    found = list(emu.violations)
    emu.violations.clear()
    assert found and any(re.search(match, str(v)) for v in found), found
    return found


# ------------------------------------------------------------------ happens-before
def test_a_read_on_another_stream_needs_a_wait():
    with EmulatedCuda(devices=2) as emu:
        a, b = torch.cuda.Stream(), torch.cuda.Stream()
        with torch.cuda.stream(a):
            x = torch.ones(64, device="cuda")
        with (
            torch.cuda.stream(b),
            pytest.raises(
                StreamOrderError,
                match=r"reads .* on stream 'b' .*written by "
                r"ones on stream 'a'.*wait",
            ),
        ):
            x + 1
        _violation(emu, "stream 'b'")
        b.wait_stream(a)
        with torch.cuda.stream(b):
            y = x * 2  # ordered now
        a.wait_stream(b)  # before a writes what b read
        event = torch.cuda.Event()
        with torch.cuda.stream(a):
            event.record()  # before the write below: it does not cover it
            x.add_(1)
        with torch.cuda.stream(b), pytest.raises(StreamOrderError, match="written by add_"):
            x.sum()
        _violation(emu, "add_")
        event.record(a)
        b.wait_event(event)
        with torch.cuda.stream(b):
            x.sum()
        with (
            torch.cuda.stream(a),
            pytest.raises(
                StreamOrderError,
                match=r"writes .* stream 'b' .* read it "
                r"\(sum\)",
            ),
        ):
            x.zero_()  # write after b's read, with a never waiting for b
        _violation(emu, "zero_")
        del y


def test_views_and_metadata_are_no_access():
    with EmulatedCuda(devices=2):
        a, b = torch.cuda.Stream(), torch.cuda.Stream()
        with torch.cuda.stream(a):
            x = torch.ones(4, 8, device="cuda")
        with torch.cuda.stream(b):
            v = x[1:].view(-1).view(3, 8).t()  # no kernel
            assert v.shape == (8, 3) and x.device == torch.device("cuda", 0) and x.dtype
            assert x[:0].sum().item() == 0  # an empty read reads nothing


def test_host_syncs_order_later_work_of_the_same_thread_only():
    with EmulatedCuda(devices=2) as emu:
        a, b = torch.cuda.Stream(), torch.cuda.Stream()
        with torch.cuda.stream(a):
            x = torch.ones(16, device="cuda")
        seen = []

        def other():  # a synchronisation in another thread orders nothing queued here
            torch.cuda.synchronize()
            seen.append(len(emu.host_syncs_in()))

        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert seen == [1] and emu.host_syncs_in(t)[0].reason == "torch.cuda.synchronize"
        with torch.cuda.stream(b), pytest.raises(StreamOrderError):
            x + 1
        _violation(emu, "stream 'b'")
        a.synchronize()  # this thread waited for a: work it queues later runs after
        with torch.cuda.stream(b):
            x + 1


def test_a_violation_caught_by_the_code_is_raised_at_exit():
    with pytest.raises(StreamOrderError, match="caught by the code under test"), EmulatedCuda():
        a = torch.cuda.Stream()
        x = torch.ones(8, device="cuda")
        with torch.cuda.stream(a), contextlib.suppress(RuntimeError):
            x + 1  # swallowed, as a broad except in the code under test would


# ------------------------------------------------------------------ caching allocator
@pytest.mark.parametrize("record", [False, True])
def test_a_block_freed_without_record_stream_is_reused_under_a_pending_read(record):
    """x lives on stream a and is read on stream b; freed, its block goes back to a's pool and
    the next allocation on a of that size gets it. Without record_stream(b) a's write into it
    races with b's read; with it, the allocator waits for b and nothing is flagged."""
    with EmulatedCuda(devices=2) as emu:
        a, b = torch.cuda.Stream(), torch.cuda.Stream()
        with torch.cuda.stream(a):
            x = torch.ones(1000, device="cuda")
        b.wait_stream(a)
        with torch.cuda.stream(b):
            total = x.sum()
        if record:
            x.record_stream(b)
        reuses = emu.reuses
        del x
        with torch.cuda.stream(a):
            if record:
                y = torch.full((1000,), 2.0, device="cuda")
            else:
                with pytest.raises(
                    StreamOrderError,
                    match=r"writes .*reused from a freed "
                    r"tensor.* stream 'b' .* read it "
                    r"\(sum\).*record_stream",
                ):
                    torch.full((1000,), 2.0, device="cuda")
                _violation(emu, "record_stream")
        assert emu.reuses == reuses + 1  # the same block, handed out again
        if record:
            torch.cuda.current_stream().wait_stream(a)
            assert y.sum().item() == 2000.0
        del total


def test_memory_figures_count_live_and_cached_blocks():
    with EmulatedCuda(devices=2) as emu:
        x = torch.empty(1000, dtype=torch.uint8, device="cuda")
        assert emu.memory_allocated() == 1024 and emu.memory_reserved() == 1024
        del x
        assert emu.memory_allocated() == 0 and emu.memory_reserved() == 1024  # cached
        y = torch.empty(600, dtype=torch.uint8, device="cuda")  # best fit: the cached block
        assert emu.memory_reserved() == 1024 and emu.reuses == 1
        assert torch.cuda.get_device_properties(0).total_memory == 80 * 2**30
        del y


# ------------------------------------------------------------------ pinned and non_blocking
def test_non_blocking_copies_from_pinned_memory():
    with EmulatedCuda(devices=2) as emu:
        a, b = torch.cuda.Stream(), torch.cuda.Stream()
        host = torch.arange(256, dtype=torch.float32)
        assert not host.is_pinned()
        pinned = host.pin_memory()
        assert pinned.is_pinned() and pinned[10:].is_pinned() and pinned.pin_memory() is pinned
        assert torch.empty(8, pin_memory=True).is_pinned()
        with emu.count_syncs() as c, torch.cuda.stream(a):
            d = pinned.to("cuda", non_blocking=True)  # queued on a: no host sync
        assert len(c) == 0
        with torch.cuda.stream(b), pytest.raises(StreamOrderError, match="stream 'a'"):
            d.sum()
        _violation(emu, "stream 'b'")
        with pytest.raises(
            StreamOrderError,
            match=r"writes pinned host memory .* may still "
            r"read it on stream 'a'",
        ):
            pinned.fill_(0)  # the copy may not have read it yet
        _violation(emu, "pinned")
        a.synchronize()
        pinned.fill_(0)  # done: the buffer is free again
        b.wait_stream(a)
        with torch.cuda.stream(b):
            assert d.sum().item() == float(sum(range(256)))
        with emu.count_syncs() as c:
            host.to("cuda", non_blocking=True)  # pageable: CUDA stages it, waiting
            pinned.to("cuda")  # blocking
        assert [s.reason for s in c.syncs] == [
            (
                "to: host-to-cuda:0 non_blocking copy from pageable memory (CUDA stages it, waiting "
                "for the stream)"
            ),
            "to: host-to-cuda:0 blocking copy",
        ]
        with emu.count_syncs() as c:
            back = d.to("cpu", non_blocking=True)  # lands in pinned memory, later
        assert len(c) == 0 and back.is_pinned()
        with pytest.raises(StreamOrderError, match="reads pinned host memory"):
            back.numpy()
        _violation(emu, "pinned")
        torch.cuda.current_stream().synchronize()
        assert back.numpy()[255] == 255.0
        with pytest.raises(RuntimeError, match="only dense CPU tensors can be pinned"):
            d.pin_memory()


def test_host_syncs_are_counted_by_kind_and_thread():
    with EmulatedCuda(devices=2) as emu:
        x = torch.arange(6, device="cuda")
        with emu.count_syncs() as c:
            torch.cuda.synchronize()
            torch.cuda.current_stream().synchronize()
            event = torch.cuda.Event()
            event.record()
            event.synchronize()
            x.cpu()
            x[0].item()
            x.tolist()
            bool(x[1])
            x.to("cpu")
            x.nonzero()
            x[x > 2]
            torch.tensor([1.0, 2.0], device="cuda")
            torch.ones(3).to("cuda")
            torch.ones(3).cuda()
            x[torch.tensor([0, 1])]  # a CPU index tensor goes to the device first
            x + 1, x[1:], x.shape  # a kernel, a view, metadata: no sync
            t = threading.Thread(target=lambda: x.sum().item())
            t.start()
            t.join()
        reasons = [s.reason.split(" ")[0].split(":")[0] for s in c.syncs]
        assert reasons == [
            "torch.cuda.synchronize",
            "Stream.synchronize",
            "Event.synchronize",
            "cpu",
            "item",
            "tolist",
            "__bool__",
            "to",
            "nonzero",
            "__getitem__",
            "tensor",
            "to",
            "cuda",
            "__getitem__",
        ], reasons
        assert [s.reason for s in emu.host_syncs_in(t)] == [
            "item of a cuda:0 tensor (device-to-host read)"
        ]  # counted in its own thread only
        assert all(s.thread == threading.current_thread().name for s in c.syncs)
        assert "test_emulated_order.py" in c.syncs[3].where


# ------------------------------------------------------------------ the decoder
@pytest.fixture(scope="module")
def jpeg():
    return torch.frombuffer(bytearray(make_jpeg_bytes(40, 30, seed=1)), dtype=torch.uint8)


def decode_jpeg(*args, **kwargs):
    """torchvision's, looked up at the call (EmulatedCuda patches it inside its block)."""
    import torchvision.io

    quiet_torchvision_deprecation()  # torchvision >= 0.29 points to TorchCodec on every call
    return torchvision.io.decode_jpeg(*args, **kwargs)


def test_decoder_outputs_come_from_a_private_stream(jpeg):
    """Allocated on the current stream, written by nvJPEG's private stream, which the current
    stream then waits for: a second stream must wait for the current one, not only the host."""
    with EmulatedCuda(devices=2) as emu:
        a, b = torch.cuda.Stream(), torch.cuda.Stream()
        with emu.count_syncs() as c, torch.cuda.stream(a):
            (img,) = decode_jpeg([jpeg], device="cuda")
            assert img.shape == (3, 30, 40)
            mean = img.float().mean()  # a waited for it; no host sync (that would order b)
        assert [s.stream for s in c.syncs if "nvJPEG" in s.reason] == [
            "nvJPEG's private stream of cuda:0 (torchvision decoder #1)"
        ] * 2
        with (
            torch.cuda.stream(b),
            pytest.raises(
                StreamOrderError, match="written by nvJPEG decode on nvJPEG's private stream"
            ),
        ):
            img.sum()
        _violation(emu, "private")
        b.wait_stream(a)
        with torch.cuda.stream(b):
            img.sum()
        a.synchronize()
        assert mean.item() > 0
    with EmulatedCuda(devices=2, trust_decoder_sync=True):  # the host sync orders it too
        b = torch.cuda.Stream()
        with torch.cuda.stream(torch.cuda.Stream()):
            (img,) = decode_jpeg([jpeg], device="cuda")
        with torch.cuda.stream(b):
            img.sum()


def test_decoder_writes_into_blocks_freed_with_work_queued_as_released(jpeg):
    """pytorch/vision PR 9606: the outputs may reuse a block whose old tensor still has work
    queued on the current stream, and the private stream does not wait for it. gpucache must
    decode where no such block exists; a caller outside gpucache gets the decoder as fixed."""
    import torchvision.io

    code = (
        "x = torch.ones(3600, dtype=torch.uint8, device='cuda')\n"
        "x.sum()  # still queued on a when x is freed\n"
        "del x\n"
        "torchvision.io.decode_jpeg([jpeg], device='cuda')\n"
    )
    for module, fails in (("gpucache.decode.somewhere", True), ("train", False)):
        with EmulatedCuda(devices=2) as emu:
            a = torch.cuda.Stream()
            scope = {"__name__": module, "torch": torch, "torchvision": torchvision, "jpeg": jpeg}
            with torch.cuda.stream(a):
                if fails:
                    with pytest.raises(
                        StreamOrderError,
                        match=r"nvJPEG decode .* writes .*"
                        r"reused from a freed tensor.* "
                        r"private stream.* stream 'a' "
                        r".* wrote it",
                    ):
                        exec(code, scope)  # noqa: S102 - code "in" a gpucache module
                    _violation(emu, "nvJPEG")
                else:
                    exec(code, scope)  # noqa: S102 - the same code outside gpucache
            assert emu.reuses == 1


def test_decoder_faults(jpeg):
    with EmulatedCuda(devices=2, decoder_fault="oom"), torch.cuda.stream(torch.cuda.Stream()):
        with pytest.raises(RuntimeError) as info:
            decode_jpeg([jpeg], device="cuda")
        assert type(info.value) is RuntimeError  # not torch.OutOfMemoryError
        assert str(info.value).startswith(
            "Error while decoding JPEG images: CUDA out of memory. "
            "Tried to allocate 3.52 KiB. GPU 0 "
        )
    with (
        EmulatedCuda(devices=2, decoder_fault="init") as emu,
        torch.cuda.stream(torch.cuda.Stream()),
    ):
        with pytest.raises(
            RuntimeError, match="^Failed to initialize nvjpeg with hardware backend: 5$"
        ):
            decode_jpeg([jpeg], device="cuda")
        emu.decoder_fault = None  # no decoder was kept: the next call builds one
        assert decode_jpeg([jpeg], device="cuda")[0].shape == (3, 30, 40)
        assert emu.decoder_rebuilds == 0
    with pytest.raises(ValueError, match="decoder_fault"):
        EmulatedCuda(decoder_fault="segfault")


def test_torchvision_rebuilds_its_decoder_when_the_device_differs(jpeg):
    with EmulatedCuda(devices=2) as emu, torch.cuda.stream(torch.cuda.Stream()):
        decode_jpeg([jpeg], device="cuda")
        decode_jpeg([jpeg], device="cuda")
        assert emu.decoder_rebuilds == 0
        decode_jpeg([jpeg], device="cuda:0")  # the same GPU, another torch.device
        decode_jpeg([jpeg], device=torch.device("cuda", 0))
        decode_jpeg([jpeg], device="cuda")
        assert emu.decoder_rebuilds == 2


def test_a_decoders_own_memory_shows_in_mem_get_info_only(jpeg):
    """nvJPEG's buffers are outside torch's caching allocator: a decoder built, one leaked by
    a rebuild and a decoder that leaks every call show in the device's used memory alone."""
    from tests.support.emulated_nvjpeg import DECODER_BYTES

    def used() -> int:
        free, total = torch.cuda.mem_get_info(0)
        return total - free - torch.cuda.memory_reserved(0)

    with EmulatedCuda(devices=2, decoder_leak=1000) as emu, torch.cuda.stream(torch.cuda.Stream()):
        assert used() == 0
        out = decode_jpeg([jpeg], device="cuda:0")
        assert used() == DECODER_BYTES + 1000
        decode_jpeg([jpeg], device="cuda")  # a rebuild: the old decoder's buffers stay
        assert used() == 2 * DECODER_BYTES + 2000 and emu.decoder_rebuilds == 1
        assert out[0].numel() <= torch.cuda.memory_reserved(0) < 2**20  # torch counts its own


# ------------------------------------------------------------------ the nvjpeg backend
@pytest.fixture(scope="module")
def cache(small_folder):
    return JpegCache.from_folder(small_folder, progress=False)  # baseline RGB: all on the GPU


def _two_batches(cache, *, threaded: bool = True):
    """Two batches of the same samples, the second submitted after the first is taken (its
    blocks are freed by then) and nothing read on the host in between; then both read."""
    idx = np.arange(16)
    s = cache.samples
    plans = TF.plan(
        s["height"][idx].astype(np.int64),
        s["width"][idx].astype(np.int64),
        np.random.default_rng(0),
    )
    dev = torch.device("cuda", 0)
    backend = NvjpegBackend(
        cache,
        options=DecodeOptions(on_error="raise"),
        device="cuda",
        threaded=threaded,
        decoder=torchvision_decoder(dev),
    )
    try:
        backend.submit(idx, plans, stack=True)
        first = backend.get()
        backend.submit(idx, plans, stack=True)
        second = backend.get()
        with torch.cuda.device(0):
            return [first.images.cpu(), second.images.cpu()]
    finally:
        backend.close()


def test_the_backend_makes_no_host_sync_on_the_consumer_thread(cache):
    with EmulatedCuda(devices=2) as emu:
        idx = np.arange(8)
        s = cache.samples
        plans = TF.plan(
            s["height"][idx].astype(np.int64),
            s["width"][idx].astype(np.int64),
            np.random.default_rng(0),
        )
        backend = NvjpegBackend(
            cache,
            options=DecodeOptions(on_error="raise"),
            device="cuda",
            decoder=torchvision_decoder(torch.device("cuda", 0)),
        )
        backend.submit(idx, plans, stack=True)
        backend.submit(idx, plans, stack=True)
        with emu.count_syncs() as c:
            for _ in range(2):
                images = backend.get().images
                images.float().mean()  # the training step: queued, not waited for
        backend.close()
        assert len(c) == 0, c
        assert emu.decoder_rebuilds == 0
        decode = [t for t in backend._threads if "decode" in t.name]
        assert decode and all(
            "cudaStreamSynchronize" in r.reason or r.reason == "Stream.synchronize"
            for r in emu.host_syncs_in(decode[0])
        )


def test_the_backend_reports_the_decoders_out_of_memory_as_such(cache):
    """torchvision says it as a plain RuntimeError: the backend raises torch.OutOfMemoryError
    with advice, never retries the samples one by one or on the CPU."""
    idx = np.arange(4)
    s = cache.samples
    plans = TF.plan(
        s["height"][idx].astype(np.int64),
        s["width"][idx].astype(np.int64),
        np.random.default_rng(0),
    )
    with EmulatedCuda(devices=2, decoder_fault="oom"):
        backend = NvjpegBackend(
            cache, device="cuda", decoder=torchvision_decoder(torch.device("cuda", 0))
        )
        backend.submit(idx, plans, stack=True)
        with pytest.raises(
            torch.OutOfMemoryError,
            match="lower batch_size.*Error while decoding JPEG images: CUDA out of memory",
        ):
            backend.get()
        backend.close()


@pytest.mark.parametrize("case", ["normalize", "color_jitter", "ragged_targets"])
def test_the_loader_makes_no_host_sync_per_batch_on_the_training_thread(cache, case):
    """Contract 14: after the first batch (constants made once per device), the training
    thread waits for the device nowhere: batches, labels, ragged targets and transforms are
    only queued (Normalize's mean and std, ColorJitter's factors and the targets cross in
    pinned non_blocking copies)."""
    from gpucache import GpuCachedLoader, with_targets

    steps = [T.RandomResizedCrop(24), T.RandomHorizontalFlip()]
    if case == "color_jitter":
        steps.append(T.ColorJitter(0.4, 0.4, 0.4))
    steps.append(T.Normalize((0.5, 0.5, 0.5), (0.2, 0.2, 0.2)))
    store, extra = cache, {}
    if case == "ragged_targets":
        boxes = [np.full((k % 3, 5), k, np.float32) for k in range(len(cache))]
        store, extra = with_targets(cache, ragged=boxes), {"return_metadata": True}
    with EmulatedCuda(devices=2) as emu:
        with GpuCachedLoader(
            store,
            device="cuda",
            backend="nvjpeg",
            batch_size=8,
            seed=0,
            transform=T.Compose(steps),
            **extra,
        ) as loader:
            batches = iter(loader)
            next(batches)
            with emu.count_syncs() as c:
                got = list(batches)
        assert len(got) == len(loader) - 1 >= 3 and len(c) == 0, c
        if case == "ragged_targets":  # the targets did arrive, on the device, per sample
            info = got[0][2]
            assert len(info.targets) == len(got[0][1]) == 8
            assert all(t.device.type == "cuda" and t.shape[1] == 5 for t in info.targets)


def _hand_over_without_wait(self, event, tensors):
    consumer = _streams.consumer_stream(self.device)
    for t in _streams.check_on_device(tensors, self.device):
        t.record_stream(consumer)


def _adopt_without_wait(self, tensors, ready=None):
    for t in tensors:
        t.record_stream(self.side)


def _decoding_on_side(self):
    return _streams._Decoding(self.side, barrier=self.alloc)


@pytest.mark.parametrize(
    "method, mutant, where",
    [
        (
            "hand_over",
            _hand_over_without_wait,
            r"cpu at .* reads .* on the default stream of cuda:0, last written by .* on stream 'side'",
        ),
        (
            "adopt",
            _adopt_without_wait,
            r"reads .* on stream 'side' .* written by nvJPEG decode on nvJPEG's private stream",
        ),
        (
            "decoding",
            _decoding_on_side,
            r"nvJPEG decode at .* writes .*reused from a freed tensor.* on stream 'side'",
        ),
    ],
    ids=["hand_over-without-wait_event", "adopt-without-wait_stream", "decoding-on-side"],
)
@pytest.mark.parametrize("threaded", [True, False])
def test_each_missing_order_fails_the_backend(cache, monkeypatch, method, mutant, where, threaded):
    """The backend as it is passes; with one CudaStreams method mutated it fails:
    hand_over without the consumer's wait_event (the training stream reads a batch the side
    stream may still write), adopt without the side stream's wait_stream(alloc) (the side stream
    reads decoder outputs only the allocation stream is ordered after), decoding under the side
    stream (nvJPEG's private stream writes blocks freed there while the side stream's work on
    the previous batch may still be queued)."""
    with EmulatedCuda(devices=2) as emu:
        clean = _two_batches(cache, threaded=threaded)
    assert emu.violations == [] and len(clean) == 2
    monkeypatch.setattr(_streams.CudaStreams, method, mutant)
    with pytest.raises(StreamOrderError) as info, EmulatedCuda(devices=2) as emu:
        _two_batches(cache, threaded=threaded)
    assert emu.violations and any(re.search(where, str(v)) for v in emu.violations), emu.violations
    assert info.value is emu.violations[0] or info.value.__cause__ is emu.violations[0]


def test_the_allocation_stream_is_synchronised_before_decoding_even_when_pooled(cache, monkeypatch):
    """torch.cuda.Stream() hands out streams from a round-robin pool (one a priority), so the
    backend's allocation stream may be the very stream a user computes on (a user's stream of
    the backend's priority, from a pool of one here): a block the user's queued kernel still
    writes, freed to that stream's pool, is handed to the decoder's output, which nvJPEG's
    private stream writes at once. The backend synchronises the allocation stream right before
    each decode; without that barrier the emulation sees the race."""
    idx = np.arange(8)
    s = cache.samples
    plans = T.Compose([T.RandomResizedCrop(24)]).plan(
        s["height"][idx].astype(np.int64),
        s["width"][idx].astype(np.int64),
        np.random.default_rng(0),
    )

    def run() -> None:
        with EmulatedCuda(devices=1, stream_pool=1):
            user = torch.cuda.Stream(priority=_streams.STREAM_PRIORITY)
            dev = torch.device("cuda", 0)
            backend = NvjpegBackend(
                cache,
                options=DecodeOptions(on_error="raise"),
                device=dev,
                threaded=False,
                decoder=torchvision_decoder(dev),
            )
            assert backend._streams.side is user  # the pool of one: every stream is the user's
            with torch.cuda.stream(user):
                x = torch.empty(1 << 20, dtype=torch.uint8, device=dev)
                x.fill_(7)  # still queued when freed: the block goes back to user's pool
                del x
            backend.submit(idx, plans, True)
            backend.get().images.cpu()
            backend.close()

    run()
    monkeypatch.setattr(
        _streams.CudaStreams, "decoding", lambda self: _streams._Decoding(self.alloc)
    )  # no barrier
    with pytest.raises(StreamOrderError, match="nvJPEG decode .* writes .*reused from a freed"):
        run()


def test_two_decoding_threads_keep_order_each_under_its_own_allocation_stream(cache, monkeypatch):
    """decode_threads=2 (TorchCodec's default): batches come back in order and equal to one
    thread's, each decoding thread on an allocation stream of its own, no order violation."""
    seen: list[tuple[str, object]] = []
    real = _streams.CudaStreams.decoding

    def spy(self):
        seen.append((threading.current_thread().name, self.alloc))
        return real(self)

    monkeypatch.setattr(_streams.CudaStreams, "decoding", spy)
    s = cache.samples
    batches = [np.arange(k, k + 4) % len(cache) for k in range(0, 32, 4)]
    plans = [
        T.Compose([T.RandomResizedCrop(24)]).plan(
            s["height"][b].astype(np.int64),
            s["width"][b].astype(np.int64),
            np.random.default_rng(k),
        )
        for k, b in enumerate(batches)
    ]
    outs = {}
    for threads in (1, 2):
        seen.clear()
        with EmulatedCuda(devices=1):
            dev = torch.device("cuda", 0)
            backend = NvjpegBackend(
                cache,
                options=DecodeOptions(on_error="raise"),
                device=dev,
                decode_threads=threads,
                decoder=torchvision_decoder(dev),
            )
            for b, p in zip(batches, plans):
                backend.submit(b, p, True)
            got = [backend.get() for _ in batches]
            outs[threads] = [(g.indices.tolist(), g.images.cpu()) for g in got]
            backend.close()
    assert [i for i, _ in outs[2]] == [b.tolist() for b in batches]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(outs[1], outs[2]))
    two = {(name, id(stream)) for name, stream in seen if "decode" in name}
    names = {name for name, _ in two}
    assert len(names) == 2 and len({sid for _, sid in two}) == 2  # one stream a thread
    with pytest.raises(ValueError, match="decode_threads should be >= 1"):
        NvjpegBackend(
            cache, options=DecodeOptions(on_error="raise"), device="cpu", decode_threads=0
        )


def test_a_decoder_that_cannot_start_is_an_error_not_a_bad_sample(cache):
    """nvJPEG failing to initialise would otherwise send every sample to the CPU, one warning
    each, and hide a broken GPU setup behind a slow epoch."""
    idx = np.arange(8)
    s = cache.samples
    plans = T.Compose([T.RandomResizedCrop(24)]).plan(
        s["height"][idx].astype(np.int64),
        s["width"][idx].astype(np.int64),
        np.random.default_rng(0),
    )
    with EmulatedCuda(devices=1, decoder_fault="init"):
        dev = torch.device("cuda", 0)
        backend = NvjpegBackend(cache, device=dev, decoder=torchvision_decoder(dev))
        backend.submit(idx, plans, True)
        with pytest.raises(
            RuntimeError, match="failed to start.*Failed to initialize nvjpeg.*backend='cpu'"
        ):
            backend.get()
        backend.close()


def test_an_emulation_that_fails_to_enter_leaves_nothing_behind(monkeypatch):
    """A block whose entry raises after torch.cuda is patched (here: wrapping the decoder) puts
    back what it patched, so torch.cuda is the real one again and the next block enters."""
    from tests.support import emulated_cuda as _emulated_cuda

    real = torch.cuda.is_available

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(_emulated_cuda, "emulated_decode_jpeg", broken)
    with pytest.raises(RuntimeError, match="boom"):
        with EmulatedCuda(devices=1):
            pass
    monkeypatch.undo()
    assert torch.cuda.is_available is real and EmulatedCuda._active is None
    with EmulatedCuda(devices=1):
        assert torch.cuda.device_count() == 1


@pytest.mark.parametrize("pageable", [False, True])
def test_cpu_path_images_cross_in_one_pinned_copy_without_a_host_sync(
    bad_folder, monkeypatch, pageable
):
    """PNG, CMYK and other CPU-path samples of a batch are stacked on the CPU and cross to the
    device in one pinned non_blocking copy: no thread of the backend waits on the host for
    them (a pageable .to(device) an image synchronised once per image)."""
    cache = JpegCache.from_files(sorted(bad_folder["cases"]), progress=False)
    idx = np.arange(len(cache))
    on_cpu = int((~cache.gpu_decodable()).sum())
    assert on_cpu >= 2
    s = cache.samples
    plans = T.Compose([T.Resize((24, 24))]).plan(
        s["height"].astype(np.int64), s["width"].astype(np.int64), np.random.default_rng(0)
    )
    if pageable:  # the join as it was: a plain .to(device)
        from gpucache.decode.gpu import _fallback

        monkeypatch.setattr(_fallback, "to_device", lambda x, device: x.to(device))
    with EmulatedCuda(devices=1) as emu:
        dev = torch.device("cuda", 0)
        backend = NvjpegBackend(cache, device=dev, decoder=torchvision_decoder(dev))
        backend.submit(idx, plans, True)
        out = backend.get()
        assert out.cpu_decoded >= on_cpu and out.images.shape[0] == len(out.indices)
        backend.close()
        # in any of the backend's threads: the copy was once made in the decode thread
        waits = [h for h in emu.host_syncs if "host-to" in h.reason]
    assert bool(waits) == pageable, waits
