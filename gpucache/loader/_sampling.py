"""Which store samples an epoch visits: all of them, a subset (``indices=``), or a weighted draw
with replacement (``weights=``). The loader shards, batches and resumes on top of this order."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class Sampling:
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
