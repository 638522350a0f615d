"""The CPU worker pool: persistent processes, seeded, bounded in every wait, shut down in parallel.

Protocol. Each worker owns one socket pair. Every message is an 8-byte length and a pickle; a
decoded batch is a small header followed by one raw buffer: a stacked batch decoded into a memory
file goes as the file's descriptor, mapped here as the batch tensor (:mod:`._batch_files`, Linux, not
into pinned memory); otherwise its bytes follow, read straight into the destination tensor (pinned
when asked) -- no per-sample pickling and nothing in ``/dev/shm``. Tasks go round-robin and
results are read in the same order, so batch order is deterministic.

Designed for failure:
- No blocking send can meet a blocked peer. The parent's sockets are non-blocking: a task goes into
  a per-worker outgoing buffer that is flushed whenever the socket takes more (in ``submit`` and
  while ``get`` waits). A worker's reader thread drains tasks into a local queue at all times. The
  data in flight is bounded by the loader's prefetch (tasks) and one batch per worker (results).
- Every wait is bounded by ``timeout`` and by the worker's liveness (its process sentinel), and can
  be woken by ``close()`` from another thread. Errors name the worker, its pid and the samples.
- Out of memory in a worker (decoding, or copying a result to send) is a ``WorkerError`` that
  says so and gives the fix, never a skipped sample (``store/_oom.py``).
- A worker never outlives the parent: see :mod:`._worker`.
- Shutdown is parallel: close every socket (workers exit on end-of-file), one deadline for
  all, then terminate the rest, then kill.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import multiprocessing as mp
import os
import pickle
import select
import socket
import sys
import threading
import time
import warnings
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

try:
    import resource
except ImportError:  # not on Windows (nor are the memory files whose loss it explains)
    resource = None  # type: ignore[assignment]

import numpy as np
import torch

from ..._errors import SampleError, WorkerError
from ...base._fork import finalize_here
from ...store._oom import FIX, raise_if_out_of_memory
from ...store._store import Store
from .._core import decode_batch
from .._options import DecodeOptions
from .._outcome import Decoded
from . import _batch_files
from ._messages import Message, Task, frame
from ._procs import Link, prepare_fork, private_dirty, stop
from ._receive import Receiving, _DescriptorLost, span
from ._worker import PARENT_ENDS, worker_main

log = logging.getLogger(__name__)
# Bounds on waits that end as soon as something already under way finishes; they only matter
# when it never does, so they are generous for a loaded machine (load 15 on 2 cores).
_LEAVE = 10.0  # for a get() woken by close() in another thread to leave the pool


def _open_files_limit() -> tuple[int, int]:
    """This process's open-file limit (soft, hard; -1 where it cannot be read). ``resource`` is
    imported with the module: out of descriptors, an import could not open its file."""
    if resource is None:
        return -1, -1
    return resource.getrlimit(resource.RLIMIT_NOFILE)


class WorkerPool(Receiving):
    """``num_workers`` persistent decode processes fed round-robin."""

    def __init__(self, cache: Store, options: DecodeOptions):
        # batches come back as memory files where there are (not into pinned memory)
        by_file = _batch_files.available() and not options.pin_memory
        options = dataclasses.replace(options, batch_files=by_file)
        ctx = mp.get_context(options.context)
        num_workers, timeout, pin_memory = options.num_workers, options.timeout, options.pin_memory
        self.method = ctx.get_start_method()
        self.cache, self.timeout, self.pin_memory = cache, timeout, pin_memory
        self._options = options  # a batch whose memory file was lost is decoded here with them
        self._warned_fds = False
        if self.method != "fork" and not cache.is_shared:
            cache.share()  # spawn/forkserver attach to shared pages; room checked first
        armed = threading.current_thread() is threading.main_thread()
        self._wake = socket.socketpair()  # close() from another thread wakes a waiting get()
        for end in self._wake:
            end.setblocking(False)
            PARENT_ENDS[end.fileno()] = end
        self._links: list[Link] = []
        thaw = prepare_fork() if self.method == "fork" else False
        try:
            for wid in range(num_workers):
                mine, theirs = socket.socketpair()
                PARENT_ENDS[mine.fileno()] = mine
                # every context has Process; the stubs declare it on the concrete ones only
                p = ctx.Process(  # type: ignore[attr-defined]
                    target=worker_main,
                    name=f"gpucache-worker-{wid}",
                    daemon=True,
                    args=(wid, theirs, cache, options, os.getpid(), self.method, armed),
                )
                try:
                    p.start()
                except Exception as err:
                    PARENT_ENDS.pop(mine.fileno(), None)
                    mine.close()
                    if (
                        sys.version_info >= (3, 11)  # notes are Python 3.11's
                        and self.method != "fork"
                        and isinstance(err, (pickle.PicklingError, AttributeError, TypeError))
                    ):
                        err.add_note(
                            f"gpucache: under {self.method}, worker_init_fn and the "
                            "store are pickled to each worker; define functions at "
                            "module top level (not lambdas or nested functions)."
                        )
                    raise
                finally:
                    theirs.close()
                mine.setblocking(False)
                self._links.append(Link(wid, p, mine))
        except BaseException:
            stop(self._links, self._wake)
            raise
        finally:
            if thaw:
                gc.unfreeze()
        self._finalizer = finalize_here(self, stop, self._links, self._wake)
        # (worker, task): the task, should it be decoded here
        self._pending: deque[tuple[int, Task]] = deque()
        self._next = self._task = 0
        self._cv = threading.Condition()
        self._closed, self._active = False, 0
        self._active_thread: int | None = None  # the thread last inside _using

    @property
    def pids(self) -> list[int]:
        return [lk.pid for lk in self._links] if self._finalizer.alive else []

    def __len__(self) -> int:
        return len(self._pending)

    def ready(self) -> int:
        """Workers with a result arrived for their oldest task: at most the batches in flight,
        one a worker (a worker's later results queue behind its first)."""
        socks = {self._links[w].sock for w, _ in self._pending}
        if not socks:
            return 0
        try:
            readable, _, _ = select.select(list(socks), [], [], 0)
        except (OSError, ValueError):  # a closed socket: get() reports what happened
            return 0
        return len(readable)

    def private_memory(self) -> dict[int, int]:
        """Private dirty bytes of each live worker, by worker id: the pages it wrote that no
        other process shares (``/proc/PID/smaps_rollup``; Linux, else empty)."""
        out = {}
        for link in self._links if self._finalizer.alive else []:
            size = private_dirty(link.pid)
            if size is not None:
                out[link.wid] = size
        return out

    # ------------------------------------------------------------------ feeding and reading
    def submit(
        self, indices: np.ndarray, plans: np.ndarray, stack: bool, key: tuple[int, ...] = ()
    ) -> None:
        """Queue a task for the next worker; never blocks (unsent bytes wait in a buffer).
        ``key`` seeds the batch steps the workers run (``DecodeOptions.steps``)."""
        with self._using():
            w = self._next
            self._next = (w + 1) % len(self._links)
            self._task += 1
            link = self._links[w]
            task = Task(self._task, indices, plans, stack, key)
            link.out.append(memoryview(frame(task)))
            link.flush()
            self._pending.append((w, task))

    def get(self) -> Decoded:
        """The oldest batch; a failure closes the pool and raises ``WorkerError``."""
        try:
            with self._using():
                return self._get()
        except BaseException:
            self.close()
            raise

    def drain(self) -> None:
        """Read and drop the results of an abandoned epoch."""
        while self._pending:
            self.get()

    def _get(self) -> Decoded:
        w, task = self._pending.popleft()
        indices, link = task.indices, self._links[w]
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while True:
            msg: Message = pickle.loads(
                self._recv(link, self._header(link, indices, deadline), indices, deadline)
            )
            if msg["kind"] != "ready":
                break
            link.ready = True
        if msg["kind"] == "init_error":
            memory = f". It ran out of memory; {FIX}" if msg.get("memory") else ""
            raise WorkerError(
                f"{link} failed {msg['where']}: {msg['error']}{memory}\n\n"
                f"Original traceback in the worker:\n{msg['traceback']}"
            )
        if msg.get("memory"):  # about this task (None: the worker could not say which)
            raise WorkerError(
                f"{link} ran out of memory {msg['where']}, in its batch of samples "
                f"{span(indices)} ({msg['error']}). This is not a bad sample: "
                f"the worker has too little memory for its batch. Fix: {FIX}."
            )
        if msg.get("task") != task.number:
            raise WorkerError(
                f"{link} sent the result of task {msg.get('task')} while task "
                f"{task.number} was expected (protocol error; please report it)."
            )
        if msg["kind"] == "error":
            if msg["sample_error"]:  # on_error="raise": the same error as without workers
                raise SampleError(f"{msg['error'].split(': ', 1)[1]} (in worker {w})")
            raise WorkerError(
                f"{link} failed while decoding samples {span(indices)}: "
                f"{msg['error']}\n\nOriginal traceback in the worker:\n"
                f"{msg['traceback']}"
            )
        shapes = msg["shapes"]
        dtype: torch.dtype = getattr(torch, msg.get("dtype", "uint8"))
        if msg.get("fd"):  # a stacked batch in a memory file: mapped, not copied
            try:
                fd = self._recv_fd(link, indices, deadline)
            except _DescriptorLost:  # out of descriptors here: the batch is decoded here
                lost = self._with_masks(self._decoded(msg, w, []), msg, link, indices, deadline)
                del lost  # its masks were read to keep the link in step; made again below
                return self._decode_here(task)
            try:
                mapped = _batch_files.attach(fd, msg["nbytes"], dtype, tuple(shapes[0]))
            except (OSError, ValueError) as err:
                raise_if_out_of_memory(err, f"mapping a batch from {link}")
                raise WorkerError(f"{link} sent a batch that could not be mapped: {err}") from err
            return self._with_masks(self._decoded(msg, w, mapped), msg, link, indices, deadline)
        try:
            buf = torch.empty(msg["nbytes"], dtype=torch.uint8, pin_memory=self.pin_memory)
        except RuntimeError as err:
            raise_if_out_of_memory(
                err, f"receiving a batch of {msg['nbytes'] / 2**20:,.1f} MiB from {link}"
            )
            raise
        if msg["nbytes"]:
            # numpy's stubs give ndarray the buffer protocol only from Python 3.12 on (numpy#26783)
            into = memoryview(buf.numpy())  # type: ignore[arg-type]
            self._recv(link, bytes_into=into, indices=indices, deadline=deadline)
        images: torch.Tensor | list[torch.Tensor]
        if msg["stacked"]:  # a float batch's bytes, viewed as its dtype (no copy)
            images = buf.view(dtype).view(shapes[0])
        else:
            sizes = [int(np.prod(s)) for s in shapes]
            images = [t.view(s) for t, s in zip(buf.split(sizes), shapes)]
        return self._with_masks(self._decoded(msg, w, images), msg, link, indices, deadline)

    def _with_masks(
        self,
        out: Decoded,
        msg: Message,
        link: Link,
        indices: np.ndarray,
        deadline: float | None,
    ) -> Decoded:
        """``out`` with the masks whose one buffer follows the batch (``masks`` in its header)."""
        layout = msg.get("masks")
        if layout is None:
            return out
        buf = torch.empty(layout["nbytes"], dtype=torch.uint8, pin_memory=self.pin_memory)
        if layout["nbytes"]:
            # numpy's stubs give ndarray the buffer protocol only from Python 3.12 on
            into = memoryview(buf.numpy())  # type: ignore[arg-type]
            self._recv(link, bytes_into=into, indices=indices, deadline=deadline)
        dtype: torch.dtype = getattr(torch, layout["dtype"])
        shapes = layout["shapes"]
        flat = buf.view(dtype)
        if layout["stacked"]:
            out.masks = flat.view(shapes[0])
        else:
            sizes = [int(np.prod(s)) for s in shapes]
            out.masks = [t.view(s) for t, s in zip(flat.split(sizes), shapes)]
        return out

    @staticmethod
    def _decoded(msg: Message, w: int, images: torch.Tensor | list[torch.Tensor]) -> Decoded:
        return Decoded(
            images,
            msg["indices"],
            msg["failed"],
            len(msg["indices"]),
            warned=msg.get("warned", []),
            mismatched=msg.get("mismatched", []),
            times=msg["times"],
            routes=msg["routes"],
            busy=msg["busy"],
            worker=w,
            rng_state=msg.get("rng_state"),
        )

    def _decode_here(self, task: Task) -> Decoded:
        """A batch decoded in this process (its worker's memory file could not be received),
        with the same plans and seed: the same pixels the worker made. Said once a pool."""
        if not self._warned_fds:
            self._warned_fds = True
            soft, hard = _open_files_limit()
            warnings.warn(
                "gpucache: this process ran out of file descriptors (the open-file limit, "
                f"RLIMIT_NOFILE, is {soft} here, at most {hard}), so a worker's batch could not "
                "be received as a memory file; such batches are decoded in this process "
                "instead (slower, nothing lost). Fix: raise the limit (`ulimit -n "
                f"{max(hard, 4096) if hard > 0 else 4096}` before starting, or "
                "resource.setrlimit(resource.RLIMIT_NOFILE, ...)), or close the files and "
                "batches the process keeps open (a memory-file batch holds one descriptor "
                "until it is freed).",
                RuntimeWarning,
                stacklevel=4,
            )
        log.info("gpucache: decoding samples %s here: no descriptor left", span(task.indices))
        return decode_batch(
            self.cache, task.indices, task.plans, self._options, stack=task.stack, key=task.key
        )

    # ------------------------------------------------------------------ shutdown
    @contextmanager
    def _using(self) -> Iterator[None]:
        with self._cv:
            if self._closed:
                raise WorkerError(
                    "the worker pool is closed; iterate the loader again to start new workers."
                )
            self._active += 1
            self._active_thread = threading.get_ident()
        try:
            yield
        finally:
            with self._cv:
                self._active -= 1
                self._cv.notify_all()

    def close(self) -> None:
        """Stop every worker (in parallel, well under a second). Idempotent and thread-safe: a
        get() waiting in another thread is woken and raises ``WorkerError``."""
        with self._cv:
            self._closed = True
            if self._active and self._active_thread != threading.get_ident():
                try:
                    self._wake[1].send(b"x")
                except OSError:
                    pass
                if not self._cv.wait_for(lambda: self._active == 0, timeout=_LEAVE):
                    log.warning(
                        "gpucache: a thread using the worker pool did not leave it "
                        "within %.0f s of close(); stopping the workers anyway",
                        _LEAVE,
                    )
            self._pending.clear()
        self._finalizer()
