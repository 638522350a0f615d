"""The loader's resume state: values checked with clear errors, a store fingerprint that refuses a
state of other data, the same fingerprint for every backing and process, old states still load."""

import dataclasses
import json
import multiprocessing as mp
import warnings

import numpy as np
import pytest
import torch

from gpucache import GpuCachedLoader, JpegCache

KW = dict(batch_size=5, shuffle=True, seed=9, num_workers=0, device="cpu", return_metadata=True)


@pytest.fixture(scope="module")
def cache(small_folder):
    return JpegCache.from_folder(small_folder, progress=False)


def _order(loader) -> list[int]:
    return [i for _, _, info in loader for i in info.indices.tolist()]


@pytest.fixture()
def saved(cache):
    """A state three batches into epoch 1, and the rest of that epoch."""
    loader = GpuCachedLoader(cache, **KW)
    _order(loader)
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    ref = GpuCachedLoader(cache, **KW)
    ref.set_epoch(1)
    return state, _order(ref)[15:]


def _store_fingerprint(path: str) -> str:
    return GpuCachedLoader(
        JpegCache.open(path), batch_size=2, num_workers=0, device="cpu"
    ).state_dict()["store"]


def test_the_store_fingerprint_is_the_same_for_every_backing_and_process(
    cache, small_folder, tmp_path
):
    mine = GpuCachedLoader(cache, batch_size=2, num_workers=0, device="cpu").state_dict()["store"]
    path = cache.save(tmp_path / "s.gpucache")
    shared = JpegCache.from_folder(small_folder, progress=False).share()
    with mp.get_context("spawn").Pool(1) as pool:  # another process, as another rank would
        other = pool.apply(_store_fingerprint, (str(path),))
    assert {
        mine,
        _store_fingerprint(str(path)),
        other,
        GpuCachedLoader(
            shared, batch_size=3, num_workers=0, device="cpu", num_replicas=2, rank=1
        ).state_dict()["store"],
    } == {mine}
    assert mine.startswith("blake2b:")
    reordered = JpegCache.from_files(list(cache.paths)[::-1], progress=False)
    relabeled = JpegCache.from_files(list(cache.paths), [0] * len(cache), progress=False)
    for other_store in (reordered, relabeled):
        assert (
            GpuCachedLoader(other_store, batch_size=2, num_workers=0, device="cpu").state_dict()[
                "store"
            ]
            != mine
        )


def test_a_state_of_another_store_of_the_same_size_is_refused(cache, saved):
    state, rest = saved
    other = JpegCache.from_files(list(cache.paths)[::-1], progress=False)  # same size, other order
    loader = GpuCachedLoader(other, **KW)
    before = loader.state_dict()
    with pytest.raises(
        ValueError,
        match=r"another store with as many samples.*"
        r"delete state\['store'\]",
    ):
        loader.load_state_dict(state)
    assert loader.state_dict() == before  # nothing changed
    unchecked = {k: v for k, v in state.items() if k != "store"}
    with pytest.warns(UserWarning, match="no 'store' fingerprint"):
        loader.load_state_dict(unchecked)  # the documented way to skip the check
    assert loader.state_dict()["position"] == 15


def test_a_state_of_another_subset_of_the_same_size_is_refused(cache):
    even, odd = np.arange(0, len(cache), 2), np.arange(1, len(cache), 2)
    state = GpuCachedLoader(cache, indices=even, **KW).state_dict()
    with pytest.raises(ValueError, match="other indices= or weights="):
        GpuCachedLoader(cache, indices=odd, **KW).load_state_dict(state)
    weighted = GpuCachedLoader(cache, weights=np.ones(len(cache)), **KW).state_dict()
    with pytest.raises(ValueError, match="sampling fingerprint"):
        GpuCachedLoader(cache, **KW).load_state_dict(weighted)
    GpuCachedLoader(cache, indices=even.copy(), **KW).load_state_dict(state)  # the same subset


@pytest.mark.parametrize(
    "key, value, error, match",
    [
        ("position", -1, ValueError, r"'position'\] = -1 is outside \[0, 40\]"),
        ("position", 10**12, ValueError, r"'position'\] = 1000000000000 is outside \[0, 40\]"),
        ("position", True, TypeError, r"'position'\] must be an integer, got bool"),
        ("position", "8", TypeError, r"'position'\] must be an integer, got str"),
        ("position", 4.9, TypeError, r"'position'\] must be an integer, got float"),
        ("position", None, TypeError, r"'position'\] must be an integer"),
        ("epoch", -1, ValueError, r"'epoch'\] = -1 is outside"),
        ("epoch", 2**64, ValueError, r"'epoch'\] = \d+ is outside"),
        ("seed", -5, ValueError, r"'seed'\] = -5 is outside \[0, 9223372036854775807\]"),
        ("seed", 2**63, ValueError, r"'seed'\] = \d+ is outside"),
        ("seed", "9", TypeError, r"'seed'\] must be an integer"),
        ("samples", -40, ValueError, r"'samples'\] = -40 is outside"),
        ("samples", 41, ValueError, "saved with samples=41, this loader has 40"),
        ("shuffle", "yes", TypeError, r"'shuffle'\] must be True or False"),
        ("shuffle", False, ValueError, "saved with shuffle=False, this loader has True"),
        ("batch_size", 0, ValueError, r"'batch_size'\] = 0 is outside"),
        ("num_replicas", [2], TypeError, r"'num_replicas'\] must be an integer, got list"),
        ("store", 7, TypeError, r"'store'\] must be a fingerprint string"),
        ("version", 99, ValueError, "version 99, saved by a newer gpucache.*upgrade"),
        ("version", "3", TypeError, r"'version'\] must be an integer"),
    ],
)
def test_bad_values_are_refused_clearly_and_change_nothing(cache, saved, key, value, error, match):
    state, _ = saved
    loader = GpuCachedLoader(cache, **KW)
    before = loader.state_dict()
    with pytest.raises(error, match=match):
        loader.load_state_dict({**state, key: value})
    assert loader.state_dict() == before


@pytest.mark.parametrize(
    "state, error, match",
    [
        (None, TypeError, r"takes the dict that GpuCachedLoader.state_dict\(\) returned, got None"),
        ([1, 2], TypeError, "got list"),
        ({}, ValueError, "lacks 'seed', 'epoch', 'batches_done'"),
        ({"version": 3, "seed": 1}, ValueError, "lacks 'epoch', 'position', 'samples'"),
    ],
)
def test_garbage_is_a_clear_error(cache, state, error, match):
    with pytest.raises(error, match=match):
        GpuCachedLoader(cache, **KW).load_state_dict(state)


def test_a_state_survives_json_and_torch_load_and_takes_numpy_integers(cache, saved, tmp_path):
    state, rest = saved
    torch.save(state, tmp_path / "state.pt")
    for copy in (
        json.loads(json.dumps(state)),
        torch.load(tmp_path / "state.pt"),
        {**state, "position": np.int64(15), "epoch": torch.tensor(1)},
    ):
        loader = GpuCachedLoader(cache, **{**KW, "seed": 0})
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a complete state loads without a warning
            loader.load_state_dict(copy)
        assert _order(loader) == rest


def test_a_state_of_another_seed_reseeds_the_order_and_the_decode_options(cache, saved):
    state, rest = saved
    loader = GpuCachedLoader(cache, **{**KW, "seed": 0})
    before = loader.decode_options
    loader.load_state_dict(state)
    assert loader.seed == loader.sampling.seed == loader.decode_options.seed == 9
    assert dataclasses.replace(loader.decode_options, seed=0) == before  # only the seed changed
    assert _order(loader) == rest


def test_states_without_fingerprints_still_load_with_a_warning(cache, saved):
    state, rest = saved
    v2 = {k: v for k, v in state.items() if k not in ("store", "sampling")} | {"version": 2}
    v1 = {
        "seed": 9,
        "epoch": 1,
        "batches_done": 3,
        "batch_size": 5,
        "num_replicas": 1,
        "samples": len(cache),
    }
    for old in (v2, v1):
        loader = GpuCachedLoader(cache, **KW)
        with pytest.warns(UserWarning, match="no 'store' or 'sampling' fingerprint"):
            loader.load_state_dict(old)
        assert _order(loader) == rest
    with pytest.raises(ValueError, match=r"'batches_done'\] = -3"):
        GpuCachedLoader(cache, **KW).load_state_dict({**v1, "batches_done": -3})
