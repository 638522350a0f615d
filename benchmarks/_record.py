"""What every benchmark script's result records, and the timing loop the scripts share.

``write_json(path, result)`` writes ``result`` with a ``"run"`` entry first: the command as typed,
the date (UTC), the machine and the commit of this checkout (``"<sha>-dirty"`` with uncommitted
changes; from ``gpucache.bench._report.source_commit``, which ``gpucache bench`` and ``peers/``
record too). Scripts that only print start with ``print(run_line())``, so a kept output says the
same. ``timed(fn, rounds)`` is each call's seconds after warm-up calls, on the clock given.

Imported as ``benchmarks._record`` (each script puts the checkout's root on ``sys.path`` first);
it imports only the standard library until a run is recorded, so a script's measured child
processes that import it carry nothing more.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def machine() -> str:
    """One line: architecture, cores, memory, Python, torch, glibc, the load average."""
    try:
        torch = f", torch {metadata.version('torch')}"  # the metadata's: nothing imported
    except metadata.PackageNotFoundError:
        torch = ""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{platform.machine()}, {os.cpu_count()} cores, {memory:.0f} GiB, Python "
        f"{platform.python_version()}{torch}, glibc "
        f"{platform.libc_ver()[1]}, load average {os.getloadavg()[0]:.2f} at the start"
    )


def run_info() -> dict[str, Any]:
    from gpucache.bench._report import source_commit  # here: importing this module stays light

    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(REPO) if script.is_relative_to(REPO) else script
    return {
        "command": shlex.join(["python", str(shown), *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "commit": source_commit(REPO),
    }


def run_line() -> str:
    r = run_info()
    return f"{r['command']}\n{r['date']}, commit {r['commit'] or 'unknown'}; {r['machine']}"


def write_json(path: str | os.PathLike, result: dict | list, *, run: dict | None = None) -> None:
    """``result`` (a list goes under ``"rows"``) after ``"run"`` (``run_info()`` unless given:
    a script that ran long passes the one it took at its start)."""
    body = result if isinstance(result, dict) else {"rows": result}
    text = json.dumps({"run": run or run_info(), **body}, indent=1, default=str)
    Path(path).write_text(text + "\n")


def timed(
    fn: Callable[[], Any],
    rounds: int,
    *,
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[list[float], Any]:
    """(seconds of each of ``rounds`` calls of ``fn`` after ``warmup`` untimed ones, the last
    call's return value)."""
    out = None
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(rounds):
        t0 = clock()
        out = fn()
        times.append(clock() - t0)
    return times, out
