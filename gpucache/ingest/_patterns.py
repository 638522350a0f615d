"""Shard patterns as WebDataset writes them: brace ranges and alternatives
(``train-{000..003}.tar``, ``{train,val}-000.tar``) and shell globs (``train-*.tar``), for local
paths here and for URLs in object storage (``storage._listing.list_shards`` matches globs against
the bucket's listing)."""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Iterable


def expand_braces(pattern: str) -> list[str]:
    """WebDataset's shard patterns: ``train-{000..003}.tar`` (zero-padded ranges) and
    ``{a,b}`` alternatives, every group expanded in order."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if m is None:
        return [pattern]
    head, body, tail = pattern[: m.start()], m[1], pattern[m.end() :]
    r = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if r:
        a, b = int(r[1]), int(r[2])
        width = len(r[1]) if r[1].startswith("0") or len(r[1]) == len(r[2]) else 0
        step = 1 if b >= a else -1
        options = [f"{k:0{width}d}" for k in range(a, b + step, step)]
    elif "," in body:
        options = body.split(",")
    else:
        return [head + "{" + body + "}" + t for t in expand_braces(tail)]
    return [head + o + t for o in options for t in expand_braces(tail)]


def expand_local(shards: Iterable[str]) -> list[str]:
    """Local shard paths with their patterns expanded, in order: braces first, then each glob
    matched on disk (sorted). A path that exists is taken as it is (a file named with a brace);
    a named path that does not exist stays (the build reports it as a shard it cannot open).

    Raises ``FileNotFoundError`` naming the pattern when a glob matches no file, or when no path
    of a brace pattern exists (a typo in the pattern, or the wrong folder)."""
    out: list[str] = []
    for pattern in shards:
        names = [pattern] if os.path.lexists(pattern) else expand_braces(pattern)
        found: list[str] = []
        for name in names:
            if os.path.lexists(name) or not glob.has_magic(name):
                found.append(name)
                continue
            matched = sorted(glob.glob(name, recursive=True))
            if not matched:
                raise FileNotFoundError(_no_match(pattern, name))
            found += matched
        if names != [pattern] and not any(os.path.lexists(p) for p in found):
            raise FileNotFoundError(_no_match(pattern, None, len(names)))
        out += found
    return out


def _no_match(pattern: str, part: str | None, expanded: int = 0) -> str:
    where = os.path.abspath(os.path.dirname(part or pattern) or ".")
    what = (
        f"no file matches the shard pattern {pattern!r}"
        + (f" (its part {part!r})" if part is not None and part != pattern else "")
        + (f": none of its {expanded} paths exists" if expanded else "")
    )
    return (
        f"{what}, looked for in {where}; check the pattern and the folder (relative paths are "
        f"taken against the working directory, {os.getcwd()})"
    )
