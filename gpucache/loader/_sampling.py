"""The loader's order and sharding, checked once and held as one value (:class:`Sampling`).

Which store samples an epoch visits (:class:`Visits`: all of them, a subset, ``indices=``, or a
weighted draw with replacement, ``weights=``), in what order (``shuffle``, from ``seed``), split
across which ranks (``num_replicas``, ``rank``; a node-sharded store's :class:`NodeOrder`), in
batches of what size (``batch_size``, ``drop_last``). The loader's passes and its resume state
work on positions in this order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..base import _dist
from ..shares import _order as _nodes
from ..shares._order import NodeOrder, RankPlan, Segment
from ..store._store import Store


class Visits:
    """The global order of an epoch, as store indices, before sharding across ranks.

    ``indices``: the store samples to use (a split), in the order an unshuffled epoch visits them;
    no data is copied. ``weights``: one non-negative weight per used sample (per entry of
    ``indices``, else per store sample); each epoch draws ``num_samples`` of them with
    replacement, from (seed, epoch) alone, like ``torch.utils.data.WeightedRandomSampler``."""

    def __init__(
        self,
        store_size: int,
        *,
        indices: Sequence[int] | np.ndarray | None = None,
        weights: Sequence[float] | np.ndarray | None = None,
        num_samples: int | None = None,
    ) -> None:
        self.indices = None
        if indices is not None:
            idx = np.asarray(indices)
            if idx.dtype == bool:
                if idx.shape != (store_size,):
                    raise ValueError(
                        f"a boolean indices mask needs one entry per store sample "
                        f"({store_size}), got shape {idx.shape}."
                    )
                idx = np.flatnonzero(idx)
            if idx.ndim != 1 or not (np.issubdtype(idx.dtype, np.integer) or idx.size == 0):
                raise ValueError(
                    f"indices must be a 1-D sequence of store indices (or a boolean "
                    f"mask), got shape {idx.shape} of {idx.dtype}."
                )
            idx = idx.astype(np.int64)
            bad = idx[(idx < 0) | (idx >= store_size)]
            if bad.size:
                raise IndexError(
                    f"indices {bad[:5].tolist()} are out of range for a store of "
                    f"{store_size} samples; give indices in [0, {store_size})."
                )
            self.indices = idx
        used = store_size if self.indices is None else len(self.indices)
        self.weights = None
        if weights is not None:
            w = np.asarray(weights, dtype=np.float64)
            if w.shape != (used,):
                per = "entry of indices" if indices is not None else "store sample"
                raise ValueError(
                    f"weights must hold one number per {per} ({used}), got shape {w.shape}."
                )
            if not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
                raise ValueError("weights must be finite, non-negative and not all zero.")
            self.weights = w / w.sum()
        elif num_samples is not None:
            raise ValueError(
                "num_samples= goes with weights= (samples drawn per epoch); without "
                "weights an epoch visits every sample once."
            )
        if num_samples is not None and (
            isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1
        ):
            raise ValueError(f"num_samples should be an integer >= 1, got {num_samples!r}.")
        self.size = num_samples if num_samples is not None else used

    def order(self, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
        """Store indices of the epoch, in order (the same on every rank)."""
        rng = np.random.default_rng([seed, epoch])
        if self.weights is not None:  # a draw is random already: shuffle does not apply
            pos = rng.choice(len(self.weights), size=self.size, replace=True, p=self.weights)
        elif shuffle:
            pos = rng.permutation(self.size)
        else:
            pos = np.arange(self.size)
        return pos if self.indices is None else self.indices[pos]


@dataclass(frozen=True)
class Sampling:
    """Order and sharding: an epoch's global order over ``visits`` (``shuffle``: drawn from
    ``(seed, epoch)``), split among ``num_replicas`` ranks (``nodes``: a node-sharded store's
    order), in batches of ``batch_size`` per rank (``drop_last``: no short batch, no padding).
    ``load_state_dict`` replaces the seed (and a node share's store) with ``dataclasses.replace``."""

    visits: Visits
    batch_size: int
    shuffle: bool
    drop_last: bool
    seed: int
    num_replicas: int = 1
    rank: int = 0
    nodes: NodeOrder | None = None

    def __post_init__(self) -> None:
        check_int("batch_size", self.batch_size, 1, "use batch_size=1 or more")

    def global_size(self) -> int:
        """Samples in one epoch's global order (before sharding; node shares: every node's)."""
        return self.visits.size if self.nodes is None else self.nodes.total

    def global_order(self, epoch: int) -> np.ndarray:
        """The epoch's order over all ranks, as store indices, before sharding.

        Everything else (sharding, resume, batches) works on positions in this array, so a subset
        or a weighted draw only has to change this function and ``global_size``."""
        return self.visits.order(self.seed, epoch, self.shuffle)

    def shard(self, order: np.ndarray, start: int) -> np.ndarray:
        """This rank's share of ``order[start:]``: DistributedSampler's rule (pad to a multiple
        of ``num_replicas`` by repeating the rest from its start, or drop the tail with
        ``drop_last``), then every ``num_replicas``-th slot. Global slot j of the rest goes to rank
        j % num_replicas. Padding repeats samples of the rest only, so a resumed epoch never shows
        a consumed one."""
        rest, replicas = order[start:], self.num_replicas
        if self.drop_last:
            rest = rest[: len(rest) // replicas * replicas]
        elif len(rest) % replicas:
            rest = np.concatenate([rest, np.resize(rest, replicas - len(rest) % replicas)])
        return rest[self.rank :: replicas]

    def batches(self, mine: np.ndarray) -> list[np.ndarray]:
        bs = self.batch_size
        batches = [mine[i : i + bs] for i in range(0, len(mine), bs)]
        if self.drop_last and batches and len(batches[-1]) < bs:
            batches.pop()
        return batches

    def epoch_indices(self, epoch: int, start: int = 0) -> np.ndarray:
        """Store indices this rank visits in ``epoch`` from global position ``start``, in order
        (node shares: the whole epoch, ``start`` 0)."""
        if self.nodes is not None:
            return self.node_plan(epoch, []).indices
        return self.shard(self.global_order(epoch), start)

    def node_plan(self, epoch: int, prior: list[Segment]) -> RankPlan:
        assert self.nodes is not None
        return self.nodes.plan(
            self.seed, epoch, self.shuffle, prior, self.batch_size, self.drop_last
        )

    def full_batches(self) -> int:
        """Batches of a full epoch on this rank (``len(loader)``)."""
        if self.nodes is not None:
            return self.nodes.full_batches(self.batch_size, self.drop_last)
        n, r, bs = self.global_size(), self.num_replicas, self.batch_size
        mine = n // r if self.drop_last else -(-n // r)
        return mine // bs if self.drop_last else -(-mine // bs)

    def segment(self, batches_done: int) -> Segment:
        """The node layout's segment of an epoch, ``batches_done`` batches into it."""
        assert self.nodes is not None
        return Segment(self.nodes.nodes, self.nodes.per_node, self.batch_size, batches_done)

    def key(self, epoch: int, batch: int) -> tuple[int, ...]:
        """What seeds one batch's plans and batch steps: (seed, epoch, batch[, rank])."""
        return (self.seed, epoch, batch) + ((self.rank,) if self.num_replicas > 1 else ())


def sharding(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """``(num_replicas, rank)``: as given, else the process group's (or the launcher's), checked."""
    num_replicas, rank = _dist.sharding(num_replicas, rank)
    check_int("num_replicas", num_replicas, 1, "use num_replicas=world size (>= 1)")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_replicas:
        raise ValueError(f"rank should be in [0, {num_replicas}), got {rank!r}.")
    return num_replicas, rank


def seed_of(
    seed: int | None, generator: torch.Generator | None, num_replicas: int, shuffle: bool
) -> int:
    """The loader's seed in [0, 2**63): ``seed``, else ``generator``'s initial seed, else a fresh
    one, the same on every rank (or a clear error)."""
    if seed is not None and generator is not None:
        raise ValueError(
            "give seed or generator, not both; the generator's initial_seed() is used as the seed."
        )
    if seed is None:
        seed = (
            generator.initial_seed()
            if generator is not None
            else _dist.agreed_seed(num_replicas, shuffle)
        )
    return int(seed) % 2**63


def node_order(cache: Store, visits: Visits, num_replicas: int, rank: int) -> NodeOrder | None:
    """The node order of a node-sharded store (None for a whole one), checked against the job."""
    share = cache.node_share
    if share is None:
        return None
    if visits.indices is not None or visits.weights is not None:
        raise ValueError(
            "indices= and weights= take store indices of a whole data set; this store holds "
            "one node's share (shard='node'), whose indices differ from node to node. Build "
            "the subset as its own store, or use shard=None."
        )
    order = NodeOrder(share, num_replicas=num_replicas, rank=rank)
    _nodes.check_job(share, num_replicas, rank)
    return order


def check_int(name: str, value: object, low: int, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} option should be an integer >= {low}, got {value!r}; {fix}.")
