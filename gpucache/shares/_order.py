"""The epoch order over node-sharded stores (``shard="node"``): each node plays its own share.

Node ``k`` of ``n`` holds the global ranks ``[b[k], b[k + 1])`` (``_partition.py``). In an epoch
it visits them in the order ``default_rng([seed, epoch, n, k]).permutation`` (or rank order
unshuffled), and deals them to its ``r`` ranks slot by slot (slot ``i`` to local rank ``i % r``);
batch ``b`` of every rank of the node takes the node's slots ``[b B r, (b + 1) B r)``.

Every rank gets the same number of samples, and so of batches, by construction, computed alone
from share sizes that every rank knows (no rank waits on another at an epoch's end):
``m = max_k ceil(len_k / r)`` samples in ``ceil(m / B)`` batches, the last one short, nodes with
fewer samples padding by repeating their own from the start (``drop_last``: ``floor(min_k
floor(len_k / r) / B)`` whole batches, the rest of each node dropped). So the global batch of
step ``b`` is ``B r`` samples of each node's random share: a stratified sample of a global
shuffle.

Resuming: a state lists the epoch's *segments* ``(nodes, ranks per node, batch size, batches
done)``, one per layout the epoch ran under. What a segment consumed is a pure function of the
segments before it, so any rank at any node count can tell which samples of the epoch remain;
each node then plays the remaining samples of its (new) share, in its order, as above. A sample
the node's build left out (a corrupt file) is a hole in its slots, filled by another of the
node's samples (counted as padding).
"""

from __future__ import annotations

import hashlib
from typing import Any, NamedTuple

import numpy as np

from .._errors import ShareError
from ..base import _dist
from ._partition import node_bounds
from ._record import StoreShare


class Segment(NamedTuple):
    """Part of an epoch played under one layout."""

    nodes: int
    per_node: int  # ranks per node
    batch_size: int
    batches_done: int


class RankPlan(NamedTuple):
    """What one rank plays of an epoch's segment."""

    indices: np.ndarray  # store indices, batches * batch_size of them
    batches: int
    padded: int  # repeats this rank plays (its node's padding and holes, its part of them)
    dropped: int  # samples of this rank's node left out by drop_last


def fingerprint(share: StoreShare) -> str:
    """The state's ``store`` fingerprint of a sharded store: the whole listing's, the same on
    every node and at every node count."""
    h = hashlib.blake2b(b"gpucache-share-state", digest_size=16)
    h.update(f"{share.listing}\0{share.total}\0{share.partitions}".encode())
    return "blake2b:" + h.hexdigest()


class NodeOrder:
    """The orders of a job whose store on this node is ``share``, at its layout."""

    def __init__(self, share: StoreShare, *, num_replicas: int, rank: int) -> None:
        nodes = share.nodes
        if num_replicas % nodes:
            raise ShareError(
                f"this store holds node {share.node}'s share of {nodes} nodes, but the loader "
                f"has num_replicas={num_replicas} ranks, which {nodes} nodes cannot split "
                "evenly; build the store in the job that reads it (the same nodes and ranks "
                "per node)."
            )
        self.share, self.nodes, self.per_node = share, nodes, num_replicas // nodes
        self.node, self.local = divmod(rank, self.per_node)
        if self.node != share.node:
            raise ShareError(
                f"rank {rank} is on node {self.node} of {nodes} ({self.per_node} ranks a node), "
                f"but its store holds node {share.node}'s share; build the store in every rank "
                "of the job that reads it (JpegCache.from_...(shard='node')), so each node "
                "builds its own share."
            )
        self.total, self.partitions = share.total, share.partitions
        lo, hi = (int(x) for x in node_bounds(self.total, nodes, self.partitions)[self.node :][:2])
        ranks = np.asarray(share.ranks)
        own = int(((ranks >= lo) & (ranks < hi)).sum())
        if hi - lo > 4 * own + 4096:  # an epoch's order costs the share's size: never a lie's
            raise ShareError(
                f"this store holds {own:,} samples of node {share.node}'s share, but its share "
                f"record makes that share {hi - lo:,} samples of a listing of {self.total:,}: "
                "the record does not describe this store (altered after its build, or another "
                "build's). Rebuild it in the job that reads it (JpegCache.from_...(shard='node'))."
            )
        by_rank = np.argsort(share.ranks, kind="stable")
        self._sorted, self._store_index = np.asarray(share.ranks)[by_rank], by_rank

    # ---------------------------------------------------------------- pure functions
    def stream(self, seed: int, epoch: int, nodes: int, k: int, shuffle: bool) -> np.ndarray:
        """Node ``k``'s global ranks at ``nodes`` nodes, in the epoch's order."""
        lo, hi = (int(x) for x in node_bounds(self.total, nodes, self.partitions)[k : k + 2])
        if not shuffle:
            return np.arange(lo, hi, dtype=np.int64)
        return lo + np.random.default_rng([seed, epoch, nodes, k]).permutation(hi - lo)

    def _left(
        self, seed: int, epoch: int, shuffle: bool, done: np.ndarray, nodes: int, per_node: int
    ) -> list[np.ndarray]:
        """Each node's slots at ``nodes`` nodes of ``per_node`` ranks once the ranks ``done``
        were consumed: its stream's unconsumed samples, rebalanced (:func:`balanced`)."""
        rests = []
        for k in range(nodes):
            s = self.stream(seed, epoch, nodes, k, shuffle)
            rests.append(s[~done[s]])
        return balanced(rests, per_node)

    def _rests(
        self, seed: int, epoch: int, shuffle: bool, prior: list[Segment], nodes: int
    ) -> tuple[list[np.ndarray], np.ndarray | None]:
        """Each node's remaining slots at ``nodes`` nodes (of this layout's ranks) after
        ``prior`` (and the consumed mask, None when nothing was consumed)."""
        done = self.consumed(seed, epoch, shuffle, prior)
        if done is None:
            return [self.stream(seed, epoch, nodes, k, shuffle) for k in range(nodes)], None
        return self._left(seed, epoch, shuffle, done, nodes, self.per_node), done

    def consumed(
        self, seed: int, epoch: int, shuffle: bool, segments: list[Segment]
    ) -> np.ndarray | None:
        """Which global ranks the ``segments`` consumed (None: none yet). A segment after
        another that consumed samples played the rebalanced remainders (:func:`balanced`)."""
        if not any(s.batches_done for s in segments):
            return None
        done = np.zeros(self.total, dtype=bool)
        started = False  # an earlier segment consumed samples: this one was rebalanced
        for seg in segments:
            take = seg.batches_done * seg.batch_size * seg.per_node
            if started:
                slots = self._left(seed, epoch, shuffle, done, seg.nodes, seg.per_node)
            else:
                slots = [self.stream(seed, epoch, seg.nodes, k, shuffle) for k in range(seg.nodes)]
            for p in [x[:take] for x in slots]:
                done[p] = True
            started = started or take > 0
        return done

    def foreign(self, seed: int, epoch: int, shuffle: bool, prior: list[Segment]) -> np.ndarray:
        """Global ranks of other nodes' shares that this node plays in the rest of ``epoch``
        after ``prior`` (its remainder rebalanced) and that its store does not hold, ascending;
        none for an epoch from its start."""
        if not any(s.batches_done for s in prior):
            return np.zeros(0, dtype=np.int64)
        rests, _ = self._rests(seed, epoch, shuffle, prior, self.nodes)
        mine = rests[self.node]
        lo, hi = node_bounds(self.total, self.nodes, self.partitions)[self.node : self.node + 2]
        out = np.sort(mine[(mine < lo) | (mine >= hi)])
        return out[~np.isin(out, self._sorted)]

    def consumed_count(self, seed: int, epoch: int, shuffle: bool, segments: list[Segment]) -> int:
        """Samples of the epoch the ``segments`` consumed (a closed form for one segment, the
        common case, so ``state_dict()`` stays cheap)."""
        played = [seg for seg in segments if seg.batches_done]
        if len(played) == 1:
            seg = played[0]
            sizes = np.diff(node_bounds(self.total, seg.nodes, self.partitions))
            take = seg.batches_done * seg.batch_size * seg.per_node
            return int(np.minimum(sizes, take).sum())
        done = self.consumed(seed, epoch, shuffle, segments)
        return 0 if done is None else int(done.sum())

    @staticmethod
    def per_rank(lengths: list[int], per_node: int, batch_size: int, drop_last: bool) -> int:
        """Samples every rank plays for nodes with ``lengths`` samples left: the longest node's
        share of a rank (shorter nodes pad), or with ``drop_last`` the shortest's, in whole
        batches."""
        if drop_last:
            return min(n // per_node for n in lengths) // batch_size * batch_size
        return max(-(-n // per_node) for n in lengths)

    @classmethod
    def batches(cls, lengths: list[int], per_node: int, batch_size: int, drop_last: bool) -> int:
        """Batches every rank plays (the last one short without ``drop_last``)."""
        return -(-cls.per_rank(lengths, per_node, batch_size, drop_last) // batch_size)

    def full_batches(self, batch_size: int, drop_last: bool) -> int:
        """Batches of a whole epoch on every rank."""
        b = node_bounds(self.total, self.nodes, self.partitions)
        return self.batches(np.diff(b).tolist(), self.per_node, batch_size, drop_last)

    # ---------------------------------------------------------------- this rank
    def plan(
        self,
        seed: int,
        epoch: int,
        shuffle: bool,
        prior: list[Segment],
        batch_size: int,
        drop_last: bool,
    ) -> RankPlan:
        """This rank's store indices for the rest of ``epoch`` after ``prior``."""
        r, B = self.per_node, batch_size
        if any(s.batches_done for s in prior):
            rests, _ = self._rests(seed, epoch, shuffle, prior, self.nodes)
            lengths = [len(x) for x in rests]
            mine = rests[self.node]
        else:
            b = node_bounds(self.total, self.nodes, self.partitions)
            lengths = np.diff(b).tolist()
            mine = self.stream(seed, epoch, self.nodes, self.node, shuffle)
        t = self.batches(lengths, r, B, drop_last)
        slots = self.per_rank(lengths, r, B, drop_last) * r
        dropped = max(0, len(mine) - slots)
        padded = max(0, slots - len(mine))
        source = mine if len(mine) else self.stream(seed, epoch, self.nodes, self.node, shuffle)
        node_slots = np.resize(source, slots) if slots else source[:0]
        rank_slots = node_slots[self.local :: r]
        where = np.searchsorted(self._sorted, rank_slots)
        where = np.minimum(where, max(0, len(self._sorted) - 1))
        held = (self._sorted[where] == rank_slots) if len(self._sorted) else rank_slots < 0
        index = self._store_index[where] if len(self._sorted) else where
        holes = int((~held).sum())
        if holes:  # left out at build: another of the node's samples in its place
            present = source[np.isin(source, self._sorted)]
            if not len(present):
                present = self._sorted
            fill = np.resize(present, len(rank_slots))[~held]
            index = index.copy()
            index[~held] = self._store_index[np.searchsorted(self._sorted, fill)]
        repeats = int((np.arange(self.local, slots, r) >= len(mine)).sum()) if padded else 0
        left = int((np.arange(slots, len(mine)) % r == self.local).sum()) if dropped else 0
        return RankPlan(index.astype(np.int64), t, repeats + holes, left)


def balanced(rests: list[np.ndarray], per_node: int) -> list[np.ndarray]:
    """The nodes' remainders of a resumed epoch rebalanced, so that the repeats that pad the
    shorter ones are fewer than the ranks (``DistributedSampler``'s bound): each node keeps at
    most ``ceil(L / W)`` samples a rank of its own (``L`` left in all, ``W`` ranks) and the
    nodes with more hand their last ones (those they would have played last), in node order,
    to the nodes with room, each placed after the receiver's own. A node then needs the few
    samples handed to it from outside its share (``NodeOrder.foreign``, fetched by the build:
    ``Store._holding``). The remainders of a full layout differ by one sample at most, so an
    epoch from its start moves nothing."""
    world = max(1, len(rests) * per_node)
    cap = -(-sum(len(x) for x in rests) // world) * per_node
    handed = [x[cap:] for x in rests]
    spare = np.concatenate(handed) if handed else np.zeros(0, dtype=np.int64)
    out, at = [], 0
    for x in rests:
        own = x[:cap]
        room = cap - len(own)
        out.append(np.concatenate([own, spare[at : at + room]]))
        at += min(room, len(spare) - at)
    return out


def holding(
    loader: Any, seed: int, epoch: int, prior: list[Segment]
) -> tuple[Any, NodeOrder] | None:
    """The store (and its order) that holds what the ``loader``'s node plays in the rest of
    ``epoch`` after ``prior``: None when its store holds it all, else its store built again
    with the samples of other shares handed to this node (``Store._holding``); a
    :class:`ShareError` with the fix where the store cannot have them."""
    order, cache = loader._nodes, loader.cache
    need = order.foreign(seed, epoch, loader.shuffle, prior)
    if not len(need):
        return None
    tier = getattr(loader, "_tier", None)
    if getattr(tier, "pixels", None) is not None:  # indexed by the store the new one replaces
        raise ShareError(
            f"node {order.node} of {order.nodes}: to finish epoch {epoch}, resumed from a state "
            f"saved at another node count, this node plays {len(need)} samples of other "
            "nodes' shares, which its store is built again to hold; the loader's decoded "
            "pixels belong to the store it replaces. Make the loader with decoded=False for "
            "the rest of this epoch, or resume at the node count the state was saved at."
        )
    bigger = cache._holding(need)
    if bigger is None:
        raise ShareError(
            f"node {order.node} of {order.nodes}: to finish epoch {epoch}, resumed from a state "
            f"saved at another node count, this node plays {len(need)} samples of other "
            "nodes' shares (the nodes' remainders are rebalanced so that every rank plays as "
            "many), and its store cannot fetch them: it was not made by a builder in this "
            "process (JpegCache.open of a share). Build it with JpegCache.from_...(..., "
            "shard='node') in every rank of the job, which fetches them from the source, or "
            "resume at the node count the state was saved at."
        )
    share = bigger.node_share
    if share is None or fingerprint(share) != fingerprint(order.share):
        raise ShareError(
            f"node {order.node} of {order.nodes}: the store built to hold the {len(need)} "
            "samples this node plays of other shares lists other data than the loader's "
            "(the source changed since the job started); restart the epoch (set_epoch) or "
            "rebuild every node's store from the unchanged source."
        )
    world = order.nodes * order.per_node
    rank = order.node * order.per_node + order.local
    return bigger, NodeOrder(share, num_replicas=world, rank=rank)


def check_job(share: StoreShare, num_replicas: int, rank: int) -> None:
    """With a process group: every rank's store is a share of the same listing at the same node
    layout, on the node the rank is on (one ``all_gather_object`` at the loader's start); a
    :class:`ShareError` naming the ranks that differ otherwise."""
    size, me = _dist.world()
    if size == 1 or size != num_replicas:
        return
    import torch.distributed as dist

    mine = (share.listing, share.total, share.partitions, share.nodes, share.node)
    every: list[tuple[str, int, int, int, int] | None] = [None] * size
    dist.all_gather_object(every, mine)
    per_node = num_replicas // share.nodes
    bad = [
        r
        for r, got in enumerate(every)
        if got is None or got[:4] != mine[:4] or got[4] != r // per_node
    ]
    if bad:
        raise ShareError(
            f"ranks {bad[:8]} hold stores that are not the shares of this job's listing and "
            f"layout (rank {me}: node {share.node} of {share.nodes}, {share.total} samples, "
            f"listing {share.listing[:12]}); build every rank's store with the same source "
            "and shard='node' in the same job, so that each node lists the same data."
        )
