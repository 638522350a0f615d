"""The batched transforms' memory and arithmetic (gpucache/transforms/_chunks.py): a fixed budget
whatever the GPU's size, chunks cut by crop size so that padding to one large photo wastes at most
half of the arithmetic, and a work buffer that shrinks again, on the emulated GPU."""

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gpucache import JpegCache
from gpucache import transforms as T
from gpucache.decode._apply import apply_plan
from gpucache.decode._options import DecodeOptions
from gpucache.decode._sample import decode_sample
from gpucache.decode.gpu._nvjpeg import NvjpegBackend
from gpucache.testing import make_jpeg_bytes
from gpucache.transforms._chunks import BUDGET_BYTES, Scratch, flops
from gpucache.transforms._resample import resample
from tests.support.emulated_cuda import EmulatedCuda

H200 = 141 * 2**30
EVAL = T.Compose([T.Resize(224), T.CenterCrop(224)])  # the first crop box: the whole photo


class Products(TorchDispatchMode):
    """Floating-point operations of every batched matrix product dispatched."""

    flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.bmm, torch.ops.aten.baddbmm):
            a, b = (args[1], args[2]) if func.overloadpacket is torch.ops.aten.baddbmm else args[:2]
            self.flops += 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """31 small photos and one of 1600 x 1200, as a training set of phone photos may hold."""
    root = tmp_path_factory.mktemp("mixed") / "c"
    root.mkdir()
    for i in range(31):
        (root / f"{i:02d}.jpg").write_bytes(make_jpeg_bytes(200, 150, seed=i))
    (root / "big.jpg").write_bytes(make_jpeg_bytes(1600, 1200, seed=99))
    return JpegCache.from_folder(root.parent, progress=False)


def _batch(cache, products=None):
    """One batch of every photo through the nvjpeg backend on an emulated 141 GiB GPU: the
    output (on the CPU), the reserved memory it added and the matrix products' arithmetic."""
    idx = np.arange(len(cache))
    plans = EVAL.plan(cache.samples["height"], cache.samples["width"], np.random.default_rng(0))
    with EmulatedCuda(devices=1, total_memory=H200):
        backend = NvjpegBackend(
            cache,
            options=DecodeOptions(on_error="raise"),
            device=torch.device("cuda", 0),
            threaded=False,
        )
        before = torch.cuda.memory_reserved()
        mode = products if products is not None else Products()
        with mode:
            backend.submit(idx, plans, True)
            out = backend.get().images
        added = torch.cuda.memory_reserved() - before
        backend.close()
        out = out.cpu()
    return out, added, plans


def test_one_large_photo_among_small_ones_keeps_the_budget(mixed):
    """A budget of a sixteenth of the GPU (8.8 GiB on an H200) ran all 32 padded to 1600 x 1200
    (over 1 GiB); now the large photo has a chunk of its own and the stage stays in its budget."""
    out, added, plans = _batch(mixed)
    decoded = sum(
        3 * int(h) * int(w) for h, w in zip(mixed.samples["height"], mixed.samples["width"])
    )
    assert added <= BUDGET_BYTES + decoded + out.numel(), added / 2**20
    ref = torch.stack([apply_plan(decode_sample(mixed, i), p) for i, p in enumerate(plans)])
    assert (out.int() - ref.int()).abs().max() <= 1  # the CPU's fixed-point path: 1 level


def test_most_of_the_arithmetic_is_useful(mixed):
    """Padding every image to the largest photo's box made 6% of the products useful here."""
    products = Products()
    _out, _added, plans = _batch(mixed, products)
    useful = int(flops(1, plans[:, 2], plans[:, 3], 224, 224).sum())
    assert products.flops >= useful and useful / products.flops >= 0.5, useful / products.flops


def _shapes(n, h, w, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g) for _ in range(n)]


def test_scratch_gives_memory_back_and_never_keeps_more_than_its_limit():
    scratch = Scratch(limit=8 << 20, window=4)
    big = _shapes(2, 400, 600)
    plans = EVAL.plan(np.full(2, 400), np.full(2, 600), np.random.default_rng(0))
    resample(big, plans, scratch=scratch, budget_bytes=8 << 20)
    grown = scratch.nbytes
    assert 0 < grown <= 8 << 20
    small = _shapes(2, 80, 60)
    plans = T.Compose([T.Resize(32), T.CenterCrop(32)]).plan(
        np.full(2, 80), np.full(2, 60), np.random.default_rng(0)
    )
    for _ in range(4):
        resample(small, plans, scratch=scratch, budget_bytes=8 << 20)
    assert 0 < scratch.nbytes <= grown // 2  # shrunk to what the small batches need
    huge = scratch.take([((16 << 20,), torch.uint8)], torch.device("cpu"))[0]
    assert huge.numel() == 16 << 20 and scratch.nbytes <= 8 << 20  # over the limit: not kept


def test_ops_depend_on_the_chunks_not_on_the_batch_size():
    """Equal boxes make one chunk whatever the batch size; two sizes far apart make two."""
    from benchmarks.batched_transforms import CountOps

    def ops(images):
        h = np.array([im.shape[1] for im in images])
        w = np.array([im.shape[2] for im in images])
        plans = EVAL.plan(h, w, np.random.default_rng(0))
        with CountOps() as counter:
            resample(images, plans)
        return counter.total

    one = [ops(_shapes(n, 64, 48)) for n in (4, 32)]
    two = [ops(_shapes(n, 64, 48) + _shapes(n, 640, 480)) for n in (2, 16)]
    assert one[0] == one[1] and two[0] == two[1] and one[0] < two[0] <= 2 * one[0]


def test_a_crop_over_the_budget_runs_in_bands_within_it():
    """A photo whose padded crop alone passes the budget is gathered a band of rows at a time:
    the same pixels (float summation order aside) in a fraction of the memory."""
    budget = 12 << 20
    with EmulatedCuda(devices=1):
        dev = torch.device("cuda", 0)
        images = [im.to(dev) for im in _shapes(1, 1200, 1600) + _shapes(3, 120, 160, seed=1)]
        plans = EVAL.plan(
            np.array([1200] + [120] * 3), np.array([1600] + [160] * 3), np.random.default_rng(0)
        )
        before = torch.cuda.memory_reserved()
        banded = resample(images, plans, budget_bytes=budget, scratch=Scratch(budget))
        added = torch.cuda.memory_reserved() - before
        whole = resample(images, plans, budget_bytes=1 << 40)
        d = (banded.cpu().int() - whole.cpu().int()).abs()
    assert added <= budget, added / 2**20  # one chunk: 1200 x 1600 x 15 bytes is 27 MiB
    assert d.max() <= 1 and (d > 0).float().mean() < 1e-3
