"""``gpucache cache list | clean``: the stores the node cache keeps, and removing old ones."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from ..node._clean import clean, entries
from ..node._dir import checked_dir, default_dir

_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_TIMES = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def _size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 500M, 20G or 1T")
    return int(float(m[1]) * _UNITS[m[2]])


def _age(text: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not an age; write e.g. 90m, 12h or 7d")
    return float(m[1]) * _TIMES[m[2]]


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} TiB"


def _ago(s: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s / size:.1f}{unit}"
    return f"{s:.0f}s"


def _count(n: int, what: str) -> str:
    """``1 store``, ``2 stores``."""
    return f"{n} {what}{'' if n == 1 else 's'}"


def _folder(args: argparse.Namespace) -> Path | int:
    """The checked folder, or the exit status: 0 (no folder: nothing to do), 2 (refused)."""
    folder = Path(args.dir) if args.dir else default_dir()
    if not folder.exists():
        print(f"{folder}: no node cache folder (nothing built there)")
        return 0
    try:
        return checked_dir(args.dir, create=False)
    except PermissionError as err:
        print(f"gpucache cache: {err.strerror}", file=sys.stderr)
        return 2


def _list(args: argparse.Namespace) -> int:
    folder = _folder(args)
    if isinstance(folder, int):
        return folder
    found = entries(folder)
    print(f"{folder}: {_count(len(found), 'store')}, {_human(sum(e.nbytes for e in found))}")
    for e in reversed(found):  # most recently used first
        print(
            f"  {e.key}  {_human(e.nbytes):>11}  used {_ago(e.age_s):>6} ago"
            f"{'  IN USE' if e.in_use else '        '}  {e.source or '(source not recorded)'}"
        )
    return 0


def _clean(args: argparse.Namespace) -> int:
    if not (args.all or args.older_than is not None or args.max_size is not None):
        print(
            "gpucache cache clean: say what to remove: --older-than AGE, --max-size SIZE or "
            "--all (stores in use are never removed)",
            file=sys.stderr,
        )
        return 2
    folder = _folder(args)
    if isinstance(folder, int):
        return folder
    gone = clean(
        folder,
        older_than=args.older_than,
        max_bytes=args.max_size,
        everything=args.all,
        dry_run=args.dry_run,
    )
    verb = "would remove" if args.dry_run else "removed"
    for e in gone.stores:
        print(f"{verb} {e.path} ({_human(e.nbytes)}, used {_ago(e.age_s)} ago)")
    for path in gone.leftovers:
        print(f"removed {path} (a record or temporary file of the node cache that no store needs)")
    kept = entries(folder) if not args.dry_run else []
    busy = sum(e.in_use for e in kept)
    print(
        f"{verb} {_count(len(gone.stores), 'store')}, {_human(sum(e.nbytes for e in gone.stores))}"
        + (f", {_count(len(gone.leftovers), 'leftover file')}" if gone.leftovers else "")
        + (f"; {busy} in use kept" if busy else "")
    )
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("cache", help="list or clean the node cache's stores")
    csub = p.add_subparsers(dest="cache_command", required=True)
    for name, func, text in (
        ("list", _list, "stores: key, size, last use, in use, source"),
        ("clean", _clean, "remove stores not in use"),
    ):
        q = csub.add_parser(name, help=text)
        q.add_argument(
            "--dir",
            help=f"the node cache folder (default: {default_dir()}, the default of cache_dir=)",
        )
        q.set_defaults(func=func)
    q.add_argument(
        "--older-than",
        type=_age,
        metavar="AGE",
        help="stores not opened for this long, e.g. 12h, 7d",
    )
    q.add_argument(
        "--max-size",
        type=_size,
        metavar="SIZE",
        help="then the least recently used until the rest fit, e.g. 200G",
    )
    q.add_argument("--all", action="store_true", help="every store not in use")
    q.add_argument("--dry-run", action="store_true", help="only say what would go")
