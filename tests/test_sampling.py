"""Subsets (indices=) and weighted sampling (weights=) of one store, sharded like the rest."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from gpucache import GpuCachedLoader, JpegCache


@pytest.fixture(scope="module")
def cache(small_folder):
    return JpegCache.from_folder(small_folder, progress=False)


def _loader(cache, **kw):
    kw.setdefault("num_workers", 0)
    return GpuCachedLoader(cache, batch_size=4, device="cpu", seed=5, **kw)


def _visited(loader) -> list[int]:
    return [i for _, _, info in loader for i in info.indices.tolist()]


def test_indices_split_one_store_without_copying(cache):
    rng = np.random.default_rng(0)
    perm = rng.permutation(len(cache))
    train, val = perm[:30], perm[30:]
    tl = _loader(cache, indices=train, shuffle=True, return_metadata=True)
    vl = _loader(cache, indices=val, return_metadata=True)
    assert tl.cache is cache and len(tl) == 8 and len(vl) == 3
    seen_train = _visited(tl)
    assert sorted(seen_train) == sorted(train.tolist()) and seen_train != train.tolist()
    assert _visited(vl) == val.tolist()  # unshuffled: the order given
    labels = torch.cat([y for _, y in _loader(cache, indices=val)])
    assert labels.tolist() == cache.labels[val].tolist()
    mask = np.zeros(len(cache), dtype=bool)
    mask[val] = True
    assert _visited(_loader(cache, indices=mask, return_metadata=True)) == sorted(val.tolist())


def test_weighted_draws_follow_the_weights_and_the_seed(cache):
    w = np.zeros(len(cache))
    w[:4] = [1, 1, 2, 4]  # only 4 samples can be drawn, in ratio 1:1:2:4
    loader = _loader(cache, weights=w, num_samples=8000)
    order = loader.epoch_indices(0)
    assert len(order) == 8000 and len(loader) == 2000
    counts = Counter(order.tolist())
    assert set(counts) == {0, 1, 2, 3}
    for i, share in zip(range(4), [1 / 8, 1 / 8, 2 / 8, 4 / 8]):
        assert abs(counts[i] / 8000 - share) < 0.02, counts
    again = _loader(cache, weights=w, num_samples=8000)
    assert np.array_equal(again.epoch_indices(0), order)  # the seed decides
    assert not np.array_equal(loader.epoch_indices(1), order)  # each epoch draws anew
    with_subset = _loader(cache, indices=[10, 20, 30], weights=[0, 1, 3], num_samples=400)
    c = Counter(with_subset.epoch_indices(0).tolist())
    assert set(c) == {20, 30} and c[30] > 2 * c[20]


def test_weighted_draws_are_sharded_across_ranks(cache):
    w = np.arange(len(cache), dtype=float)
    whole = _loader(cache, weights=w, num_samples=37).epoch_indices(3)
    ranks = [
        _loader(cache, weights=w, num_samples=37, num_replicas=3, rank=r).epoch_indices(3)
        for r in range(3)
    ]
    assert all(len(r) == 13 for r in ranks)  # 37 padded to 39, 13 each
    interleaved = np.stack(ranks, 1).reshape(-1)
    assert np.array_equal(interleaved[:37], whole) and np.array_equal(interleaved[37:], whole[:2])


def test_resume_mid_epoch_with_a_subset(cache):
    sub = np.arange(0, len(cache), 2)
    a = _loader(cache, indices=sub, shuffle=True, return_metadata=True)
    it = iter(a)
    first = [next(it)[2].indices.tolist() for _ in range(2)]
    state = a.state_dict()
    b = _loader(cache, indices=sub, shuffle=True, return_metadata=True)
    b.load_state_dict(state)
    rest = _visited(b)
    assert sorted(sum(first, []) + rest) == sorted(sub.tolist())
    with pytest.raises(ValueError, match="samples"):
        _loader(cache).load_state_dict(state)  # a different subset size is refused


def test_bad_subsets_and_weights_are_clear_errors(cache):
    n = len(cache)
    with pytest.raises(IndexError, match=rf"out of range for a store of {n}"):
        _loader(cache, indices=[0, n])
    with pytest.raises(ValueError, match="boolean indices mask"):
        _loader(cache, indices=np.ones(3, dtype=bool))
    with pytest.raises(ValueError, match="one number per store sample"):
        _loader(cache, weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="not all zero"):
        _loader(cache, weights=np.zeros(n))
    with pytest.raises(ValueError, match="goes with weights"):
        _loader(cache, num_samples=5)


def test_class_balanced_sampling_on_a_photo_folder(photo_folder):
    cache = JpegCache.from_folder(photo_folder, progress=False)
    ants, bees = np.flatnonzero(cache.labels == 0), np.flatnonzero(cache.labels == 1)
    subset = np.concatenate([ants, bees[:20]])  # an imbalanced split of one store
    counts = np.bincount(cache.labels[subset])
    weights = 1.0 / counts[cache.labels[subset]]  # class-balanced within the split
    loader = GpuCachedLoader(
        cache,
        batch_size=8,
        device="cpu",
        num_workers=0,
        seed=1,
        indices=subset,
        weights=weights,
        num_samples=4000,
    )
    order = loader.epoch_indices(0)
    assert set(order.tolist()) <= set(subset.tolist())
    drawn = np.bincount(cache.labels[order], minlength=2)
    assert np.abs(drawn / drawn.sum() - 0.5).max() < 0.03, (counts, drawn)
    val = np.flatnonzero(cache.labels == 1)[:12]  # a split of the photos, decoded
    sub = GpuCachedLoader(cache, batch_size=6, device="cpu", num_workers=0, indices=val)
    labels = torch.cat([y for _, y in sub])
    assert labels.tolist() == [1] * 12
