"""The rules gpucache's own optional sections follow, checked when a store is opened or made.

Each section gpucache reads has a fixed element type and shape (one row per sample, N + 1 offsets,
or a fixed length), some have a rule on their values (a range, offsets that never decrease), and
some only make sense together (``resized`` with ``resized.args``, ragged targets with their
offsets, the five ``report.*`` sections). A section that broke its rule would fail much later, or
not at all: an IndexError mid-epoch, a sample handed another sample's boxes, a KeyError in
``gpucache info``. So :func:`problem` names it at open (``_parse``) and when a store is made in
memory (``JpegCache(Columns(..., extra=...))``), so that no save writes a file that would not
open.

Shape, type and group checks are O(1); the value checks are vectorised, O(N) with small
constants, and skipped on a worker's trusted reopen. Names not listed here are the user's own:
only their directory entry (name, type, size, bounds, CRC) is checked. The names of the store's
own sections come from their owners here (``_format``, ``_targets``); those of the layers above
(``ingest._resize``, ``ingest._restart``) are the same strings, which a test holds equal. ``docs/reference/format.md`` lists the rules.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np

from ..shares import _record
from . import _masks
from ._format import SAMPLE_CRC
from ._masks import DATA as MASK_DATA
from ._masks import INFO as MASK_INFO
from ._masks import OFFSETS as MASK_OFFSETS
from ._targets import DENSE, OFFSETS, RAGGED

N, N1, ANY = "N", "N+1", None  # shape entries: rows per sample, offsets (N + 1), any length
MAX_RESTART = 0xFFFF  # a JPEG's restart interval (DRI) is a 16-bit count of MCUs


class Spec(NamedTuple):
    dtype: str
    shape: tuple[int | str | None, ...]  # per axis: an int, N, N1 or ANY
    meaning: str


SPECS = {
    "rst": Spec("<i4", (N,), "restart interval in MCUs per sample"),
    "resized": Spec("<u4", (N, 3), "original height, width, bytes per sample"),
    "resized.args": Spec("<i8", (2,), "max_side, quality"),
    DENSE: Spec("<f4", (N, ANY), "float targets, one row per sample"),
    RAGGED: Spec("<f4", (ANY, ANY), "ragged target rows"),
    OFFSETS: Spec("<i8", (N1,), "first ragged row of each sample, then the row count"),
    SAMPLE_CRC: Spec("<u4", (N,), "CRC-32 per sample"),
    MASK_DATA: Spec("|u1", (ANY,), "encoded mask bytes (PNG) of every sample, end to end"),
    MASK_OFFSETS: Spec("<i8", (N1,), "first mask byte of each sample, then the byte count"),
    MASK_INFO: Spec("<u4", (N, 3), "mask kind, height, width per sample"),
    _record.LAYOUT: Spec("<i8", (5,), "share: version, partitions, total, nodes, node"),
    _record.RANKS: Spec("<i8", (N,), "share: global rank of each sample"),
    _record.LISTING: Spec("|u1", (32,), "share: the whole listing's fingerprint (hex)"),
    _record.FETCHED: Spec("<i8", (4,), "share: objects, bytes fetched; objects, bytes reused"),
    "report.totals": Spec("<i8", (2,), "files given, samples kept"),
    "report.kinds": Spec("<i8", (ANY, 2), "kind, count"),
    "report.skipped": Spec("<i8", (ANY,), "input index of each skipped file"),
    "report.offsets": Spec("<u8", (ANY,), "string offsets of the skipped paths and reasons"),
    "report.text": Spec("|u1", (ANY,), "skipped paths and reasons"),
}
#: Sections that are present all together or not at all.
GROUPS = (
    ("resized", "resized.args"),
    (RAGGED, OFFSETS),
    _masks.SECTIONS,
    _record.SECTIONS,
    ("report.totals", "report.kinds", "report.skipped", "report.offsets", "report.text"),
)


def _rows_bad_rst(a: np.ndarray) -> np.ndarray:
    return (a < 0) | (a > MAX_RESTART)


def _rows_bad_resized(a: np.ndarray) -> np.ndarray:  # (0, 0, 0): kept as given; else all > 0
    zero = a[:, 0] == 0  # column by column: ~20x faster than reductions along rows of 3
    bad: np.ndarray = (zero != (a[:, 1] == 0)) | (zero != (a[:, 2] == 0))
    return bad


#: Per-sample value rules: a mask of the rows that break them, and the rule in words.
ROWS: dict[str, tuple[Callable[[np.ndarray], np.ndarray], str]] = {
    "rst": (_rows_bad_rst, f"a restart interval from 0 to {MAX_RESTART}"),
    "resized": (_rows_bad_resized, "all zero (not re-encoded) or all three > 0"),
}


def _shape(spec: Spec, n: int) -> str:
    dims = [
        str(n) if d == N else str(n + 1) if d == N1 else "any" if d is ANY else str(d)
        for d in spec.shape
    ]
    return f"({', '.join(dims)}{',' if len(dims) == 1 else ''})"


def _fits(arr: np.ndarray, spec: Spec, n: int) -> bool:
    if arr.dtype.str != spec.dtype or arr.ndim != len(spec.shape):
        return False
    want: dict[int | str | None, int] = {N: n, N1: n + 1}
    return all(d is ANY or got == want.get(d, d) for got, d in zip(arr.shape, spec.shape))


def problem(
    sections: Mapping[str, np.ndarray],
    n: int,
    *,
    values: bool = True,
    samples: np.ndarray | None = None,
) -> str | None:
    """What is wrong with ``sections`` (name -> array) of a store of ``n`` samples, or None.

    ``values=False``: type, shape and group checks only (O(1)), for a trusted reopen.
    ``samples``: the store's per-sample records, whose sizes the masks must have."""
    for group in GROUPS:
        have = [k for k in group if k in sections]
        if have and len(have) != len(group):
            missing = [k for k in group if k not in sections]
            return (
                f"section {have[0]!r} is present without {', '.join(map(repr, missing))}, "
                f"which it needs ({', '.join(map(repr, group))} come together)"
            )
    for name, arr in sections.items():
        spec = SPECS.get(name)
        if spec is not None and not _fits(arr, spec, n):
            return (
                f"section {name!r} ({spec.meaning}) holds {arr.dtype.str} {arr.shape}, not "
                f"{spec.dtype} {_shape(spec, n)} for {n} samples"
            )
    if not values:
        return None
    for name, (bad_rows, rule) in ROWS.items():
        section = sections.get(name)
        bad = None if section is None else bad_rows(section)
        if bad is not None and bad.any():
            assert section is not None  # bad is only computed for a present section
            i = int(np.flatnonzero(bad)[0])
            return (
                f"section {name!r} breaks its rule ({rule}) for {int(bad.sum())} samples, "
                f"first sample {i}: {section[i].tolist()}"
            )
    args = sections.get("resized.args")
    if args is not None and not (args[0] >= 0 and 1 <= args[1] <= 100):
        return f"section 'resized.args' holds {args.tolist()}, not [max_side >= 0, quality 1-100]"
    why = _masks.problem(sections, samples) or _record.problem(sections)
    if why is not None:
        return why
    offsets = sections.get(OFFSETS)
    if offsets is not None:
        rows = len(sections[RAGGED])
        down = np.flatnonzero(offsets[1:] < offsets[:-1])
        if offsets[0] != 0 or offsets[-1] != rows or down.size:
            where = (
                f"; sample {int(down[0])} goes from row {int(offsets[down[0]])} to "
                f"{int(offsets[down[0] + 1])}"
                if down.size
                else ""
            )
            return (
                f"section {OFFSETS!r} must start at 0, never decrease and end at the "
                f"{rows} rows of {RAGGED!r}; it goes from {int(offsets[0])} to "
                f"{int(offsets[-1])}{where}"
            )
    return None
