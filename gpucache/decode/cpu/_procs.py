"""The worker pool's processes: each one's link (its process and the parent's socket end), the
fork's preparation, the parallel stop, a worker's private memory, and how many workers a rank
starts by default (its part of the cores)."""

from __future__ import annotations

import gc
import logging
import os
import socket
import time
from collections import deque
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess

from ...base._cores import affinity, usable_cores
from .. import _roi
from ._worker import PARENT_ENDS

log = logging.getLogger(__name__)

_GRACE = 0.25  # seconds a worker gets to exit after its socket closes, and again after SIGTERM


class Link:
    """The parent's end of one worker: process, non-blocking socket, unsent task bytes."""

    def __init__(self, wid: int, proc: BaseProcess, sock: socket.socket):
        assert proc.pid is not None  # started before its link is made
        self.wid, self.proc, self.sock, self.pid = wid, proc, sock, proc.pid
        self.out: deque[memoryview] = deque()
        self.ready = False

    def __str__(self) -> str:
        return f"worker {self.wid} (pid {self.pid})"

    def flush(self) -> None:
        while self.out:
            try:
                n = self.sock.send(self.out[0])
            except BlockingIOError:
                return
            except OSError:  # the worker is gone; get() reports it with the samples it had
                self.out.clear()
                return
            if n == len(self.out[0]):
                self.out.popleft()
            else:
                self.out[0] = self.out[0][n:]


def prepare_fork() -> bool:
    """Ready this process to fork workers; returns whether to unfreeze the collector after.

    The compiled decoder's self-check (:func:`.._roi.region_decoder`, which imports PIL) runs
    here once, so the workers inherit its result instead of each importing PIL: 6 MiB less
    private memory a worker. Then ``gc.freeze()``, CPython's remedy for fork: it moves every
    object the collector tracks out of its reach, so a full collection in a worker does not
    write to the objects it inherited and copy the pages that hold them (43 MiB a worker with
    torch imported; docs/guides/memory.md). The parent unfreezes them as soon as the workers
    are started, unless it had frozen objects itself before (then they all stay frozen: a
    program that calls ``gc.freeze()`` keeps its choice). ``benchmarks/worker_memory.py``
    measures a worker without each step by patching :func:`_check_decoder` or :func:`_freeze`."""
    _check_decoder()
    return _freeze()


def _check_decoder() -> None:
    """The compiled decoder's self-check, done once here for every worker to inherit."""
    _roi.region_decoder(3)


def _freeze() -> bool:
    """``gc.freeze()``; whether the parent unfreezes after the fork (see :func:`prepare_fork`)."""
    thaw = gc.get_freeze_count() == 0
    gc.freeze()
    return thaw


def stop(links: list[Link], wake: tuple[socket.socket, socket.socket]) -> None:
    """Close every socket (workers exit on end-of-file), then one deadline for all
    workers, then SIGTERM the rest, then SIGKILL. Idempotent (finalizer)."""
    for end in [lk.sock for lk in links] + list(wake):
        PARENT_ENDS.pop(end.fileno(), None)
        try:
            end.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        end.close()
    procs = [lk.proc for lk in links]
    for step in (None, "terminate", "kill"):
        alive = [p for p in procs if p.exitcode is None]
        for p in alive:
            if step:
                getattr(p, step)()
        deadline = time.monotonic() + _GRACE
        while alive and (left := deadline - time.monotonic()) > 0:
            wait([p.sentinel for p in alive], left)
            alive = [p for p in alive if p.exitcode is None]
        if not alive:
            break
    for p in procs:
        p.join(5 if p.exitcode is None else None)
        if p.exitcode is not None:
            p.close()
        else:
            log.warning("gpucache: worker pid %s did not exit after SIGKILL", p.pid)


def private_dirty(pid: int) -> int | None:
    """``Private_Dirty`` of process ``pid`` in bytes, or None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Private_Dirty:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def default_workers() -> int:
    """``num_workers=None``: this rank's part of the cores. Under a launcher with several ranks
    on the node (LOCAL_WORLD_SIZE, Slurm's tasks per node) that all see every core of the machine
    (torchrun binds none), the usable cores divided among them, at least 1; a rank whose cores
    were bound to it (Slurm's per-task binding: fewer usable cores than the machine's) keeps
    its own. Cores are :func:`gpucache.base._cores.usable_cores` (affinity, capped by a CPU quota)."""
    from ...base._dist import local

    size, _ = local()
    if size > 1 and affinity() >= (os.cpu_count() or 1):
        return max(1, usable_cores() // size)
    return usable_cores()
