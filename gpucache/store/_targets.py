"""Targets beyond int labels, stored in the file format.

Two named optional sections of the store (docs/reference/format.md):
- ``targets``: float32 (N, C), one row per sample: multi-label (multi-hot) or regression targets.
- ``targets_ragged`` float32 (M, K) + ``targets_ragged.offsets`` int64 (N + 1): sample ``i`` owns
  rows ``offsets[i]:offsets[i+1]`` (any number, e.g. boxes ``x0, y0, x1, y1, class``).

Boxes and points follow each sample's geometric plan through :mod:`gpucache.transforms._boxes`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from ._report import BuildReport

DENSE, RAGGED, OFFSETS = "targets", "targets_ragged", "targets_ragged.offsets"


class Sections(Protocol):
    """What the targets read of a store (``_store.Store`` is one): its optional sections."""

    @property
    def extra(self) -> Mapping[str, np.ndarray]: ...


S = TypeVar("S", bound="Targeted")


class Targeted(Sections, Protocol):
    """What :func:`with_targets` reads and makes of a store: its size, build report and
    sections, and a copy of it with other sections (``_replace``)."""

    def __len__(self) -> int: ...

    @property
    def report(self) -> BuildReport | None: ...

    def _replace(self: S, **changes: Any) -> S: ...


def with_targets(
    cache: S,
    *,
    targets: npt.ArrayLike | None = None,
    ragged: Sequence[npt.ArrayLike] | None = None,
    per_input: bool = False,
) -> S:
    """A new in-memory store: ``cache`` with float targets and/or ragged per-sample arrays.

    ``targets``: (N, C) numbers (multi-hot rows, regression values). ``ragged``: N arrays of
    shape (K_i, C) (or (K_i,)), the same C for all, K_i >= 0. Rows follow the store's samples;
    with ``per_input=True`` they follow the build's inputs instead and the rows of inputs the
    build skipped (``cache.report``) are dropped. ``save()`` / ``share()`` carry them."""
    n = len(cache)
    keep = None
    if per_input:
        report = cache.report
        if report is None:
            raise ValueError(
                "per_input=True needs a freshly built store (its build report "
                "says which inputs were skipped)."
            )
        keep = np.ones(report.total, dtype=bool)
        keep[[s.index for s in report.skipped]] = False
    extra = {k: v for k, v in cache.extra.items() if k not in (DENSE, RAGGED, OFFSETS)}
    if targets is not None:
        t = np.asarray(targets, dtype=np.float32)
        t = t[:, None] if t.ndim == 1 else t
        t = t[keep] if keep is not None and len(t) == len(keep) else t
        if t.ndim != 2 or len(t) != n:
            raise ValueError(
                f"targets must be (N, C) with N = {n} samples"
                f"{' (or one row per build input)' if per_input else ''}; got "
                f"shape {np.shape(targets)}."
            )
        extra[DENSE] = np.ascontiguousarray(t)
    if ragged is not None:
        rows = list(ragged)
        if keep is not None and len(rows) == len(keep):
            rows = [r for r, k in zip(rows, keep) if k]
        if len(rows) != n:
            raise ValueError(f"ragged must hold one array per sample ({n}), got {len(rows)}.")
        arrs = [np.asarray(r, dtype=np.float32) for r in rows]
        arrs = [a.reshape(-1, 1) if a.ndim == 1 else a for a in arrs]  # (K_i,) -> (K_i, 1)
        if any(a.ndim != 2 for a in arrs):
            raise ValueError("each ragged entry must be a (K_i, C) or (K_i,) array.")
        widths = {a.shape[1] for a in arrs if len(a)}
        if len(widths) > 1:
            raise ValueError(
                f"ragged arrays must share their row width (e.g. 5 for x0, y0, x1, "
                f"y1, class); got widths {sorted(widths)}."
            )
        width = widths.pop() if widths else 0
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum([len(a) for a in arrs], out=offsets[1:])
        values = np.zeros((int(offsets[-1]), width), dtype=np.float32)
        for a, lo in zip(arrs, offsets[:-1].tolist()):
            values[lo : lo + len(a)] = a
        extra[RAGGED], extra[OFFSETS] = values, offsets
    return cache._replace(extra=extra)


def dense_targets(cache: Sections) -> np.ndarray | None:
    """The store's (N, C) float32 targets, or None."""
    return cache.extra.get(DENSE)


def ragged_targets(cache: Sections, indices: npt.ArrayLike) -> list[np.ndarray] | None:
    """Each listed sample's (K_i, C) ragged array (read-only views), or None without any."""
    values, offsets = cache.extra.get(RAGGED), cache.extra.get(OFFSETS)
    if values is None or offsets is None:
        return None
    return [values[offsets[i] : offsets[i + 1]] for i in np.asarray(indices).tolist()]


def kept_rows(submitted: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """Rows of a submitted batch that a decoded batch kept (failed samples are left out, order
    kept; an index may repeat in a batch)."""
    rows, j = [], 0
    for r, i in enumerate(submitted.tolist()):
        if j < len(kept) and kept[j] == i:
            rows.append(r)
            j += 1
    return np.asarray(rows, dtype=np.int64)
