"""Children forked from the test process: the library already imported, no interpreter to start.

For tests whose subject does not depend on how a process began (a rank's build under the
variables a launcher sets, a loader's use of ``/dev/shm``, a read of a truncated file): one child
that sends back one result (:func:`result_of`), several children joined under one deadline
(:func:`start`, :func:`join_all`), and the environment of a torchrun rank (:func:`rank_env`,
:func:`as_launched`).
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

_FORK = multiprocessing.get_context("fork")


def start(target: Callable[..., object], *args: Any) -> BaseProcess:
    """``target(*args)`` in a forked child, started."""
    proc = _FORK.Process(target=target, args=args)
    proc.start()
    return proc


def join_all(procs: list[BaseProcess], within: float = 120.0) -> None:
    """Every child done within ``within`` seconds in all; one still running then is killed, and
    the check fails naming it."""
    deadline = time.monotonic() + within
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    hung = [proc.pid for proc in procs if proc.is_alive()]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    assert not hung, f"children still running after {within:.0f} s: {hung}"


def result_of(
    target: Callable[..., object], *args: Any, within: float, none: object = None
) -> tuple[int | None, Any]:
    """``(exit code, what it sent)`` of ``target(*args, send)`` in a forked child, which sends one
    result through ``send``; ``none`` where it sent nothing (it died first, or ran past
    ``within`` seconds and was killed: exit code None)."""
    recv, send = _FORK.Pipe(duplex=False)
    child = _FORK.Process(target=target, args=(*args, send))
    child.start()
    send.close()
    try:
        got = recv.recv() if recv in wait([recv, child.sentinel], within) else none
    except EOFError:  # it died before it sent anything
        got = none
    child.join(within)
    code = child.exitcode
    if code is None:
        child.kill()
        child.join()
    return code, got


def rank_env(tmp: Path, node: int, local: int, nodes: int, per_node: int) -> dict[str, str]:
    """The variables torchrun sets for rank ``local`` of node ``node``, and the node's TMPDIR
    (each node of a job on one machine has a temporary folder of its own)."""
    return {
        "TMPDIR": str(tmp),
        "RANK": str(node * per_node + local),
        "WORLD_SIZE": str(nodes * per_node),
        "LOCAL_RANK": str(local),
        "LOCAL_WORLD_SIZE": str(per_node),
        "GROUP_RANK": str(node),
        "GROUP_WORLD_SIZE": str(nodes),
    }


def as_launched(env: dict[str, str]) -> None:
    """In a forked child: ``env`` set as a launcher sets it for a new process."""
    os.environ.update(env)
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again, as a new process would
