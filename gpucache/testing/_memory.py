"""Proportional set size (PSS) of a process tree: how memory is measured in tests and benchmarks.

RSS counts a shared page in every process that maps it; PSS splits it among them, so the PSS summed
over a parent and its workers counts each page once. That is what "copies held" is built on.

PSS also splits a page with *every other* process on the machine that maps it, so the PSS of
libtorch's pages moves whenever an unrelated process imports torch or exits, by tens of MB. Those
pages never scale with the data; ``without_libraries=True`` leaves them out.

Tests of a real out-of-memory cap a process's address space (:func:`limit_address_space`, as a
``worker_init_fn`` too; :func:`with_address_space` in a fresh child process).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import psutil


def pss(pid: int, *, without_libraries: bool = False) -> int:
    """PSS of one process in bytes (``/proc/PID/smaps_rollup`` through psutil).

    ``without_libraries``: leave out every mapping of a file that the process maps executable
    anywhere (shared libraries, the interpreter), read from ``/proc/PID/smaps``. What is left is
    anonymous memory, shared memory and mapped data files (such as a saved store)."""
    if not without_libraries:
        total: int = psutil.Process(pid).memory_full_info().pss  # psutil ships no types
        return total
    try:
        text = Path(f"/proc/{pid}/smaps").read_text()
    except FileNotFoundError as err:
        raise psutil.NoSuchProcess(pid) from err
    except PermissionError as err:
        raise psutil.AccessDenied(pid) from err
    maps: list[list[Any]] = []  # [path, perms, pss bytes]
    for line in text.splitlines():
        head = line.split(None, 5)
        if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
            maps.append([head[5] if len(head) > 5 else "", head[1], 0])
        elif line.startswith("Pss:") and maps:
            maps[-1][2] = int(line.split()[1]) * 1024
    code = {path for path, perms, _ in maps if "x" in perms and path.startswith("/")}
    return sum(size for path, _, size in maps if path not in code)


def tree_pss(pid: int | None = None, *, without_libraries: bool = False) -> int:
    """Summed PSS of ``pid`` (default: this process) and all its descendants."""
    root = psutil.Process(pid or os.getpid())
    total = 0
    for p in [root, *root.children(recursive=True)]:
        try:
            total += pss(p.pid, without_libraries=without_libraries)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


def status_bytes(key: str) -> int:
    """A memory line of ``/proc/self/status`` in bytes (``key`` such as ``"VmRSS"``, ``"VmHWM"``)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def reset_peak_rss() -> int:
    """Reset this process's peak RSS (``VmHWM``) to its current RSS, which it returns.

    Linux keeps no PSS high-water mark; for one process's private and shared-anonymous pages the
    RSS peak counts the same."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_bytes("VmRSS")


def limit_address_space(margin: int, worker_id: int | None = None) -> int:
    """Cap this process's address space (``RLIMIT_AS``, what ``ulimit -v`` sets) at what it maps
    now (``VmSize``) plus ``margin`` bytes, and return the cap: a real out-of-memory for any
    allocation larger than that. ``functools.partial(limit_address_space, margin)`` is a
    ``worker_init_fn`` (picklable under spawn). Linux only."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    cap = status_bytes("VmSize") + int(margin)
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    return cap


def with_address_space(
    fn: Callable[[], Any], margin: int | None, *, timeout: float = 120.0
) -> tuple[Any, tuple[str, bool, str] | None]:
    """``fn()`` in a fresh interpreter (a spawned child) capped at :func:`limit_address_space`
    ``(margin)`` (None: no cap), so that a real out-of-memory in it leaves this process alone.
    Returns ``(what fn returned, None)``, or ``(None, (type name, is a MemoryError, message))``
    for what it raised. ``fn`` and what it returns must pickle (a module-level function; a store
    made in memory must be ``share()``-d first). The child runs torch on one thread (a thread
    pool started under the cap aborts when it cannot start a thread).

    Not a fork of this process: a fork inherits this process's heap, free chunks included, and
    glibc's malloc serves a large request from a free chunk before it asks the kernel for
    address space. After a long test session that is headroom beyond the cap that no test can
    see (a 75 MB decode succeeded under a 32 MB margin). A fresh interpreter has none; a test
    of fork workers makes its loader inside ``fn``, so they fork from that small parent."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    # not a daemon: fn may start worker processes; the finally below ends it whatever happens
    child = ctx.Process(target=_limited, args=(fn, margin, send))
    child.start()
    send.close()
    try:
        ready = wait([recv, child.sentinel], timeout)
        if recv not in ready:
            raise RuntimeError(
                f"the child capped at +{margin} bytes sent nothing within "
                f"{timeout} s (exit code {child.exitcode})"
            )
        got: tuple[Any, tuple[str, bool, str] | None] = recv.recv()
        return got
    finally:
        child.join(timeout)
        if child.exitcode is None:
            child.kill()


def _limited(fn: Callable[[], Any], margin: int | None, send: Connection) -> None:
    import torch

    torch.set_num_threads(1)
    # collect nothing under the cap: a collection frees garbage and returns its mappings, which
    # is headroom beyond the margin
    gc.collect()
    gc.disable()
    if margin is not None:
        limit_address_space(margin)
    out: tuple[Any, tuple[str, bool, str] | None]
    try:
        out = (fn(), None)
    except BaseException as err:  # noqa: BLE001 - reported to the parent, whatever it is
        out = (None, (type(err).__name__, isinstance(err, MemoryError), str(err)))
    send.send(out)
