"""The loader's resume state: the dict ``state_dict()`` returns and ``load_state_dict()`` checks.

A state holds plain ints, bools and strings only, so it survives JSON and
``torch.load(weights_only=True)``. Besides where the epoch stands (seed, epoch, position) it holds
two fingerprints, so a state cannot silently resume a loader over other data of the same size:

- ``store``: a hash of the store's sample count, offsets and labels. Offsets are the byte layout of
  every sample, so another set of files (or the same files in another order) gives another value,
  while the same folder built again elsewhere, saved, opened or shared gives the same one on every
  rank and in every process. Cost: one pass over 16 bytes per sample (about 20 MB for ImageNet-1k),
  once per loader.
- ``sampling``: a hash of the loader's ``indices=``/``weights=`` (``"all"`` without them).

States saved before the fingerprints existed (versions 1 and 2) still load, with a warning.
"""

from __future__ import annotations

import hashlib
import operator
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from ..store._store import Store
    from ._sampling import Visits

VERSION = 3
_SEED_LIMIT = 2**63  # seeds are kept in [0, 2**63); epochs share the range
_REQUIRED = {
    1: ("seed", "epoch", "batches_done", "batch_size", "num_replicas", "samples"),
    2: ("seed", "epoch", "position", "samples", "shuffle", "batch_size", "num_replicas"),
}
_REQUIRED[3] = _REQUIRED[2]  # + the fingerprints, which a user may delete to skip the check
_FIX = "pass the dict that state_dict() returned, unchanged"


def _digest(*arrays: np.ndarray) -> str:
    h = hashlib.blake2b(digest_size=16)
    for a in arrays:
        h.update(np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).data)
    return "blake2b:" + h.hexdigest()


def store_fingerprint(cache: Store) -> str:
    """Sample count, offsets and labels of ``cache``: the same for any backing and process."""
    return _digest(
        np.array([len(cache)], dtype="<i8"),
        np.asarray(cache._offsets, "<i8"),
        np.asarray(cache.labels, "<i8"),
    )


def sampling_fingerprint(sampling: Visits) -> str:
    """The loader's ``indices=`` and ``weights=`` (as normalised), or ``"all"``."""
    if sampling.indices is None and sampling.weights is None:
        return "all"
    parts = [np.array([sampling.size], dtype="<i8")]
    for a, dtype in ((sampling.indices, "<i8"), (sampling.weights, "<f8")):
        parts += [
            np.array([-1 if a is None else len(a)], dtype="<i8"),
            np.asarray([] if a is None else a, dtype=dtype),
        ]
    return _digest(*parts)


def _integer(state: Mapping[str, Any], key: str, low: int, high: int | None, why: str) -> int:
    value = state[key]
    try:
        if isinstance(value, (bool, np.bool_)):
            raise TypeError
        number = operator.index(value)  # int, numpy integers, 0-d integer tensors
    except TypeError:
        raise TypeError(
            f"state_dict[{key!r}] must be an integer, got {type(value).__name__} {value!r}; {_FIX}."
        ) from None
    if number < low or (high is not None and number > high):
        span = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(
            f"state_dict[{key!r}] = {number} is outside {span} ({why}); the state "
            f"is corrupt or was not made by this loader's state_dict(); {_FIX}."
        )
    return number


def parse(
    state: object, *, samples: int, shuffle: bool, store: str, sampling: str
) -> tuple[int, int, int]:
    """``(seed, epoch, position)`` of a state saved by a loader over the same data, else a clear
    ``TypeError``/``ValueError``. Nothing is changed before the whole state has been checked."""
    if not isinstance(state, Mapping):
        raise TypeError(
            f"load_state_dict() takes the dict that GpuCachedLoader.state_dict() "
            f"returned, got {type(state).__name__}; {_FIX}."
        )
    version = (
        _integer(state, "version", 1, None, "versions count from 1") if "version" in state else 1
    )
    if version > VERSION:
        raise ValueError(
            f"this state_dict has version {version}, saved by a newer gpucache; this "
            f"one reads versions 1 to {VERSION}: upgrade gpucache to resume from it."
        )
    missing = [k for k in _REQUIRED[version] if k not in state]
    if missing:
        raise ValueError(
            f"state_dict (version {version}) lacks {', '.join(map(repr, missing))}; {_FIX}."
        )
    saved = _integer(state, "samples", 0, None, "a sample count")
    if saved != samples:
        raise ValueError(
            f"state_dict was saved with samples={saved}, this loader has {samples}; "
            "resume with the same store, indices= and weights=/num_samples=."
        )
    seed = _integer(state, "seed", 0, _SEED_LIMIT - 1, "seeds are kept in [0, 2**63)")
    epoch = _integer(state, "epoch", 0, _SEED_LIMIT - 1, "epochs count from 0")
    replicas = _integer(state, "num_replicas", 1, None, "a world size")
    batch = _integer(state, "batch_size", 1, None, "a batch size")
    if version == 1:  # batches done per rank, at an unchanged world size
        position = min(
            samples, _integer(state, "batches_done", 0, None, "a batch count") * batch * replicas
        )
    else:
        position = _integer(
            state, "position", 0, samples, f"samples of the epoch handed out, at most its {samples}"
        )
        if not isinstance(state["shuffle"], (bool, np.bool_)):
            raise TypeError(
                f"state_dict['shuffle'] must be True or False, got {state['shuffle']!r}; {_FIX}."
            )
        if bool(state["shuffle"]) != shuffle:
            raise ValueError(
                f"state_dict was saved with shuffle={bool(state['shuffle'])}, this "
                f"loader has {shuffle}; resume with the same shuffle setting."
            )
    _check_fingerprints(state, store=store, sampling=sampling)
    return seed, epoch, position


def _check_fingerprints(state: Mapping[str, Any], *, store: str, sampling: str) -> None:
    absent = [key for key in ("store", "sampling") if key not in state]
    if absent:
        warnings.warn(
            f"this state_dict has no {' or '.join(map(repr, absent))} fingerprint "
            "(saved by an older gpucache, or removed): it is loaded without checking "
            "that it was saved for this loader's data.",
            UserWarning,
            stacklevel=4,
        )
    for key, mine, what, fix in (
        (
            "store",
            store,
            "another store with as many samples (other files, labels or order)",
            "resume with the store it was saved with; if this store holds the same samples "
            "rebuilt another way (e.g. restart_markers=), delete state['store'] to load it "
            "without this check",
        ),
        (
            "sampling",
            sampling,
            "other indices= or weights=",
            "resume with the indices= and weights= it was saved with",
        ),
    ):
        if key in absent:
            continue
        if not isinstance(state[key], str):
            raise TypeError(
                f"state_dict[{key!r}] must be a fingerprint string, got "
                f"{type(state[key]).__name__}; {_FIX}."
            )
        if state[key] != mine:
            raise ValueError(
                f"state_dict was saved for {what}: its {key} fingerprint "
                f"{state[key]!r} is not this loader's {mine!r}; {fix}."
            )


def segments(state: Mapping[str, Any], sharded: bool) -> list[tuple[int, int, int, int]]:
    """The epoch's segments of a node-sharded loader's state, checked (``[]`` for a whole
    store's state): each ``[nodes, ranks per node, batch size, batches done]``."""
    have = "segments" in state
    if have != sharded:
        raise ValueError(
            "this state_dict was saved by a loader over a node-sharded store (shard='node') and "
            "this loader reads a whole one, or the reverse; resume with a store built the same "
            "way."
            if have or state.get("version", 1) >= 3
            else f"state_dict lacks 'segments'; {_FIX}."
        )
    if not sharded:
        return []
    raw = state["segments"]
    if not isinstance(raw, (list, tuple)):
        raise TypeError(f"state_dict['segments'] must be a list, got {type(raw).__name__}; {_FIX}.")
    out = []
    for i, seg in enumerate(raw):
        if not isinstance(seg, (list, tuple)) or len(seg) != 4:
            raise ValueError(
                f"state_dict['segments'][{i}] must be [nodes, ranks per node, batch size, "
                f"batches done], got {seg!r}; {_FIX}."
            )
        row = {f"segments[{i}][{j}]": v for j, v in enumerate(seg)}
        out.append(
            tuple(_integer(row, k, 1 if j < 3 else 0, None, "a count") for j, k in enumerate(row))
        )
    return out  # type: ignore[return-value]
