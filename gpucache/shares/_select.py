"""The build side of ``shard="node"``: take this node's share out of a whole listing (``pick``),
check that it fits before anything is read or fetched (``check_budget``), take the samples this
node's stores of earlier layouts hold instead of reading them (``reuse`` for inputs read in
place, ``found`` + ``Merged`` for objects fetched from storage), and record it all in the store
(``record``, ``_record.py``).

The share itself is a pure function of the listing's names and the node layout
(``_partition.py``); every node of the job computes it alone, with no communication. The
earlier stores are the node layer's to find (``node/_cache.py``, by the key every layout of one
source and options shares); it hands them to the build it runs with ``reusing``.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from typing import Any, NamedTuple, TypeVar

import numpy as np

from .._errors import ShareError
from ..ingest._inputs import BytesSource, Input, Samples, name_of
from ..ingest._lazy import OnAccess
from ..ingest._options import BuildOptions
from ..ingest._restart import rewriters
from . import _record
from ._partition import Selected, Share

T = TypeVar("T")

__all__ = [
    "Found",
    "Merged",
    "Names",
    "Picked",
    "Taken",
    "pick",
    "check_budget",
    "record",
    "reusing",
    "reuse",
    "found",
    "chosen",
    "held_earlier",
]

#: Stores of earlier node layouts of the same source, in this node's cache (``reusing``).
_REUSE: ContextVar[tuple[Any, ...]] = ContextVar("gpucache_share_reuse", default=())


class Picked(OnAccess[T]):
    """The items of ``seq`` at ``keep``, made on access (no list of the inputs)."""

    def __init__(self, seq: Sequence[T], keep: np.ndarray) -> None:
        self._seq, self._keep = seq, keep

    def __len__(self) -> int:
        return len(self._keep)

    def item(self, i: int) -> T:
        return self._seq[int(self._keep[i])]


class Names(OnAccess[str]):
    """The inputs' names, made on access."""

    def __init__(self, inputs: Sequence[Any]) -> None:
        self._inputs = inputs

    def __len__(self) -> int:
        return len(self._inputs)

    def item(self, i: int) -> str:
        return name_of(self._inputs[i])


class Taken(NamedTuple):
    """A node's share taken before its objects were fetched (``storage._objects``): which
    samples of the listing (``selected``), and which of them the node's stores of earlier layouts
    held (``reused``, a mask over them)."""

    selected: Selected
    reused: np.ndarray


def pick(
    share: Share, inputs: Sequence[Input], samples: Samples
) -> tuple[Sequence[Input], Samples, Selected]:
    """This node's inputs, with their labels, metadata and masks, out of the whole listing's."""
    selected = chosen(share, Names(inputs))
    keep = selected.keep
    metadata, masks = samples.metadata, samples.masks
    mine = Samples(
        np.asarray(samples.labels)[keep],
        samples.classes,
        None if metadata is None else Picked(metadata, keep),
        None if masks is None else Picked(masks, keep),
    )
    return Picked(inputs, keep), mine, selected


def chosen(share: Share, names: Sequence[str]) -> Selected:
    """This node's share of the listing ``names``; a :class:`ShareError` if it holds nothing."""
    selected = share.select(names)
    empty(selected, share)
    return selected


def empty(selected: Selected, share: Share) -> None:
    """A :class:`ShareError` for a node whose share of the listing holds nothing."""
    if len(selected.keep) or not selected.total:
        return
    raise ShareError(
        f"node {share.node} of {share.nodes}: its share of the {selected.total:,} samples listed "
        f"is empty (a node holds about 1/nodes of them). Fix: run on fewer nodes than samples, "
        "or build the whole data set on every node (shard=None)."
    )


def _free(folder: str) -> int | None:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def _size(n: int) -> str:
    """A byte count in words, exact below 1 GiB (a small share and a small cap both read 0.00
    GiB otherwise) and with the bytes above, where two decimals can hide which is larger."""
    gib = 2**30
    return f"{n:,} bytes" if n < gib else f"{n / gib:,.2f} GiB ({n:,} bytes)"


def check_budget(
    nbytes: int,
    share: Share,
    options: BuildOptions,
    *,
    memory: int,
    spool: bool = False,
    spooled: int | None = None,
) -> None:
    """A :class:`ShareError` with the numbers and the fix if this node's share of ``nbytes``
    does not fit in memory (a store is assembled in memory), in the node cache's file system
    (the store file, and the fetched objects beside it when ``spool``: the share's own, or
    ``spooled`` bytes of them), or under ``cache_max_bytes``."""
    fetched = (nbytes if spooled is None else spooled) if spool else 0
    need_disk = nbytes + fetched
    where = share.folder
    free = None if where is None else _free(where)
    cap = options.cache_max_bytes
    problems = []
    if memory > 0 and nbytes > memory:
        problems.append(f"this machine's memory is {_size(memory)}")
    if free is not None and need_disk > free:
        what = "the store and the fetched objects need" if spool else "the store needs"
        problems.append(f"{what} {_size(need_disk)} in {where}, which has {_size(free)} free")
    if cap is not None and nbytes > cap:
        problems.append(f"cache_max_bytes is {_size(cap)}")
    if not problems:
        return
    done = "No store was built, nothing fetched" if spool else "No store was built"
    raise ShareError(
        f"node {share.node} of {share.nodes}: its share of the data set is {_size(nbytes)}, "
        f"and {'; '.join(problems)}. {done}. Fix: run on more nodes (each node's share is "
        "about 1/nodes of the data), give the node cache a larger folder (cache_dir=) or a "
        "larger cache_max_bytes=, or pass shard=None on one node to check what the whole data "
        "set needs."
    )


def record(
    selected: Selected, share: Share, kept: np.ndarray, fetched: Sequence[int]
) -> dict[str, np.ndarray]:
    """The share sections of a store that kept the share's samples at positions ``kept``;
    ``fetched``: objects and bytes read from the source, objects and bytes reused."""
    return _record.sections(
        partitions=share.partitions,
        total=selected.total,
        nodes=share.nodes,
        node=share.node,
        ranks=selected.ranks[kept],
        listing=selected.listing,
        fetched=fetched,
    )


@contextlib.contextmanager
def reusing(stores: Sequence[Any]) -> Iterator[None]:
    """Builds inside take the samples these stores (earlier shares of the same source and
    options on this node) hold instead of reading them from the source."""
    token = _REUSE.set(tuple(stores))
    try:
        yield
    finally:
        _REUSE.reset(token)


class Found(NamedTuple):
    """What this node's stores of earlier layouts hold of a share, one entry per share position
    (arrays, no object per sample): ``which`` store (-1: none) and the sample's index ``at``
    there."""

    stores: tuple[Any, ...]
    which: np.ndarray
    at: np.ndarray

    @classmethod
    def none(cls, n: int) -> Found:
        """Nothing held of a share of ``n`` samples."""
        return cls((), np.full(n, -1, dtype=np.int32), np.zeros(n, dtype=np.int64))

    @property
    def held(self) -> np.ndarray:
        """The share positions an earlier store holds."""
        return self.which >= 0

    def nbytes(self) -> int:
        """Bytes of the samples held (their images)."""
        total = 0
        for k, store in enumerate(self.stores):
            i = self.at[self.which == k]
            total += int((store._offsets[i + 1] - store._offsets[i]).sum())
        return total


def found(selected: Selected, with_masks: bool) -> Found:
    """The share positions an earlier share on this node holds (the first store that holds one
    gives it), among the stores ``reusing`` handed over with the same listing and masks."""
    stores = tuple(
        s
        for s in _REUSE.get()
        if s.node_share is not None
        and s.node_share.listing == selected.listing
        and with_masks == (s.masks is not None)
        and len(s)
    )
    _, which, where = Found.none(len(selected.ranks))
    for k, store in enumerate(stores):
        ranks = np.asarray(store.node_share.ranks)
        order = np.argsort(ranks)
        at = np.minimum(np.searchsorted(ranks[order], selected.ranks), len(ranks) - 1)
        new = (ranks[order][at] == selected.ranks) & (which < 0)
        which[new], where[new] = k, order[at[new]]
    return Found(stores, which, where)


def held_earlier(selected: Selected, options: BuildOptions, with_masks: bool) -> Found:
    """What this node's stores of earlier layouts hold of the share (``found``), or nothing when
    the build re-encodes: its stored bytes are then not the source's."""
    rewrites = rewriters(
        restart_markers=options.restart_markers,
        max_side=options.max_side,
        jpeg_quality=options.jpeg_quality,
    )
    return Found.none(len(selected.keep)) if rewrites else found(selected, with_masks)


def reuse(
    selected: Selected, inputs: Sequence[Any], masks: Sequence[Any] | None
) -> tuple[Sequence[Any], Sequence[Any] | None, np.ndarray]:
    """``inputs`` (and ``masks``) with every sample an earlier share holds taken from it (bytes
    as stored: no read of the source), and a mask of the positions so taken."""
    hits = found(selected, masks is not None)
    held = hits.held
    if not held.any():
        return inputs, masks, held
    rest = np.flatnonzero(~held)
    return (
        Merged(Picked(inputs, rest), hits, Names(inputs)),
        None if masks is None else Merged(Picked(masks, rest), hits, Names(masks), masks=True),
        held,
    )


class Merged(OnAccess[Any]):
    """A share's inputs: those an earlier store holds (``hits``) taken from it, the rest from
    ``fetched`` in order (``fetched[offset:]`` for the masks, with ``masks``); ``names`` name
    the samples taken."""

    def __init__(
        self,
        fetched: Sequence[Any],
        hits: Found,
        names: Sequence[str],
        *,
        offset: int = 0,
        masks: bool = False,
    ) -> None:
        self._fetched, self._hits, self._names = fetched, hits, names
        self._offset, self._masks = offset, masks
        self._rank = np.cumsum(~hits.held) - 1  # position among the fetched

    def __len__(self) -> int:
        return len(self._rank)

    def item(self, i: int) -> Any:
        k = int(self._hits.which[i])
        if k < 0:
            return self._fetched[self._offset + int(self._rank[i])]
        store, j = self._hits.stores[k], int(self._hits.at[i])
        return BytesSource(self._names[i], store.masks[j] if self._masks else store[j])
