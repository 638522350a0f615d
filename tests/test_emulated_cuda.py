"""The GPU paths' device handling on the CPU, under EmulatedCuda (tests/support/emulated_cuda.py): device
indices as CUDA reports them (``cuda`` -> ``cuda:N``), a non-current GPU, tensors on the wrong
device, stream calls outside the stream helper, the EXIF probe's stream, out-of-memory, a
TorchCodec that cannot load, the launcher's LOCAL_RANK, and the library without tqdm."""

import ast
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from gpucache import GpuCachedLoader, JpegCache
from gpucache import transforms as T
from gpucache.decode._core import decode_batch
from gpucache.decode._device import normalize_device
from gpucache.decode._options import DecodeOptions
from gpucache.decode.gpu._batched import (
    applies_exif,
    default_decoder,
    make_decoder,
    torchvision_decoder,
)
from gpucache.decode.gpu._nvjpeg import NvjpegBackend
from gpucache.decode.gpu._streams import CudaStreams
from tests.support.emulated_cuda import EmulatedCuda

ROOT = Path(__file__).resolve().parents[1]
TF = T.Compose([T.RandomResizedCrop(24), T.RandomHorizontalFlip()])


@pytest.fixture(scope="module")
def cache(jpeg_folder):
    return JpegCache.from_folder(jpeg_folder, progress=False)


def _plans(cache, idx, seed=0):
    s = cache.samples
    return TF.plan(
        s["height"][idx].astype(np.int64),
        s["width"][idx].astype(np.int64),
        np.random.default_rng(seed),
    )


def _close(images, ref) -> None:
    assert images.shape == ref.shape
    assert (images.cpu().float() - ref.float()).abs().mean(dim=(1, 2, 3)).max() <= 1.0


@pytest.mark.parametrize("given, threaded", [("cuda", True), ("cuda", False), ("cuda:1", True)])
def test_nvjpeg_backend_on_indexed_and_unindexed_devices(cache, given, threaded):
    """torch.device("cuda") given to the decoder and the backend alike (what gpu_check did):
    both normalise it to the current GPU; cuda:1 works while cuda:0 is current."""
    idx = np.arange(len(cache))
    plans = _plans(cache, idx)
    ref = decode_batch(cache, idx, plans, DecodeOptions(on_error="raise"), stack=True).images
    with EmulatedCuda(devices=2):
        dev = torch.device(given)
        backend = NvjpegBackend(
            cache,
            options=DecodeOptions(on_error="raise"),
            device=dev,
            threaded=threaded,
            decoder=torchvision_decoder(dev),
        )
        want = normalize_device(dev)
        assert backend.device == want and isinstance(backend._streams, CudaStreams)
        for _ in range(2):
            backend.submit(idx, plans, stack=True)
        for _ in range(2):
            out = backend.get()
            assert out.images.device == want and out.failed == []
            _close(out.images, ref)
        backend.close()


def test_unindexed_device_follows_set_device(cache):
    with EmulatedCuda(devices=2):
        torch.cuda.set_device(1)
        backend = NvjpegBackend(cache, options=DecodeOptions(on_error="raise"), device="cuda")
        assert backend.device == torch.device("cuda", 1)
        backend.submit(np.arange(4), _plans(cache, np.arange(4)), stack=True)
        assert backend.get().images.device == torch.device("cuda", 1)
        backend.close()
        with pytest.raises(ValueError, match="cuda:0.*cuda:1"):
            NvjpegBackend(
                cache,
                options=DecodeOptions(on_error="raise"),
                device="cuda",
                decoder=torchvision_decoder(torch.device("cuda", 0)),
            )


def test_loader_on_emulated_cuda_matches_cpu(cache):
    kw = dict(batch_size=8, seed=0, transform=TF, return_metadata=True)
    with GpuCachedLoader(
        cache, device="cpu", backend="cpu", num_workers=0, exact=True, **kw
    ) as cpu:  # full-size decode, as the GPU decoders do
        ref = [(x, y) for x, y, _ in cpu]
    with EmulatedCuda(devices=2):
        with GpuCachedLoader(cache, device="cuda:1", backend="nvjpeg", **kw) as gpu:
            assert gpu.device == torch.device("cuda", 1) and gpu.pin_memory
            got = list(gpu)
        for (x, y, _info), (rx, ry) in zip(got, ref, strict=True):
            assert x.device == y.device == torch.device("cuda", 1)
            assert torch.equal(y.cpu(), ry)
            _close(x, rx)


def test_emulation_enforces_cuda_device_rules():
    with EmulatedCuda(devices=2):
        a = torch.zeros(4, device="cuda")
        assert a.device == torch.device("cuda", 0) and a.device != torch.device("cuda")
        with pytest.raises(RuntimeError, match="same device.*cuda:0 and cuda:1"):
            a + torch.zeros(4, device="cuda:1")
        with pytest.raises(RuntimeError, match="same device.*cuda:0 and cpu"):
            torch.stack([a, torch.zeros(4)])
        with pytest.raises(TypeError, match="numpy"):
            a.numpy()
        streams = CudaStreams(torch.device("cuda", 1))
        with pytest.raises(RuntimeError, match="moved to the device first"):
            streams.hand_over(streams.record(), [torch.zeros(1)])
        with pytest.raises(RuntimeError, match="tensor on cuda:0, stream on cuda:1"):
            streams.adopt([a])
        stray = {"__name__": "gpucache.decode.somewhere", "torch": torch}
        with pytest.raises(RuntimeError, match="belong in gpucache.decode.gpu._streams"):
            exec("torch.cuda.Stream()", stray)
        with pytest.raises(RuntimeError, match="belong in gpucache.decode.gpu._streams"):
            exec("torch.cuda.current_stream()", stray)
    from tests.support import emulated_cuda as _emulated_cuda

    assert torch.cuda.Stream is not _emulated_cuda.Stream  # restored on exit


def test_exif_probe_runs_under_the_backends_allocation_stream(cache):
    """The probe must not decode on the caller's current (training) stream: torchvision's CUDA
    decoder allocates there and writes from its own stream (pytorch/vision PR 9606)."""
    assert applies_exif(torchvision_decoder(torch.device("cpu")).decode) is False  # documented
    seen = []
    with EmulatedCuda(devices=2):
        real = torchvision_decoder(torch.device("cuda", 0))

        def spy(data):
            seen.append(torch.cuda.current_stream(0))
            return real.decode(data)

        decoder = make_decoder("spy", "cuda", spy)  # applies_exif unknown: measured
        backend = NvjpegBackend(
            cache, options=DecodeOptions(on_error="raise"), device="cuda", decoder=decoder
        )
        assert seen == [backend._streams.alloc] and backend.applies_exif is False
        default = NvjpegBackend(
            cache, options=DecodeOptions(on_error="raise"), device="cuda"
        )  # TorchCodec's applies it
        assert default.applies_exif is (default.decoder.name == "torchcodec")
        default.close()
        backend.close()


def test_out_of_memory_is_raised_with_advice(cache):
    def oom(data):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    backend = NvjpegBackend(
        cache, device="cpu", decoder=make_decoder("oom", "cpu", oom, applies_exif=False)
    )
    idx = np.arange(8)
    backend.submit(idx, _plans(cache, idx), stack=True)
    with pytest.raises(
        torch.OutOfMemoryError,
        match=r"batch of \d+ samples.*lower batch_size.*"
        "Tried to allocate 2.00 GiB",
    ):
        backend.get()
    assert not backend.thread_alive


@pytest.fixture
def broken_torchcodec(tmp_path, monkeypatch):
    """A TorchCodec package first on sys.path whose decoders fail to load; the real one's
    modules (if imported) are put back afterwards and the fake's removed, so no later test (such
    as gpu_check's versions) meets the fake in sys.modules."""
    pkg = tmp_path / "torchcodec"
    (pkg / "decoders").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "decoders" / "__init__.py").write_text(
        'raise RuntimeError("Could not load libtorchcodec. FFmpeg libraries not found")\n'
    )

    def ours(name: str) -> bool:
        return name == "torchcodec" or name.startswith("torchcodec.")

    saved = {m: sys.modules.pop(m) for m in [m for m in sys.modules if ours(m)]}
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        yield pkg
    finally:
        for name in [m for m in sys.modules if ours(m)]:
            del sys.modules[name]
        sys.modules.update(saved)


def test_torchcodec_that_fails_to_load_falls_back_to_torchvision(broken_torchcodec):
    """An installed TorchCodec whose libraries do not load raises RuntimeError at import."""
    with pytest.warns(RuntimeWarning, match="TorchCodec is installed but failed to load"):
        decoder = default_decoder(torch.device("cpu"))
    assert decoder.name == "torchvision"
    with pytest.raises(RuntimeError, match="prefer='torchvision'"):
        default_decoder(torch.device("cpu"), prefer="torchcodec")


def test_local_rank_differing_from_the_current_device_warns_once(cache, monkeypatch):
    from gpucache.decode import _device

    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(_device, "_warned_local_rank", set())
    with EmulatedCuda(devices=2):
        with pytest.warns(RuntimeWarning, match=r"LOCAL_RANK=1 .* cuda:0.*torch\.cuda\.set_device"):
            GpuCachedLoader(cache, batch_size=4, seed=0)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            GpuCachedLoader(cache, batch_size=4, seed=0)  # once
            GpuCachedLoader(cache, batch_size=4, seed=0, device="cuda:0")  # an explicit choice
            torch.cuda.set_device(1)
            assert GpuCachedLoader(cache, batch_size=4, seed=0).device == torch.device("cuda", 1)


@pytest.mark.parametrize("visible, warns", [(1, False), (4, True)])
def test_local_rank_warns_only_when_that_gpu_is_visible(cache, monkeypatch, visible, warns):
    """One GPU visible per rank (Slurm's per-task binding, a per-rank CUDA_VISIBLE_DEVICES):
    every rank rightly decodes on its cuda:0, and there is no cuda:3 to advise."""
    from gpucache.decode import _device

    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(_device, "_warned_local_rank", set())
    with EmulatedCuda(devices=visible), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        loader = GpuCachedLoader(cache, batch_size=4, seed=0, backend="nvjpeg")
        assert loader.device == torch.device("cuda", 0)
    said = [str(w.message) for w in seen if "LOCAL_RANK" in str(w.message)]
    assert bool(said) is warns, said
    if warns:
        assert "LOCAL_RANK=3 but the current CUDA device is cuda:0" in said[0]


def test_library_imports_and_builds_without_tqdm(jpeg_folder):
    code = textwrap.dedent(f"""
        import importlib.abc, sys
        class NoTqdm(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "tqdm" or name.startswith("tqdm."):
                    raise ModuleNotFoundError(f"No module named {{name!r}}")
        sys.meta_path.insert(0, NoTqdm())
        import gpucache
        cache = gpucache.JpegCache.from_folder({str(jpeg_folder)!r}, progress=True)
        assert len(cache) == 24 and "tqdm" not in sys.modules
        print("ok")
    """)
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_multi_gpu_snippet_sets_the_device_only_with_cuda():
    """The documented torchrun code runs unchanged on CPU ranks: set_device only under a
    torch.cuda.is_available() test."""
    page = ROOT / "docs" / "guides" / "multi-gpu.md"
    text = page.read_text() if page.exists() else (ROOT / "README.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "set_device" in b]
    assert blocks
    for block in blocks:
        tree = ast.parse(block)
        guarded = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "cuda.is_available" in ast.unparse(node.test)
            for n in ast.walk(ast.Module(body=node.body, type_ignores=[]))
        }
        calls = [
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.Call) and ast.unparse(n.func).endswith("cuda.set_device")
        ]
        assert calls and all(id(c) in guarded for c in calls), block
