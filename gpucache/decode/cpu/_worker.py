"""The worker-process side of the CPU worker pool (the protocol: ``_pool.py``, its messages:
``_messages.py``).

A worker runs two threads: a reader that drains every task the parent sends into a local queue, so
the parent's sends always make progress, and the main thread that decodes and sends results. The
worker leaves as soon as the parent goes away: end-of-file on its socket (the parent closed the pool
or died; under fork the child first closes the parent-side ends of every pool it inherited, so the
kernel's close at the parent's death reaches it) and, on Linux, ``PR_SET_PDEATHSIG``.

Out of memory is reported, never skipped and never a silent exit: a decode, the copy of a result
for sending, or the receipt of a task that cannot allocate sends an ``error`` message marked
``memory`` (made without a traceback, after the batch is dropped; a report made at start when
even that fails), and the parent raises a ``WorkerError`` that names the worker and the fix.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import queue
import random
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Callable

import numpy as np
import torch

from ..._errors import OutOfMemory, SampleError, said
from ...store._oom import is_out_of_memory
from ...store._store import Store
from .._core import decode_batch
from .._jpeg import quiet_torchvision_deprecation
from .._options import DecodeOptions
from . import _batch_files
from ._messages import LEN, Message, Task, frame
from ._results import mask_bytes, packed

_PR_SET_PDEATHSIG = 1

# The parent-side sockets of every live pool in this process. A fork child closes all of them at
# start, so that it holds no reference to another worker's (or its own) parent end.
PARENT_ENDS: dict[int, socket.socket] = {}


def worker_main(
    wid: int,
    sock: socket.socket,
    cache: Store,
    options: DecodeOptions,
    parent_pid: int,
    start_method: str,
    pdeathsig: bool,
) -> None:
    if start_method == "fork":
        for end in list(PARENT_ENDS.values()):
            end.close()
        PARENT_ENDS.clear()
    _die_with_parent(parent_pid, start_method, pdeathsig)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not a handler inherited from the parent
    sock.setblocking(True)
    tasks: queue.SimpleQueue[Task | None] = queue.SimpleQueue()
    threading.Thread(
        target=_read_tasks, args=(sock, tasks), name="gpucache-reader", daemon=True
    ).start()
    where = "while starting"
    try:
        _setup(options.worker_seed(wid))
        if options.worker_init_fn is not None:
            where = "in worker_init_fn"
            options.worker_init_fn(wid)
    except BaseException as err:  # noqa: BLE001 - reported to the parent with its traceback
        _send(
            sock,
            {
                "kind": "init_error",
                "error": f"{type(err).__name__}: {err}",
                "where": where,
                "memory": is_out_of_memory(err),
                "traceback": traceback.format_exc(),
            },
        )
        os._exit(1)
    _send(sock, {"kind": "ready"})
    trim = _malloc_trim()
    alloc = _batch_files.Allocator() if options.batch_files else None
    while True:
        item = tasks.get()
        if item is None:  # the reader could not allocate a task it received
            _report(sock, _no_memory(None, "while receiving a task", "MemoryError"))
            os._exit(1)
        _serve(sock, cache, item, options, alloc)
        if trim is not None and tasks.empty():
            trim(0)  # idle: give the freed decode buffers back (see _malloc_trim)


def _serve(
    sock: socket.socket,
    cache: Store,
    task: Task,
    options: DecodeOptions,
    alloc: _batch_files.Allocator | None,
) -> None:
    """Decode one task and send its result, or report why not. Everything the result needs is
    allocated before its first byte is sent, so a failure is reported in place of the result.
    Out of memory is reported without a traceback, after the batch and the exception are
    dropped: the report itself then has memory to be made in. A stacked batch decoded into a
    memory file (``alloc``, :mod:`._batch_files`) is sent as the file's descriptor."""
    out = head = data = report = fd = masks = None
    where = "while decoding"
    try:
        out = decode_batch(
            cache,
            task.indices,
            task.plans,
            options,
            stack=task.stack,
            key=task.key,
            alloc=alloc.empty if alloc else None,
        )
        where = "while copying its result for sending"
        head, data, fd = packed(task.number, out, alloc)
        masks = mask_bytes(out)
    except BaseException as err:  # noqa: BLE001 - everything is reported to the parent
        if isinstance(err, OutOfMemory):  # decode_batch says which sample
            report = _no_memory(task.number, err.what, err.detail)
        elif is_out_of_memory(err):
            report = _no_memory(task.number, where, said(err))
        else:
            report = {
                "kind": "error",
                "task": task.number,
                "error": f"{type(err).__name__}: {err}",
                "sample_error": isinstance(err, SampleError),
                "traceback": traceback.format_exc(),
            }
    out = None  # an idle worker holds no decoded images (a memory file's pages live in the file)
    if alloc is not None:
        alloc.release()  # buffers of a batch that failed
    if report is not None:
        if fd is not None:
            os.close(fd)
        _report(sock, report)
        return
    assert head is not None  # made above, or the report was sent instead
    _send_bytes(sock, head, data)
    if fd is not None:
        try:
            socket.send_fds(sock, [b"F"], [fd])
        except OSError:  # the parent closed the pool or died
            os._exit(0)
        finally:
            os.close(fd)
    if masks is not None:  # after the images (and their memory file): one raw buffer
        _send_bytes(sock, b"", masks)


def _no_memory(task: int | None, where: str, detail: str) -> Message:
    return {"kind": "error", "task": task, "memory": True, "where": where, "error": detail}


#: The report sent when even a small one cannot be made; made before any task arrives.
_NO_ROOM = frame(_no_memory(None, "(too little memory left to say where)", "MemoryError"))


def _report(sock: socket.socket, msg: Message) -> None:
    try:
        payload = frame(msg)
    except MemoryError:
        payload = _NO_ROOM
    _send_bytes(sock, payload)


def _setup(seed: int) -> None:
    torch.set_num_threads(1)
    try:
        import cv2

        cv2.setNumThreads(0)
    except ImportError:
        pass
    quiet_torchvision_deprecation()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None (another C library; ``benchmarks/worker_memory.py``
    patches this function to measure a worker without it).

    glibc keeps the memory of freed blocks for the next allocations: after a batch, the
    decoded images, the resized crops and the batch buffer (9.2 MiB for 64 x 3 x 224 x 224)
    are free but stay in the worker's heap, and its mmap threshold rises to the largest block
    freed, so later batches are carved from the heap too. On photos that is 30 MiB of a
    worker's 45 at rest (docs/guides/memory.md). ``malloc_trim(0)`` hands every free page
    back (~2 ms after a batch of 64). It runs only when no task is waiting: a worker that
    always has one waiting never trims and pays nothing; one that ran out of tasks was ahead of
    the training loop, and the pages its next batch faults in again cost time it had spare."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # musl has none
        return None


def _die_with_parent(parent_pid: int, start_method: str, armed: bool) -> None:
    """SIGKILL this worker when the thread that started it exits (Linux; armed only when that was
    the main thread). Under forkserver the parent is the fork server, which exits with the real
    parent; the socket's end-of-file covers that case and every other platform."""
    if not (armed and sys.platform.startswith("linux")):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if start_method != "forkserver" and os.getppid() != parent_pid:
        os._exit(0)  # the parent died before the signal was armed


def _read_tasks(sock: socket.socket, tasks: queue.SimpleQueue[Task | None]) -> None:
    """Drain tasks as they come; end-of-file means the pool was closed or the parent died."""
    head = bytearray(LEN.size)
    try:
        while _recv_exact(sock, memoryview(head)):
            payload = bytearray(LEN.unpack(head)[0])
            if not _recv_exact(sock, memoryview(payload)):
                break
            tasks.put(pickle.loads(payload))
    except MemoryError:
        tasks.put(None)  # the main thread reports it, after the tasks already received
        return
    except BaseException:  # noqa: BLE001 - any other failure here means the parent is gone
        pass
    os._exit(0)


def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


def _send(sock: socket.socket, msg: Message, data: memoryview | None = None) -> None:
    _send_bytes(sock, frame(msg), data)


def _send_bytes(sock: socket.socket, payload: bytes, data: memoryview | None = None) -> None:
    try:
        sock.sendall(payload)
        if data is not None and data.nbytes:
            sock.sendall(data)
    except OSError:  # the parent closed the pool or died
        os._exit(0)
