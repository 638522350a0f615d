"""The CPU worker pool: persistent processes, seeded, shut down deterministically.

Each worker owns one duplex pipe. Tasks (store indices + plans, a few hundred bytes) go down as
small pickles; a decoded batch comes back as a small header plus one raw buffer written with
``send_bytes`` and read straight into the destination tensor (pinned when asked) with
``recv_bytes_into`` -- no per-sample pickling, and no shared memory (so no ``/dev/shm`` limits).
Tasks go round-robin and results are read in the same order, so batch order is deterministic.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import random
import signal
import traceback
import weakref
from collections import deque
from multiprocessing.connection import wait

import numpy as np
import torch

from .decode.cpu import Decoded, SampleError, decode_batch

log = logging.getLogger("gpucache")


class WorkerError(RuntimeError):
    """A worker raised or died; the message names the worker, the sample and the cause."""


def _worker_main(wid: int, conn, cache, seed: int, worker_init_fn, on_error: str) -> None:
    import warnings

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    torch.set_num_threads(1)
    try:
        import cv2

        cv2.setNumThreads(0)
    except ImportError:
        pass
    warnings.filterwarnings("ignore", message=r".*image decoding and encoding capabilities")
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if worker_init_fn is not None:
        worker_init_fn(wid)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the main process went away
            return
        if msg is None:
            return
        task, indices, plans, stack = msg
        try:
            out = decode_batch(cache, indices, plans, on_error=on_error, stack=stack)
        except BaseException as err:  # noqa: BLE001 - everything is reported to the parent
            conn.send({"task": task, "error": f"{type(err).__name__}: {err}",
                       "sample_error": isinstance(err, SampleError),
                       "traceback": traceback.format_exc()})
            continue
        _send(conn, task, out)
        del out  # an idle worker holds no decoded images


def _send(conn, task: int, out: Decoded) -> None:
    imgs = out.images
    if isinstance(imgs, torch.Tensor):
        shapes, flat = [tuple(imgs.shape)], imgs.contiguous().numpy()
    else:
        shapes = [tuple(t.shape) for t in imgs]
        flat = (torch.cat([t.contiguous().reshape(-1) for t in imgs]) if imgs
                else torch.empty(0, dtype=torch.uint8)).numpy()
    conn.send({"task": task, "stacked": isinstance(imgs, torch.Tensor), "shapes": shapes,
               "indices": out.indices, "failed": out.failed, "nbytes": flat.nbytes})
    if flat.nbytes:
        conn.send_bytes(memoryview(flat).cast("B"))


def _stop(procs, conns) -> None:
    """Ask, then terminate, then kill; close every pipe. Idempotent (finalizer)."""
    for c in conns:
        try:
            c.send(None)
        except (OSError, ValueError):
            pass
    for p in procs:
        p.join(timeout=5)
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(timeout=2)
        if p.is_alive():
            p.kill()
            p.join()
    for c in conns:
        c.close()
    for p in procs:
        p.close()


class WorkerPool:
    """``num_workers`` persistent decode processes fed round-robin."""

    def __init__(self, cache, *, num_workers: int, context: str | None, seed: int,
                 worker_init_fn, on_error: str, timeout: float | None, pin_memory: bool):
        ctx = mp.get_context(context)
        self.cache, self.timeout, self.pin_memory = cache, timeout, pin_memory
        if ctx.get_start_method() != "fork" and not cache.is_shared:
            cache.share()  # spawn/forkserver attach to shared pages; room checked first
        seeds = np.random.SeedSequence(seed).spawn(num_workers)
        self.procs, self.conns = [], []
        for wid in range(num_workers):
            parent, child = ctx.Pipe(duplex=True)
            p = ctx.Process(target=_worker_main, name=f"gpucache-worker-{wid}", daemon=True,
                            args=(wid, child, cache, int(seeds[wid].generate_state(1)[0]),
                                  worker_init_fn, on_error))
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns)
        self._next = 0
        self._pending: deque[tuple[int, int, np.ndarray]] = deque()  # (worker, task, indices)
        self._task = 0

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs] if self._finalizer.alive else []

    def submit(self, indices: np.ndarray, plans: np.ndarray, stack: bool) -> None:
        w = self._next
        self._next = (w + 1) % len(self.procs)
        self._task += 1
        self.conns[w].send((self._task, indices, plans, stack))
        self._pending.append((w, self._task, indices))

    def __len__(self) -> int:
        return len(self._pending)

    def get(self) -> Decoded:
        w, task, indices = self._pending.popleft()
        conn, proc = self.conns[w], self.procs[w]
        pid = proc.pid
        ready = wait([conn, proc.sentinel], self.timeout)
        if not ready:
            self.close()
            raise WorkerError(f"worker {w} (pid {pid}) returned no batch within "
                              f"timeout={self.timeout}s while decoding samples "
                              f"{_span(indices)}; raise timeout= if images are very large.")
        try:
            header = conn.recv() if conn in ready or conn.poll() else None
        except (EOFError, OSError):
            header = None
        if header is None:
            proc.join(1)
            code = proc.exitcode
            why = (f"killed by signal {signal.Signals(-code).name}" if code and code < 0
                   else f"exited with code {code}")
            self.close()
            raise WorkerError(f"worker {w} (pid {pid}) {why} while decoding samples "
                              f"{_span(indices)}. If it was killed by the OOM killer (SIGKILL), "
                              "use fewer workers or a smaller batch_size.")
        assert header["task"] == task, "worker results out of order"
        if "error" in header:
            self.close()
            if header["sample_error"]:  # on_error="raise": the same error as without workers
                raise SampleError(f"{header['error'].split(': ', 1)[1]} (in worker {w})")
            raise WorkerError(f"worker {w} failed while decoding samples {_span(indices)}: "
                              f"{header['error']}\n\nOriginal traceback in the worker:\n"
                              f"{header['traceback']}")
        buf = torch.empty(header["nbytes"], dtype=torch.uint8, pin_memory=self.pin_memory)
        if header["nbytes"]:
            conn.recv_bytes_into(buf.numpy())
        shapes = header["shapes"]
        if header["stacked"]:
            images = buf.view(shapes[0])
        else:
            sizes = [int(np.prod(s)) for s in shapes]
            images = [t.view(s) for t, s in zip(buf.split(sizes), shapes)]
        return Decoded(images, header["indices"], header["failed"], len(header["indices"]))

    def drain(self) -> None:
        """Read and drop the results of an abandoned epoch."""
        while self._pending:
            self.get()

    def close(self) -> None:
        self._pending.clear()
        self._finalizer()


def _span(indices: np.ndarray) -> str:
    idx = indices.tolist()
    return str(idx) if len(idx) <= 8 else f"[{', '.join(map(str, idx[:8]))}, ...] ({len(idx)})"


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1
