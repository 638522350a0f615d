"""The pool's reads from its workers: a result's bytes and its memory file, each wait bounded by
the pool's timeout and the worker's liveness and woken by ``close()`` from another thread, the
other workers' tasks flushed meanwhile; a worker that dies mid-read is named with its samples."""

from __future__ import annotations

import os
import select
import signal
import socket
import time

import numpy as np

from ..._errors import WorkerError
from ...store._oom import FIX
from ._messages import LEN
from ._procs import Link

_REAP = 5.0  # for a worker whose connection ended to be reaped, so its exit code can be named
_SLICE_MS = 1000  # the longest a wait for a worker sleeps before it checks for signals


def span(indices: np.ndarray) -> str:
    """``indices`` as an error message names them (the first 8, and how many)."""
    idx = indices.tolist()
    return str(idx) if len(idx) <= 8 else f"[{', '.join(map(str, idx[:8]))}, ...] ({len(idx)})"


class _DescriptorLost(Exception):
    """A batch's memory file did not arrive: this process had no descriptor left for it (the
    kernel truncates the message's control data, ``MSG_CTRUNC``, and drops the descriptor)."""


class Receiving:
    """The reading half of :class:`._pool.WorkerPool`, which sets these attributes."""

    _links: list[Link]
    _wake: tuple[socket.socket, socket.socket]  # close() from another thread writes to [1]
    _closed: bool
    timeout: float | None
    method: str  # the workers' start method

    def _recv_fd(self, link: Link, indices: np.ndarray, deadline: float | None) -> int:
        """The memory file a worker sends after a batch's header (:mod:`._batch_files`); raises
        :class:`_DescriptorLost` when this process has no descriptor left to receive it."""
        exited = False
        while True:
            try:
                data, fds, flags, _ = socket.recv_fds(link.sock, 1, 1)
            except BlockingIOError:
                if exited:
                    raise self._died(link, indices, 0, 1) from None
                exited = self._wait(link, indices, deadline, 0, 1)
                continue
            except OSError as err:  # ConnectionResetError: killed mid-send
                raise self._died(link, indices, 0, 1) from err
            if not data:
                for fd in fds:
                    os.close(fd)
                raise self._died(link, indices, 0, 1)
            if not fds and flags & socket.MSG_CTRUNC:  # the kernel dropped it: no fd left
                raise _DescriptorLost()
            if len(fds) != 1:
                for fd in fds:
                    os.close(fd)
                raise WorkerError(
                    f"{link} sent no memory file after a batch's header (protocol error; "
                    "please report it)."
                )
            return fds[0]

    def _header(self, link: Link, indices: np.ndarray, deadline: float | None) -> memoryview:
        head = bytearray(LEN.size)
        self._recv(link, memoryview(head), indices, deadline)
        return memoryview(bytearray(LEN.unpack(head)[0]))

    def _recv(
        self, link: Link, bytes_into: memoryview, indices: np.ndarray, deadline: float | None
    ) -> memoryview:
        """Fill ``bytes_into`` from ``link``, waiting at most until ``deadline``."""
        got, exited = 0, False
        while got < len(bytes_into):
            try:
                n = link.sock.recv_into(bytes_into[got:])
            except BlockingIOError:
                n = None  # nothing yet: wait below, outside this handler, so that a Ctrl-C
                # while waiting is a plain KeyboardInterrupt, not one chained to this error
            except OSError as err:  # ConnectionResetError: killed mid-send
                raise self._died(link, indices, got, len(bytes_into)) from err
            if n is None:
                if exited:  # nothing left to read from a dead worker
                    raise self._died(link, indices, got, len(bytes_into))
                exited = self._wait(link, indices, deadline, got, len(bytes_into))
                continue
            if n == 0:
                raise self._died(link, indices, got, len(bytes_into))
            got += n
        return bytes_into

    def _wait(
        self, link: Link, indices: np.ndarray, deadline: float | None, got: int, size: int
    ) -> bool:
        """Wait for data from ``link``, its exit, or close(); flush other workers' tasks meanwhile.

        Returns True when the worker's process has exited."""
        poller = select.poll()
        flags = {lk.sock.fileno(): select.POLLOUT for lk in self._links if lk.out}
        flags[link.sock.fileno()] = flags.get(link.sock.fileno(), 0) | select.POLLIN
        for fd, ev in flags.items():
            poller.register(fd, ev)
        poller.register(link.proc.sentinel, select.POLLIN)
        poller.register(self._wake[0], select.POLLIN)
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            if not link.ready:
                raise WorkerError(
                    f"{link} did not start within timeout={self.timeout}s "
                    f"({self.method} start method; a new worker imports torch "
                    "first, slow on a busy machine). Raise timeout=."
                )
            part = f" (it stopped after {got} of {size} bytes)" if got else ""
            raise WorkerError(
                f"{link} returned no batch within timeout={self.timeout}s while "
                f"decoding samples {span(indices)}{part}; it is hung or stopped "
                "(SIGSTOP). Raise timeout= if images are very large."
            )
        # at most a second at a time: a signal the kernel hands to another thread of this
        # process (Ctrl-C while this one sleeps, when this one already had one pending) runs
        # its Python handler only once this thread runs Python again
        wait_ms = _SLICE_MS if left is None else min(_SLICE_MS, max(1, int(left * 1000) + 1))
        events = poller.poll(wait_ms)
        if self._closed:
            raise WorkerError(
                f"the worker pool was closed (close() from another thread) while "
                f"waiting for samples {span(indices)} from {link}."
            )
        for lk in self._links:
            if lk.out:
                lk.flush()
        return any(fd == link.proc.sentinel for fd, _ in events)

    def _died(self, link: Link, indices: np.ndarray, got: int, size: int) -> WorkerError:
        if self._closed:  # close() from another thread shut the socket under this read
            return WorkerError(
                f"the worker pool was closed (close() from another thread) while "
                f"reading samples {span(indices)} from {link}."
            )
        link.proc.join(_REAP)
        code = link.proc.exitcode
        if code is not None and code < 0:
            why = f"was killed by signal {signal.Signals(-code).name}"
        else:
            why = "closed its connection" if code is None else f"exited with code {code}"
        doing = (
            f"while sending its result for samples {span(indices)} (after {got} of {size} bytes)"
            if got
            else f"while decoding samples {span(indices)}"
        )
        if not link.ready and self.method != "fork" and code is not None and code > 0:
            return WorkerError(
                f"{link} {why} before it started ({self.method} start method). Likely cause: the "
                'script that creates the loader has no `if __name__ == "__main__":` guard, so '
                "each worker re-runs it on import; or worker_init_fn / the store could not be "
                "unpickled in the worker (define functions at module top level). The worker's "
                "own traceback is on stderr above."
            )
        hint = (
            f" If the OOM killer killed it (see dmesg): {FIX}." if code == -signal.SIGKILL else ""
        )
        return WorkerError(f"{link} {why} {doing}.{hint}")
