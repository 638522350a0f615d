"""backend="dali" on the CPU (device_id=None, DALI's CPU decoder): the same graph CUDA runs.

Real DALI, real JPEGs. The reference is gpucache.decode._core.decode_batch on the same plans.
Tolerance: mean absolute difference <= 2 levels per image. Measured on these fixtures: mean
0.08-0.21 per image; max 1 (Resize+CenterCrop) and up to 12 (RandomResizedCrop, at the crop borders,
where DALI's and torch's antialias filters treat the image edge differently).

The GPU graph is defined and its operators checked without a GPU (DALI serializes a pipeline with
"mixed" operators when device_id is None); running it needs CUDA (the last test, skipped here).
"""

import logging

import numpy as np
import pytest
import torch

pytest.importorskip(
    "nvidia.dali",
    reason="NVIDIA DALI is not installed (pip install "
    "nvidia-dali-cuda120); backend='dali' is untested here",
)

from gpucache import JpegCache, Kind, SampleError  # noqa: E402
from gpucache import transforms as T  # noqa: E402
from gpucache.decode._core import decode_batch  # noqa: E402
from gpucache.decode._options import DecodeOptions  # noqa: E402
from gpucache.decode.gpu._dali import DaliBackend  # noqa: E402
from gpucache.decode.gpu._fallback import join, split  # noqa: E402
from gpucache.testing import make_jpeg_bytes  # noqa: E402
from tests.support.hostile import after_soi, exif_app1, xmp_app1  # noqa: E402

CPU = torch.device("cpu")
TOLERANCE = 2.0  # mean abs difference, uint8 levels, per image

TRANSFORMS = {
    "rrc_flip": T.Compose([T.RandomResizedCrop(64), T.RandomHorizontalFlip()]),
    "resize_center": T.Compose([T.Resize(72), T.CenterCrop(64)]),
}


def backend(cache, on_error="skip", **kw):
    args = dict(device=CPU, batch_size=32, num_threads=2)
    return DaliBackend(cache, options=DecodeOptions(on_error=on_error), **{**args, **kw})


def plans_for(cache, indices, transform, seed=0):
    s = cache.samples
    return transform.plan(
        s["height"][indices].astype(np.int64),
        s["width"][indices].astype(np.int64),
        np.random.default_rng(seed),
    )


def decode(be, indices, plans, stack=True):
    be.submit(indices, plans, stack)
    return be.get()


def assert_close(images, ref_images):
    assert len(images) == len(ref_images)
    for a, b in zip(images, ref_images):
        assert a.dtype == torch.uint8 and a.shape == b.shape
        diff = (a.float() - b.float()).abs()
        assert diff.mean() <= TOLERANCE, (diff.mean().item(), diff.max().item())


@pytest.fixture(scope="module")
def jpegs(jpeg_folder):
    return JpegCache.from_folder(jpeg_folder, progress=False)


@pytest.fixture(scope="module")
def bad(bad_folder):
    return JpegCache.from_files(sorted(bad_folder["cases"]), progress=False)


def by_name(cache, name):
    return next(i for i, p in enumerate(cache.paths) if p.endswith("/" + name))


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_matches_cpu_decoder(jpegs, name):
    idx = np.arange(len(jpegs))  # grayscale, CMYK, progressive and EXIF-6 among them
    plans = plans_for(jpegs, idx, TRANSFORMS[name])
    be = backend(jpegs)
    out = decode(be, idx, plans)
    ref = decode_batch(jpegs, idx, plans, stack=True)
    assert out.images.shape == ref.images.shape == (len(idx), 3, 64, 64)
    assert out.images.device == CPU and out.images.is_contiguous()
    assert_close(out.images, ref.images)
    assert out.indices.tolist() == idx.tolist() and out.failed == []
    assert out.cpu_decoded == int((~jpegs.gpu_decodable()).sum()) == 1  # the CMYK one
    be.close()


def test_list_output_padding_and_identity(small_folder):
    """stack=False gives a list; crops larger than the image are zero-padded; no-op plans."""
    cache = JpegCache.from_folder(small_folder, progress=False)
    idx = np.array([5, 0, 17, 3, 39, 21])
    be = backend(cache)
    for transform in (T.Compose([T.CenterCrop(100)]), T.Compose([])):
        plans = plans_for(cache, idx, transform)
        out = decode(be, idx, plans, stack=False)
        ref = decode_batch(cache, idx, plans, stack=False)
        assert isinstance(out.images, list) and out.indices.tolist() == idx.tolist()
        assert_close(out.images, ref.images)
        for im, p in zip(out.images, plans.tolist()):  # zeros exactly where crop2 leaves the image
            rh, rw, t2, l2 = p[4], p[5], p[6], p[7]
            inside = torch.zeros(im.shape[1:], dtype=torch.bool)
            inside[max(0, -t2) : rh - t2, max(0, -l2) : rw - l2] = True
            assert (im[:, ~inside] == 0).all() and im[:, inside].float().mean() > 10
    pad = plans_for(cache, idx, T.Compose([T.CenterCrop(100)]))
    assert ((pad[:, 6] < 0) | (pad[:, 7] < 0)).sum() >= 3  # the padding case is exercised
    h, w = cache.samples["height"][idx], cache.samples["width"][idx]
    assert [tuple(im.shape) for im in out.images] == [(3, int(a), int(b)) for a, b in zip(h, w)]
    be.close()


def test_cpu_path_and_corrupt_sample(bad, caplog):
    """PNG and CMYK take the CPU path; the corrupt-scan JPEG fails DALI and the CPU, is reported."""
    idx = np.arange(len(bad))
    plans = plans_for(bad, idx, T.Compose([T.Resize((32, 32))]))
    gpu_pos, cpu_pos, refused = split(bad, idx, on_error="skip")
    assert not len(refused[0])  # every sample is within the default pixel budget
    kinds = bad.kinds()
    assert sorted(bad.paths[i].rsplit("/", 1)[1] for i in cpu_pos) == ["cmyk.jpg", "png_named.jpg"]
    assert kinds[by_name(bad, "png_named.jpg")] == Kind.PNG
    corrupt = by_name(bad, "corrupt_scan.jpg")
    be = backend(bad, batch_size=len(idx))
    with caplog.at_level(logging.WARNING, logger="gpucache"):
        out = decode(be, idx, plans)
    assert [i for i, _ in out.failed] == [corrupt]
    assert "corrupt_scan.jpg" in out.failed[0][1] and "could not be decoded" in out.failed[0][1]
    assert out.cpu_decoded == 2
    kept = [i for i in idx.tolist() if i != corrupt]
    assert out.indices.tolist() == kept  # batch order preserved
    ref = decode_batch(bad, np.array(kept), plans[kept], stack=True)
    assert_close(out.images, ref.images)
    assert "DALI failed a batch" in caplog.text
    be.close()


def test_bad_batch_among_batches_in_flight(bad):
    """A failing batch between good ones: every batch comes back, in order, right counts."""
    corrupt = by_name(bad, "corrupt_scan.jpg")
    good = [i for i in range(len(bad)) if i != corrupt]
    batches = [
        np.array(good[:3]),
        np.array([good[3], corrupt, good[4]]),
        np.array(good[5:]),
        np.array(good[:2]),
    ]
    be = backend(bad, batch_size=4, prefetch=3)
    t = T.Compose([T.Resize((24, 24))])
    for b in batches:
        be.submit(b, plans_for(bad, b, t), True)
    assert len(be) == len(batches)
    outs = [be.get() for _ in batches]
    assert len(be) == 0
    assert [o.indices.tolist() for o in outs] == [
        [i for i in b.tolist() if i != corrupt] for b in batches
    ]
    assert [len(o.failed) for o in outs] == [0, 1, 0, 0]
    assert sum(o.cpu_decoded for o in outs) == sum(
        int((~bad.gpu_decodable()[b]).sum()) for b in batches
    )
    assert all(o.images.shape[1:] == (3, 24, 24) for o in outs)
    be.close()


def test_raise_policy_names_the_file(bad):
    corrupt = by_name(bad, "corrupt_scan.jpg")
    good = [by_name(bad, "good.jpg"), by_name(bad, "gray.jpg")]
    idx = np.array([good[0], corrupt, good[1]])
    be = backend(bad, on_error="raise")
    be.submit(idx, plans_for(bad, idx, T.Compose([T.Resize((16, 16))])), True)
    with pytest.raises(SampleError, match="corrupt_scan.jpg"):
        be.get()
    assert len(be) == 0  # and the backend still works afterwards
    ok = np.array(good)
    assert (
        decode(be, ok, plans_for(bad, ok, T.Compose([T.Resize((16, 16))]))).indices.tolist() == good
    )
    be.close()


def test_queue_short_batches_drain_and_close(small_folder):
    cache = JpegCache.from_folder(small_folder, progress=False)
    be = backend(cache, batch_size=8, prefetch=2)
    t = TRANSFORMS["resize_center"]
    order = np.random.default_rng(1).permutation(len(cache))
    batches = [order[i : i + 8] for i in range(0, len(order), 8)] + [order[:3]]  # short last one
    for b in batches:  # more than `prefetch` queued: the rest wait their turn
        be.submit(b, plans_for(cache, b, t), True)
    got = [be.get().indices.tolist() for _ in range(3)]
    assert got == [b.tolist() for b in batches[:3]]
    be.drain()  # an abandoned epoch
    assert len(be) == 0
    out = decode(be, order[:5], plans_for(cache, order[:5], t))
    assert out.indices.tolist() == order[:5].tolist() and out.images.shape == (5, 3, 64, 64)
    with pytest.raises(ValueError, match="batch_size=8"):
        be.submit(order[:9], plans_for(cache, order[:9], t), True)
    be.close()
    be.close()  # idempotent
    assert be._pipe is None and len(be) == 0
    with pytest.raises(RuntimeError, match="closed"):
        be.submit(order[:2], plans_for(cache, order[:2], t), True)
    other = backend(cache, batch_size=8)
    other.submit(order[:8], plans_for(cache, order[:8], t), True)
    other.close()  # with a batch in flight in DALI: frees it, does not hang
    assert other._pipe is None and len(other) == 0


def test_join_reassembles_in_order():
    a, b, c = (torch.full((3, 2, 2), v, dtype=torch.uint8) for v in (1, 2, 3))
    idx = np.array([10, 11, 12, 13])
    out = join(
        4,
        [(np.array([0, 3]), [a, "bad 13"], False), (np.array([1, 2]), [b, c], True)],
        indices=idx,
        stack=True,
        device=CPU,
    )
    assert out.indices.tolist() == [10, 11, 12] and out.failed == [(13, "bad 13")]
    assert out.images[:, 0, 0, 0].tolist() == [1, 2, 3] and out.cpu_decoded == 2
    empty = join(
        1, [(np.array([0]), ["x"], False)], indices=idx[:1], stack=True, device=CPU, out_hw=(2, 2)
    )
    assert empty.images.shape == (0, 3, 2, 2) and empty.failed == [(10, "x")]


def test_loader_with_dali_backend_on_cpu_matches_cpu_backend(bad):
    """backend="dali" through GpuCachedLoader: same batches, labels and counts as backend="cpu"."""
    from gpucache import GpuCachedLoader
    from gpucache import transforms as T

    tf = T.Compose(
        [T.RandomResizedCrop(40), T.RandomHorizontalFlip(), T.Normalize((0.5,) * 3, (0.25,) * 3)]
    )
    runs = {}
    for backend in ("cpu", "dali"):
        with GpuCachedLoader(
            bad,
            batch_size=4,
            shuffle=True,
            seed=3,
            device="cpu",
            backend=backend,
            num_workers=0,
            transform=tf,
            return_metadata=True,
        ) as loader:
            runs[backend] = [(x, y, info.indices.tolist()) for x, y, info in loader]
            runs[backend + "_stats"] = loader.stats
    for (xc, yc, ic), (xd, yd, idd) in zip(runs["cpu"], runs["dali"]):
        assert ic == idd and torch.equal(yc, yd)
        assert (xc - xd).abs().mean().item() * 0.25 * 255 <= 2.0  # back in uint8 levels
    assert runs["cpu_stats"].skipped == runs["dali_stats"].skipped == 1
    assert runs["dali_stats"].cpu_decoded < runs["cpu_stats"].cpu_decoded


def test_pixel_budget_refuses_before_dali_and_the_cpu_fallback(jpeg_folder):
    """A sample over max_pixels never reaches DALI, nor the CPU decoder after DALI refuses it."""
    cache = JpegCache.from_folder(jpeg_folder, progress=False)
    s = cache.samples
    pixels = s["height"].astype(np.int64) * s["width"]
    cache.max_pixels = int(pixels[s["components"] == 4].min()) - 1  # CMYK (a CPU sample) too
    over = sorted(np.flatnonzero(pixels > cache.max_pixels).tolist())
    idx = np.arange(len(cache))
    plans = plans_for(cache, idx, TRANSFORMS["resize_center"])
    be = backend(cache)
    out = decode(be, idx, plans)
    assert [i for i, _ in out.failed] == over and all("max_pixels" in r for _, r in out.failed)
    assert out.cpu_decoded == 0 and out.indices.tolist() == [i for i in idx if i not in over]
    ref = decode_batch(
        cache, out.indices, plans[out.indices], DecodeOptions(on_error="raise"), stack=True
    )
    assert_close(out.images, ref.images)
    with pytest.raises(SampleError, match="max_pixels"):
        decode(backend(cache, on_error="raise"), idx, plans)
    be.close()


def test_cuda_outputs_are_bound_to_the_consumer_stream(jpegs):
    """On CUDA, DALI's outputs are taken bound to the current stream of the backend's device (the
    stream their copy runs on), so DALI cannot reuse a buffer before the copy has run. No GPU
    here: DALI runs its CPU graph, torch's side is EmulatedCuda, and the stream DALI is handed
    is recorded (DALI's CPU graph cannot take one)."""
    from tests.support.dali_cpu_graph import CpuGraph
    from tests.support.emulated_cuda import EmulatedCuda

    idx = np.arange(8)
    plans = plans_for(jpegs, idx, TRANSFORMS["rrc_flip"])
    ref = decode_batch(jpegs, idx, plans, stack=True)
    with EmulatedCuda(devices=2):  # cuda:0 is current; the backend is on cuda:1
        be = CpuGraph(
            jpegs,
            device=torch.device("cuda", 1),
            batch_size=8,
            num_threads=2,
        )
        out = decode(be, idx, plans)
        assert out.images.device == torch.device("cuda", 1)
        assert be._pipe.handed == [torch.cuda.current_stream(1)]
        assert be._pipe.handed[0] is not torch.cuda.current_stream(0)
        assert_close(out.images.cpu(), ref.images)
        be.close()


@pytest.mark.parametrize(
    "launcher, usable, given, want",
    [
        ({"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "1"}, 16, None, 4),  # torchrun: 16 cores, 4 ranks
        ({"SLURM_NTASKS_PER_NODE": "4", "SLURM_LOCALID": "2"}, 16, None, 4),  # srun, no binding
        ({"SLURM_NTASKS_PER_NODE": "4", "SLURM_LOCALID": "2"}, 4, None, 4),  # 4 cores bound to it
        ({"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "1"}, 16, 8, 8),  # an explicit num_workers
        ({}, 16, None, 16),  # no launcher
    ],
)
def test_dali_threads_are_this_ranks_share_of_the_cores(
    jpegs, monkeypatch, launcher, usable, given, want
):
    """Every rank of a node would otherwise give DALI (and the cpu backend's workers) every core
    of the machine; only the default divides, an explicit num_workers is taken as given."""
    from gpucache import GpuCachedLoader
    from gpucache.decode.cpu import _pool

    for name in ("LOCAL_WORLD_SIZE", "LOCAL_RANK", "SLURM_NTASKS_PER_NODE", "SLURM_LOCALID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in launcher.items():
        monkeypatch.setenv(name, value)
    # the system's answers, not gpucache's helper: whatever reads them sees this machine
    monkeypatch.setattr(_pool.os, "sched_getaffinity", lambda pid: set(range(usable)))
    monkeypatch.setattr(_pool.os, "cpu_count", lambda: 16)
    loader = GpuCachedLoader(
        jpegs, batch_size=8, seed=0, device="cpu", backend="dali", num_workers=given
    )
    with loader:
        assert loader.num_workers == want
        assert loader._get_backend().num_threads == want
        assert sum(len(y) for _, y in loader) == len(jpegs)


# ------------------------------------------------ orientation: the store's, never DALI's own EXIF
def _exif_without_prefix(orientation):
    """An Exif APP1 whose first 6 bytes are not ``Exif\\0\\0``: libjpeg-turbo skips them unread
    (orientation applied), nvImageCodec ignores the segment."""
    seg = exif_app1(orientation)
    return seg[:4] + b"JUNK\0\0" + seg[10:]


def _exif_ifd_of_65535(orientation):
    """IFD0 claims 65535 entries; its first is Orientation: libjpeg-turbo reads it, nvImageCodec
    drops the IFD."""
    seg = exif_app1(orientation)
    count = 4 + 6 + 8  # marker and length, "Exif\0\0", TIFF header
    return seg[:count] + (65535).to_bytes(2, "little") + seg[count + 2 :]


#: name -> (displayed width, height, APP segments after SOI, orientation the CPU path applies).
#: The first three: on DALI's own reading of EXIF, each came out turned (max difference 185 on
#: these 48 x 48 photos, mean 57); the rest are the cases it read as libjpeg-turbo does.
ORIENTED = {
    "xmp_then_exif6.jpg": (48, 48, [xmp_app1(1), exif_app1(6)], 1),
    "no_exif_prefix6.jpg": (48, 48, [_exif_without_prefix(6)], 6),
    "ifd_65535_entries6.jpg": (48, 48, [_exif_ifd_of_65535(6)], 6),
    "square_exif6.jpg": (48, 48, [exif_app1(6)], 6),
    "two_exif_1_then_6.jpg": (48, 48, [exif_app1(1), exif_app1(6)], 1),
    **{f"exif{o}.jpg": (40, 28, [exif_app1(o)], o) for o in range(1, 9)},
}
IDENTITY = T.Compose([])


@pytest.fixture(scope="module")
def oriented(tmp_path_factory):
    root = tmp_path_factory.mktemp("oriented")
    paths = []
    for k, (name, (w, h, segments, _)) in enumerate(ORIENTED.items()):
        o = ORIENTED[name][3]
        coded = (h, w) if o >= 5 else (w, h)  # the stored pixels, before orientation
        (root / name).write_bytes(after_soi(make_jpeg_bytes(*coded, seed=20 + k), *segments))
        paths.append(str(root / name))
    return JpegCache.from_files(paths, progress=False)


def test_store_records_the_orientation_the_cpu_decoder_applies(oriented):
    want = [o for *_, o in ORIENTED.values()]
    assert oriented.samples["orientation"].tolist() == want
    sizes = oriented.samples[["width", "height"]].tolist()
    assert sizes == [(w, h) for w, h, *_ in ORIENTED.values()]


@pytest.mark.parametrize("name", ["identity", "rrc_flip", "resize_center", "pad"], ids=lambda n: n)
def test_orientation_matches_the_cpu_backend_on_every_header(oriented, name):
    """Square images whose EXIF headers nvImageCodec reads otherwise than libjpeg-turbo, and all 8
    orientations on a non-square image, through crops, resize, padding and flips: DALI's CPU graph
    gives the cpu backend's pixels. Measured: identical on the identity plan (max 0); within the
    stated tolerance after a resize."""
    transform = {
        "identity": IDENTITY,
        "pad": T.Compose([T.CenterCrop(44)]),  # larger than the 40 x 28 ones: padded
        **TRANSFORMS,
    }[name]
    idx = np.arange(len(oriented))
    plans = plans_for(oriented, idx, transform, seed=7)
    be = backend(oriented, batch_size=len(idx))
    out = decode(be, idx, plans, stack=False)
    ref = decode_batch(oriented, idx, plans, DecodeOptions(on_error="raise"), stack=False)
    assert out.indices.tolist() == idx.tolist() and out.failed == [] and out.cpu_decoded == 0
    assert_close(out.images, ref.images)
    if transform is IDENTITY:  # the same libjpeg-turbo decode on both sides: no resize between
        worst = max((a.int() - b.int()).abs().max().item() for a, b in zip(out.images, ref.images))
        assert worst == 0
    be.close()


# ------------------------------------------------ the GPU graph, defined (and checked) without a GPU
def _operators(pipe):
    """(DALI schema name, device) of every operator of a defined pipeline. ``_build_graph`` and
    ``_ops`` are DALI's Python-side graph (2.4); ``serialize()``, public, is checked to work too."""
    pipe._build_graph()
    return [
        (getattr(op._op, "schema_name", type(op._op).__name__), op._op.device) for op in pipe._ops
    ]


def test_gpu_graph_decodes_whole_images_on_the_gpu():
    """The graph CUDA would run: ``decoders.image`` on the "mixed" device, never a region decode
    (``decoders.image_slice``/``image_crop``/``image_random_crop``, nvImageCodec 0.9's crashing
    ROI path), and every image operator after it on the GPU. DALI accepts the definition
    (serializes it) with no GPU; running it needs one (untested on GPU)."""
    from gpucache.decode.gpu import _dali_graph

    pipe = _dali_graph.define(
        gpu=True, device_id=None, batch_size=8, num_threads=2, seed=0, hw_decoder_load=0.65
    )
    assert len(pipe.serialize()) > 0
    ops = _operators(pipe)
    decoders = [(name, dev) for name, dev in ops if name.startswith("decoders__")]
    assert decoders == [("decoders__Image", "mixed")]
    on_images = {"Slice", "Transpose", "Flip", "Resize", "CropMirrorNormalize"}
    assert {name for name, _ in ops} >= on_images
    assert {dev for name, dev in ops if name in on_images} == {"gpu"}
    cpu_graph = _dali_graph.define(
        gpu=False, device_id=None, batch_size=8, num_threads=2, seed=0, hw_decoder_load=0.65
    )  # the same operators, the decoder's device aside: what CI runs
    assert [n for n, _ in _operators(cpu_graph)] == [n for n, _ in ops]
    assert ("decoders__Image", "cpu") in _operators(cpu_graph)


def test_auto_chooses_nvjpeg_on_cuda_with_dali_installed(jpegs):
    """DALI is installed here, yet backend="auto" on CUDA is nvjpeg: DALI's GPU graph has not run
    on a GPU. backend="dali" still gives DALI."""
    from gpucache import GpuCachedLoader
    from gpucache.decode import dali_available, resolve
    from tests.support.emulated_cuda import EmulatedCuda

    assert dali_available()
    assert resolve("auto", torch.device("cuda", 0)) == "nvjpeg"
    assert resolve("auto", CPU) == "cpu" and resolve("dali", torch.device("cuda", 0)) == "dali"
    with EmulatedCuda(devices=1):
        with GpuCachedLoader(jpegs, batch_size=4, device="cuda") as loader:
            assert loader.backend_name == "nvjpeg"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available on this machine")
def test_gpu_graph_orients_as_the_cpu_backend(oriented):  # pragma: no cover - needs a GPU
    """On a GPU (none here: skipped; see the manual's GPU status): the same headers through the
    "mixed" decoder, within the GPU decoders' tolerance (3 levels mean per image)."""
    idx = np.arange(len(oriented))
    plans = plans_for(oriented, idx, TRANSFORMS["rrc_flip"], seed=7)
    be = backend(oriented, device=torch.device("cuda", torch.cuda.current_device()))
    out = decode(be, idx, plans, stack=False)
    ref = decode_batch(oriented, idx, plans, DecodeOptions(on_error="raise"), stack=False)
    assert out.indices.tolist() == idx.tolist() and out.failed == [] and out.cpu_decoded == 0
    for a, b in zip(out.images, ref.images):
        assert a.is_cuda and a.shape == b.shape
        assert (a.cpu().float() - b.float()).abs().mean().item() <= 3.0
    be.close()


@pytest.mark.parametrize("stack", [False, True])
def test_padding_is_the_fill_on_dali_and_its_cpu_path(bad, stack):
    """The graph's padding and the CPU path's (PNG, CMYK) are ``fill`` in the backend's own
    output: nothing after it paints them."""
    idx = np.array([i for i in range(len(bad)) if not bad.paths[i].endswith("corrupt_scan.jpg")])
    s = bad.samples
    side = int(max(s["height"].max(), s["width"].max())) + 16
    plans = plans_for(bad, idx, T.Compose([T.CenterCrop(side)]))  # larger than every image
    options = DecodeOptions(fill=9)
    be = DaliBackend(bad, device=CPU, options=options, batch_size=len(idx), num_threads=2)
    out = decode(be, idx, plans, stack=stack)
    be.close()
    ref = decode_batch(bad, idx, plans, options, stack=stack)
    assert out.indices.tolist() == idx.tolist() and out.cpu_decoded == 2
    assert_close(out.images, ref.images)
    for im, p in zip(out.images, plans.tolist()):
        rh, rw, t2, l2 = p[4], p[5], p[6], p[7]
        inside = torch.zeros(im.shape[1:], dtype=torch.bool)
        inside[max(0, -t2) : rh - t2, max(0, -l2) : rw - l2] = True
        assert (~inside).any() and (im[:, ~inside] == 9).all()
