"""Node shares: which samples each node of a job holds with ``shard="node"`` (a pure function).

Every node lists the same data and computes the same thing, with no communication:

- a sample's *identity* is its name with the listing's common folder taken off (``ants/1.jpg``
  whether the share is mounted at ``/mnt/data/train/`` or ``/data/train/``, ``s3://b/train/`` or
  a local copy of it);
- its *global rank* is its place in the order of a salted hash of the identity (ties: listing
  order), so ranks are a random permutation of the listing: no class folder, no run of files and no
  tar shard lands in one place;
- ``PARTITIONS`` canonical partitions cut the rank order into runs of equal size within one sample
  (rank ``j`` of ``N`` is in partition ``j * P // N``), each a random sample of the data;
- node ``k`` of ``n`` owns partitions ``[k * P // n, (k + 1) * P // n)``, that is one run of
  ranks, so node shares are equal within one sample whenever ``n`` divides ``P`` (every count from 1
  to 10, 12, 14, 15, 16, 18, 20, 21, 24, 28, 30, 32, ..., every power of two to 1024), and
  changing the node count moves as little as contiguous runs allow (2 -> 3 nodes: node 0 keeps its
  new share whole, node 1 fetches half of its own).

The base layer: the store records a share (``_record.py``), the build selects it
(``_select.py``), the loader orders it (``_order.py``).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

#: Canonical partitions: 2**10 * 3**2 * 5 * 7, so most node counts divide it.
PARTITIONS = 322_560
_SALT = b"gpucache-share-1"
VERSION = 1

__all__ = [
    "PARTITIONS",
    "Selected",
    "Share",
    "common_cut",
    "global_ranks",
    "identity_hashes",
    "node_bounds",
    "owners",
]


def _cut(names: Sequence[str]) -> int:
    """How many leading bytes every name shares up to and including a ``/``: the folder all of
    them are in (one pass, nothing kept but the prefix)."""
    common: bytes | None = None
    for i in range(len(names)):
        e = os.fsencode(names[i])
        if common is None:
            common = e
        elif not e.startswith(common):
            k = 0
            for x, y in zip(common, e):
                if x != y:
                    break
                k += 1
            common = common[:k]
    return 0 if common is None else common.rfind(b"/") + 1


def identity_hashes(names: Sequence[str], cut: int) -> np.ndarray:
    """The salted 64-bit hash (``<u8``) of each name's identity: its bytes after the first
    ``cut`` (the folder every name of the listing is in, :func:`common_cut`)."""
    base, out = hashlib.blake2b(digest_size=8, key=_SALT), bytearray()
    for i in range(len(names)):
        one = base.copy()
        one.update(os.fsencode(names[i])[cut:])
        out += one.digest()
    return np.frombuffer(bytes(out), dtype="<u8")


common_cut = _cut


def global_ranks(names: Sequence[str]) -> tuple[np.ndarray, str]:
    """``(ranks, fingerprint)``: each name's place in the hash order of the listing (int64, a
    permutation of ``range(len(names))``), and a digest of the identities' hashes in that order,
    the same on every node that listed the same data.

    Two passes over ``names`` (a sequence made on access is fine: no list of them is kept), 8
    bytes a name plus the ranks."""
    n = len(names)
    h = identity_hashes(names, _cut(names))
    order = np.lexsort((np.arange(n), h))  # by hash, ties by listing order
    ranks = np.empty(n, dtype=np.int64)
    ranks[order] = np.arange(n, dtype=np.int64)
    digest = hashlib.blake2b(_SALT, digest_size=16)
    digest.update(np.ascontiguousarray(h[order]).astype("<u8").tobytes())
    return ranks, digest.hexdigest()


def node_bounds(total: int, nodes: int, partitions: int = PARTITIONS) -> np.ndarray:
    """``nodes + 1`` global ranks: node ``k`` holds ranks ``[b[k], b[k + 1])`` of ``total``."""
    first_partition = np.arange(nodes + 1, dtype=np.int64) * partitions // nodes
    # rank j is in partition j * P // N: the first rank of partition p is ceil(p * N / P)
    return -(-first_partition * total // partitions)


def owners(ranks: np.ndarray, total: int, nodes: int, partitions: int = PARTITIONS) -> np.ndarray:
    """The node that holds each global rank at ``nodes`` nodes."""
    bounds = node_bounds(total, nodes, partitions)
    return np.searchsorted(bounds, ranks, side="right").astype(np.int64) - 1


@dataclass(frozen=True)
class Share:
    """The share one node builds: node ``node`` of ``nodes``, of ``partitions`` partitions.

    ``folder`` (not part of the key or the repr): where the node's store will live, for the
    budget check made before any byte is read or fetched. ``extra``: global ranks of other
    nodes' shares the node holds too (ascending), the few samples it plays to finish an epoch
    resumed at another node count (``shares._order``: the nodes' remainders rebalanced)."""

    nodes: int
    node: int
    partitions: int = PARTITIONS
    folder: str | None = field(default=None, compare=False, repr=False)
    extra: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.node < self.nodes:
            raise ValueError(f"node {self.node} is not in [0, {self.nodes})")
        if any(b <= a for a, b in zip(self.extra, self.extra[1:])) or any(
            r < 0 for r in self.extra
        ):
            raise ValueError(f"extra ranks must ascend and be >= 0, got {self.extra[:8]}...")

    def likely(self, hashes: np.ndarray, total: int, sigmas: float = 4.0) -> np.ndarray:
        """Which identity hashes (:func:`identity_hashes`) are likely in this share of a listing
        of about ``total`` samples, before the listing is whole (a scan that cannot keep
        everything until it has seen every name): the share is the run of the hash order
        between two quantiles of the ``total`` hashes, and a quantile ``q`` of ``total``
        uniform hashes lies within ``sqrt(q (1 - q) / total)`` (one standard deviation) of
        ``q`` of the hash space; this keeps the hashes within ``sigmas`` of them (an
        overestimated ``total`` narrows the margin: a sample of the share outside it is then
        read later, never lost)."""
        first = node_bounds(self.partitions, self.nodes, self.partitions)
        lo, hi = (float(first[k]) / self.partitions for k in (self.node, self.node + 1))
        n = max(int(total), 1)
        below, above = (sigmas * float(np.sqrt(q * (1 - q) / n)) for q in (lo, hi))
        at = np.asarray(hashes, dtype="<u8").astype(np.float64) / 2.0**64
        likely: np.ndarray = (at >= lo - below) & (at < hi + above)
        return likely

    def select(self, names: Sequence[str]) -> Selected:
        """This node's samples of the whole listing ``names``."""
        ranks, fingerprint = global_ranks(names)
        lo, hi = node_bounds(len(names), self.nodes, self.partitions)[self.node : self.node + 2]
        mine = (ranks >= lo) & (ranks < hi)
        if self.extra:  # the other shares' samples it plays to finish a resumed epoch
            mine |= np.isin(ranks, np.asarray(self.extra, dtype=np.int64))
        keep = np.flatnonzero(mine)
        return Selected(keep, ranks[keep], len(names), fingerprint)


class Selected(NamedTuple):
    """A node's share of a listing: ``keep``, the listing positions of its samples (in listing
    order); ``ranks``, their global ranks; ``total``, the listing's size; ``listing``, its
    fingerprint."""

    keep: np.ndarray
    ranks: np.ndarray
    total: int
    listing: str
