"""GpuCachedLoader on the CPU backend: DataLoader habits, determinism, errors and clean shutdown."""

import gc
import os
import signal
import time

import psutil
import pytest
import torch

from gpucache import GpuCachedLoader, JpegCache, WorkerError
from gpucache import transforms as T

TRAIN = T.Compose([T.RandomResizedCrop(32), T.RandomHorizontalFlip()])


@pytest.fixture(scope="module")
def cache(small_folder):
    return JpegCache.from_folder(small_folder, progress=False)


def _epoch(loader):
    out = [
        (x.clone() if isinstance(x, torch.Tensor) else x, i.indices.tolist()) for x, _, i in loader
    ]
    return torch.cat([x for x, _ in out]), sum((ix for _, ix in out), [])


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_each_epoch_yields_every_index_once(cache, shuffle, drop_last):
    loader = GpuCachedLoader(
        cache,
        batch_size=7,
        shuffle=shuffle,
        drop_last=drop_last,
        seed=3,
        num_workers=0,
        device="cpu",
        return_metadata=True,
        transform=TRAIN,
    )
    seen = [i for _, labels, info in loader for i in info.indices.tolist()]
    full = len(cache) // 7 * 7 if drop_last else len(cache)
    assert len(seen) == full == len(set(seen))
    assert len(loader) == (len(cache) // 7 if drop_last else -(-len(cache) // 7))
    if not shuffle:
        assert seen == list(range(full))


def test_labels_and_metadata_come_with_images(cache):
    loader = GpuCachedLoader(
        cache, batch_size=8, shuffle=True, seed=0, num_workers=0, device="cpu", return_metadata=True
    )
    images, labels, info = next(iter(loader))
    assert isinstance(images, list) and all(im.dtype == torch.uint8 for im in images)
    assert labels.dtype == torch.int64
    assert labels.tolist() == cache.labels[info.indices.numpy()].tolist()
    assert isinstance(info.paths, list) and info.paths == [cache.paths[i] for i in info.indices]
    for im, i in zip(images, info.indices.tolist()):
        assert tuple(im.shape) == (3, cache.samples["height"][i], cache.samples["width"][i])


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_same_seed_same_order_and_crops_for_any_worker_count(cache, context):
    runs = {}
    for workers in (0, 1, 2):
        if workers == 1 and context == "spawn":
            continue  # spawn start-up is slow; 0 vs 2 covers it
        with GpuCachedLoader(
            cache,
            batch_size=6,
            shuffle=True,
            seed=11,
            num_workers=workers,
            device="cpu",
            transform=TRAIN,
            return_metadata=True,
            multiprocessing_context=context,
        ) as loader:
            runs[workers] = _epoch(loader)
    first = runs[0]
    for workers, (images, order) in runs.items():
        assert order == first[1], workers
        assert torch.equal(images, first[0]), workers


def test_epochs_differ_and_set_epoch_replays(cache):
    loader = GpuCachedLoader(
        cache,
        batch_size=8,
        shuffle=True,
        seed=5,
        num_workers=0,
        device="cpu",
        transform=TRAIN,
        return_metadata=True,
    )
    e0 = _epoch(loader)
    e1 = _epoch(loader)
    assert e0[1] != e1[1] and sorted(e0[1]) == sorted(e1[1])
    loader.set_epoch(0)
    again = _epoch(loader)
    assert again[1] == e0[1] and torch.equal(again[0], e0[0])
    other = GpuCachedLoader(
        cache,
        batch_size=8,
        shuffle=True,
        seed=6,
        num_workers=0,
        device="cpu",
        transform=TRAIN,
        return_metadata=True,
    )
    assert _epoch(other)[1] != e0[1]


def test_state_dict_resumes_mid_epoch(cache):
    kw = dict(
        batch_size=5,
        shuffle=True,
        seed=9,
        num_workers=0,
        device="cpu",
        transform=TRAIN,
        return_metadata=True,
    )
    ref = GpuCachedLoader(cache, **kw)
    _epoch(ref)
    full_images, full_order = _epoch(ref)  # epoch 1
    loader = GpuCachedLoader(cache, **kw)
    _epoch(loader)
    it = iter(loader)
    first = [next(it) for _ in range(3)]
    state = loader.state_dict()
    resumed = GpuCachedLoader(cache, **{**kw, "seed": 0})
    resumed.load_state_dict(state)
    rest_images, rest_order = _epoch(resumed)
    head = sum((i.indices.tolist() for _, _, i in first), [])
    assert head + rest_order == full_order
    assert torch.equal(torch.cat([x for x, _, _ in first] + [rest_images]), full_images)
    smaller = JpegCache.from_files(list(cache.paths)[:10], progress=False)
    with pytest.raises(ValueError, match="samples=40.* 10"):
        GpuCachedLoader(smaller, **kw).load_state_dict(state)
    with pytest.raises(ValueError, match="shuffle"):
        GpuCachedLoader(cache, **{**kw, "shuffle": False}).load_state_dict(state)
    old = {
        "seed": 9,
        "epoch": 1,
        "batches_done": 3,
        "batch_size": 5,
        "num_replicas": 1,
        "samples": len(cache),
    }  # the version-1 layout still loads
    legacy = GpuCachedLoader(cache, **kw)
    with pytest.warns(UserWarning, match="no 'store' or 'sampling' fingerprint"):
        legacy.load_state_dict(old)
    assert _epoch(legacy)[1] == rest_order


def test_every_iter_starts_a_fresh_epoch_and_keeps_its_workers(cache):
    kw = dict(
        batch_size=6,
        shuffle=True,
        seed=4,
        device="cpu",
        transform=TRAIN,
        return_metadata=True,
        multiprocessing_context="fork",
    )
    ref = GpuCachedLoader(cache, num_workers=0, **kw)
    epochs = [_epoch(ref)[1] for _ in range(4)]
    with GpuCachedLoader(cache, num_workers=2, **kw) as loader:
        peek = next(iter(loader))  # a peek plays epoch 0's first batch, then is abandoned
        assert peek[2].indices.tolist() == epochs[0][:6]
        pids = loader.worker_pids
        assert loader.state_dict()["position"] == 6 and loader.epoch == 0
        assert _epoch(loader)[1] == epochs[1]  # the next iter() is a whole fresh epoch
        it = iter(loader)
        next(it)  # epoch 2, abandoned after one batch
        assert loader.worker_pids == pids  # the same workers serve every pass
        assert loader.state_dict()["epoch"] == 2
        assert _epoch(loader)[1] == epochs[3]
        assert loader.worker_pids == pids
        with pytest.raises(RuntimeError, match="superseded"):
            next(it)  # the abandoned iterator cannot steal the new pass's batches
        loader.set_epoch(1)
        assert _epoch(loader)[1] == epochs[1]
        assert loader.state_dict() == {**loader.state_dict(), "epoch": 2, "position": 0}


def test_sharding_splits_the_epoch_between_ranks(cache):
    orders = []
    for rank in range(3):
        loader = GpuCachedLoader(
            cache,
            batch_size=4,
            shuffle=True,
            seed=1,
            num_workers=0,
            device="cpu",
            num_replicas=3,
            rank=rank,
            return_metadata=True,
        )
        orders.append([i for _, _, info in loader for i in info.indices.tolist()])
    assert len({len(o) for o in orders}) == 1
    assert set(sum(orders, [])) == set(range(len(cache)))


def _ranks(cache, world, **kw):
    return [
        GpuCachedLoader(
            cache,
            batch_size=3,
            shuffle=True,
            num_workers=0,
            device="cpu",
            transform=TRAIN,
            return_metadata=True,
            num_replicas=world,
            rank=r,
            **kw,
        )
        for r in range(world)
    ]


@pytest.mark.parametrize("before, after, steps", [(4, 2, 2), (2, 3, 3), (3, 3, 2), (4, 1, 1)])
def test_resume_at_another_world_size_sees_each_remaining_sample_once(cache, before, after, steps):
    """Ranks (simulated in one process) play `steps` batches each in lockstep, then the epoch
    resumes from rank 0's state_dict on `after` ranks: the rest of the epoch, re-split."""
    old = _ranks(cache, before, seed=21)
    old[0].set_epoch(1)  # any epoch; the others advance by themselves
    for loader in old[1:]:
        _epoch(loader)
    its = [iter(loader) for loader in old]
    consumed = [i for it in its for _ in range(steps) for i in next(it)[2].indices.tolist()]
    states = [loader.state_dict() for loader in old]
    assert all(st == {**states[0], "num_replicas": before} for st in states)  # lockstep
    assert states[0]["epoch"] == 1 and states[0]["position"] == steps * 3 * before
    new = _ranks(cache, after, seed=None if after == 1 else 0)
    for loader in new:
        loader.load_state_dict(states[0])
    seen = [_epoch(loader)[1] for loader in new]
    assert len({len(s) for s in seen}) == 1  # every rank plays as many samples
    flat = sum(seen, [])
    remaining = set(range(len(cache))) - set(consumed)
    assert len(consumed) == len(set(consumed))
    assert set(flat) == remaining  # every remaining sample, none already consumed
    assert len(flat) - len(remaining) == (-len(remaining)) % after  # repeats: padding only
    order = old[0].sampling.global_order(1)
    assert sorted(consumed) == sorted(order[: len(consumed)])  # a prefix of the epoch's order
    for loader in new:  # then the next epoch, whole, on the new ranks
        assert loader.epoch == 2
    assert set(sum((_epoch(loader)[1] for loader in new), [])) == set(range(len(cache)))


def test_ranks_that_could_disagree_on_the_order_are_an_error(cache, monkeypatch):
    with pytest.raises(ValueError, match=r"no torch.distributed process group .* seed="):
        GpuCachedLoader(cache, batch_size=2, shuffle=True, num_replicas=2, rank=1)
    # without shuffling, or with a seed, there is nothing to agree on
    GpuCachedLoader(cache, batch_size=2, num_replicas=2, rank=1)
    GpuCachedLoader(cache, batch_size=2, shuffle=True, seed=3, num_replicas=2, rank=1)
    loader = GpuCachedLoader(cache, batch_size=2, shuffle=True)  # no process group: 1 rank
    assert (loader.num_replicas, loader.rank) == (1, 0)
    monkeypatch.setenv("WORLD_SIZE", "2")  # launched, but no process group initialised
    with pytest.warns(UserWarning, match="WORLD_SIZE=2.*process group"):
        GpuCachedLoader(cache, batch_size=2, shuffle=True)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(batch_size=0), "batch_size option should be an integer >= 1"),
        (dict(batch_size=2, num_workers=-1), "num_workers=0 to decode in the main process"),
        (dict(batch_size=2, prefetch_factor=0), "prefetch_factor"),
        (dict(batch_size=2, timeout=-1), "timeout option should be non-negative"),
        (dict(batch_size=2, backend="magic"), "backend must be one of"),
        (dict(batch_size=2, multiprocessing_context="threads"), "multiprocessing_context"),
        (dict(batch_size=2, rank=2, num_replicas=2), "rank should be in"),
        (dict(batch_size=2, num_replicas=0, rank=0), "num_replicas option should be"),
        (dict(batch_size=2, on_error="ignore"), "on_error"),
    ],
)
def test_invalid_arguments_say_what_and_how_to_fix(cache, kwargs, match):
    with pytest.raises(ValueError, match=match):
        GpuCachedLoader(cache, **kwargs)


def test_cuda_without_cuda_is_a_clear_error(cache):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        GpuCachedLoader(cache, batch_size=2, device="cuda")
    loader = GpuCachedLoader(cache, batch_size=2, device=None, num_workers=0)
    assert loader.device.type == "cpu" and loader.backend_name == "cpu"


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _fds() -> set[tuple[str, str]]:
    """This process's open descriptors with what they point to (a socket's inode is unique)."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
        except OSError:  # the descriptor listdir itself used
            pass
    return out


def _our_shm() -> set[str]:
    """Shared-memory files this process made (other processes on the machine make their own)."""
    if not os.path.isdir("/dev/shm"):
        return set()
    return {f for f in os.listdir("/dev/shm") if f.startswith(f"gpucache-{os.getpid()}-")}


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="lists descriptors in /proc")
def test_reiterations_and_early_breaks_leak_nothing(cache):
    # Compared: what this test added. Children and descriptors of earlier tests may still be
    # going away (garbage collection, a loaded machine) and must not count.
    gc.collect()
    before_fds, before_children = _fds(), _children()
    shm_before = _our_shm()

    def leaked():
        return _children() - before_children, _fds() - before_fds

    loader = GpuCachedLoader(
        cache,
        batch_size=4,
        shuffle=True,
        seed=0,
        num_workers=2,
        device="cpu",
        transform=TRAIN,
        multiprocessing_context="fork",
    )
    for k in range(20):
        for b, (_images, _) in enumerate(loader):
            if k % 2 and b == 1:
                break  # early break: the next epoch drains what was in flight
    workers = set(loader.worker_pids)
    assert len(workers) == 2 and workers <= _children()  # the same two, reused every epoch
    loader.close()
    loader.close()  # idempotent
    assert leaked() == (set(), set())
    for broke in (True, False):  # garbage collection alone also stops workers
        loader = GpuCachedLoader(
            cache, batch_size=4, num_workers=2, device="cpu", multiprocessing_context="fork"
        )
        for _ in loader:
            if broke:
                break
        del loader
        gc.collect()
        assert _children() - before_children == set()
    with GpuCachedLoader(cache, batch_size=4, num_workers=2, device="cpu") as loader:
        next(iter(loader))
    assert leaked() == (set(), set())
    assert _our_shm() == shm_before


def test_a_closed_loader_refuses_to_iterate_and_starts_no_workers(cache):
    loader = GpuCachedLoader(
        cache, batch_size=4, num_workers=2, device="cpu", multiprocessing_context="fork"
    )
    assert sum(len(labels) for _, labels in loader) == len(cache)
    pids = set(loader.worker_pids)
    assert len(pids) == 2
    loader.close()
    loader.close()  # idempotent
    before = _children()
    with pytest.raises(
        RuntimeError,
        match=r"close\(\).*Make a new GpuCachedLoader",
    ):
        next(iter(loader))
    assert loader.worker_pids == [] and _children() - before == set()
    with GpuCachedLoader(
        cache, batch_size=4, num_workers=2, device="cpu", multiprocessing_context="fork"
    ) as loader:
        next(iter(loader))
        assert len(loader.worker_pids) == 2
    with pytest.raises(RuntimeError, match="`with` block ended"):
        for _ in loader:
            pass
    assert loader.worker_pids == [] and _children() - before == set()
    loader.close()  # still idempotent after the `with` block


def test_killed_worker_raises_within_the_timeout(cache):
    loader = GpuCachedLoader(
        cache, batch_size=2, num_workers=2, device="cpu", timeout=20, multiprocessing_context="fork"
    )
    it = iter(loader)
    next(it)
    os.kill(loader.worker_pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"worker 1 .* killed by signal SIGKILL .* samples \["):
        for _ in it:
            pass
    assert time.monotonic() - start < 20
    assert loader.worker_pids == []


def _raise_in_worker(worker_id):
    if worker_id == 1:
        raise RuntimeError("boom from worker_init_fn")


def test_worker_exception_carries_the_original_traceback(cache):
    loader = GpuCachedLoader(
        cache,
        batch_size=2,
        num_workers=2,
        device="cpu",
        timeout=30,
        worker_init_fn=_raise_in_worker,
        multiprocessing_context="fork",
    )
    with pytest.raises(WorkerError, match="worker 1"):
        for _ in loader:
            pass


def test_hung_worker_times_out(cache):
    loader = GpuCachedLoader(
        cache, batch_size=2, num_workers=1, device="cpu", timeout=2, multiprocessing_context="fork"
    )
    it = iter(loader)
    next(it)
    os.kill(loader.worker_pids[0], signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(WorkerError, match="timeout=2"):
            for _ in it:
                pass
        assert time.monotonic() - start < 10
    finally:
        loader.close()


def test_dataloader_keywords_are_accepted(cache):
    g = torch.Generator().manual_seed(42)
    a = GpuCachedLoader(
        cache,
        batch_size=4,
        shuffle=True,
        generator=g,
        num_workers=0,
        device="cpu",
        return_metadata=True,
        transform=TRAIN,
    )
    b = GpuCachedLoader(
        cache,
        batch_size=4,
        shuffle=True,
        seed=42,
        num_workers=0,
        device="cpu",
        return_metadata=True,
        transform=TRAIN,
    )
    ea, eb = _epoch(a), _epoch(b)
    assert a.seed == b.seed and ea[1] == eb[1] and torch.equal(ea[0], eb[0])
    with pytest.warns(UserWarning, match="always keeps its workers"):
        GpuCachedLoader(cache, batch_size=4, persistent_workers=False)
    with pytest.raises(ValueError, match="seed or generator"):
        GpuCachedLoader(cache, batch_size=4, seed=1, generator=g)
