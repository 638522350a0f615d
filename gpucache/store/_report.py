"""The build report inside a store file: the ``report.*`` optional sections.

``report.totals`` (i8: files given, samples kept), ``report.kinds`` (i8 rows: kind, count),
``report.skipped`` (i8: input index of each skipped file) and a string table without its count,
``report.offsets`` (u8, 2S+1) + ``report.text`` (bytes): path, then reason, of each skipped file.
Numbers and strings only: no pickle. ``docs/reference/format.md`` specifies them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from .._errors import CacheFormatError
from ._format import Kind, decode, pack_strings


@dataclass(frozen=True)
class Skipped:
    index: int  # position in the input list
    path: str  # the path, or the source's name
    reason: str


@dataclass
class BuildReport:
    """What a build kept and left out. ``total == kept + len(skipped)`` always."""

    total: int = 0
    kept: int = 0
    counts: dict[str, int] = field(default_factory=dict)  # kept samples by kind
    skipped: list[Skipped] = field(default_factory=list)

    def __str__(self) -> str:
        kinds = ", ".join(f"{k}: {v}" for k, v in sorted(self.counts.items()))
        lines = [f"{self.total} files: {self.kept} kept ({kinds}), {len(self.skipped)} skipped"]
        lines += [f"  skipped #{s.index} {s.path}: {s.reason}" for s in self.skipped]
        return "\n".join(lines)


def report_sections(report: BuildReport) -> dict[str, np.ndarray]:
    """A build report as the ``report.*`` sections (numbers and a string table; no pickle)."""
    kinds = [(int(Kind[k]), v) for k, v in sorted(report.counts.items())]
    texts = [t for s in report.skipped for t in (s.path, s.reason)]
    offsets, blob = pack_strings(texts)
    return {
        "report.totals": np.array([report.total, report.kept], dtype="<i8"),
        "report.kinds": np.array(kinds, dtype="<i8").reshape(len(kinds), 2),
        "report.skipped": np.array([s.index for s in report.skipped], dtype="<i8"),
        "report.offsets": offsets,
        "report.text": blob,
    }


def read_report(extra: Mapping[str, np.ndarray], where: str) -> BuildReport | None:
    """The build report kept in ``extra`` (see :func:`report_sections`), or None without one."""
    if "report.totals" not in extra:
        return None
    try:
        (total, kept), kinds = extra["report.totals"].tolist(), extra["report.kinds"]
        index, offsets, blob = (
            extra["report.skipped"],
            extra["report.offsets"],
            extra["report.text"],
        )
        ends = offsets.tolist()
        if (
            kinds.ndim != 2
            or len(ends) != 2 * len(index) + 1
            or ends[0] != 0
            or ends != sorted(ends)
            or ends[-1] != len(blob)
            or total != kept + len(index)
        ):
            raise ValueError("the sections disagree")
        if len(index) and (index[0] < 0 or index[-1] >= total or np.any(index[1:] <= index[:-1])):
            raise ValueError(f"skipped input indices are not ascending within 0..{total - 1}")
        texts = [decode(bytes(blob[a:b])) for a, b in zip(ends, ends[1:])]
        counts = {Kind(k).name: int(v) for k, v in kinds.tolist()}
    except (KeyError, ValueError, TypeError) as err:
        raise CacheFormatError(
            f"{where}: the build report sections (report.*) are inconsistent "
            f"({err}); rebuild it with `gpucache build` or copy it again."
        ) from err
    return BuildReport(
        total=total,
        kept=kept,
        counts=counts,
        skipped=[
            Skipped(int(i), texts[2 * k], texts[2 * k + 1]) for k, i in enumerate(index.tolist())
        ],
    )
