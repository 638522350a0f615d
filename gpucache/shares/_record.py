"""A node share's record in a store built with ``shard="node"``: three optional sections.

- ``share.layout`` (int64, 5): format version, canonical partitions, samples in the whole listing,
  nodes and this node's index at build time;
- ``share.ranks`` (int64, one per sample): each sample's global rank (``_partition.py``);
- ``share.listing`` (uint8, 32): the hex digest of the whole listing's identities in rank order,
  the same on every node that listed the same data;
- ``share.fetched`` (int64, 4): what its build read from the source (objects, bytes) and took
  from the node's stores of earlier layouts instead (objects, bytes).

A store without them holds the whole data set as it was listed (``cache.node_share`` is None).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

LAYOUT, RANKS, LISTING = "share.layout", "share.ranks", "share.listing"
FETCHED = "share.fetched"
SECTIONS = (LAYOUT, RANKS, LISTING, FETCHED)


class StoreShare(NamedTuple):
    """What ``cache.node_share`` says of a node-sharded store."""

    partitions: int
    total: int  # samples in the whole listing, every node's together (before skips)
    nodes: int  # the job's node count when the store was built
    node: int  # the node whose share it holds
    ranks: np.ndarray  # global rank of each sample of this store (read-only)
    listing: str  # fingerprint of the whole listing
    fetched: tuple[int, int, int, int]  # objects, bytes read from the source; objects, bytes reused


def sections(
    *,
    partitions: int,
    total: int,
    nodes: int,
    node: int,
    ranks: np.ndarray,
    listing: str,
    fetched: Sequence[int],
) -> dict[str, np.ndarray]:
    """The sections of a share."""
    return {
        LAYOUT: np.array([1, partitions, total, nodes, node], dtype="<i8"),
        RANKS: np.asarray(ranks, dtype="<i8"),
        LISTING: np.frombuffer(listing.encode("ascii"), dtype=np.uint8).copy(),
        FETCHED: np.asarray(fetched, dtype="<i8"),
    }


def share_of(extra: Mapping[str, np.ndarray]) -> StoreShare | None:
    """The store's share, or None for a store of the whole data set."""
    if LAYOUT not in extra:
        return None
    _, partitions, total, nodes, node = (int(x) for x in extra[LAYOUT])
    a, b, c, d = (int(x) for x in extra[FETCHED])
    return StoreShare(
        partitions,
        total,
        nodes,
        node,
        extra[RANKS],
        bytes(extra[LISTING]).decode("ascii"),
        (a, b, c, d),
    )


def problem(extra: Mapping[str, np.ndarray]) -> str | None:
    """What is wrong with a store's share sections (types and shapes checked by the caller)."""
    if LAYOUT not in extra:
        return None
    version, partitions, total, nodes, node = (int(x) for x in extra[LAYOUT])
    if version != 1 or partitions < 1 or total < 0 or not 0 <= node < nodes:
        return (
            f"section {LAYOUT!r} holds {extra[LAYOUT].tolist()}, not [1, partitions >= 1, "
            "total >= 0, nodes, 0 <= node < nodes]"
        )
    if partitions * max(total, 1) >= 2**62 or nodes > partitions:  # the bounds' math in int64
        return (
            f"section {LAYOUT!r} holds {partitions:,} partitions of {total:,} samples over "
            f"{nodes:,} nodes, beyond any listing a share is built from"
        )
    ranks = extra[RANKS]
    if ranks.size and (ranks.min() < 0 or ranks.max() >= total):
        return f"section {RANKS!r} holds ranks outside [0, {total})"
    if ranks.size > 1 and (np.diff(np.sort(ranks)) == 0).any():  # one sample, one rank
        return f"section {RANKS!r} holds a rank twice (two samples claim one place in the listing)"
    if (extra[FETCHED] < 0).any():
        return f"section {FETCHED!r} holds negative counts"
    listing = bytes(extra[LISTING])
    if not all(chr(c) in "0123456789abcdef" for c in listing):
        return f"section {LISTING!r} is not a hex digest"
    return None
