"""The per-node build lock: an exclusive ``flock`` whose holder publishes its progress.

The holder writes one JSON record into its lock file (pid, host, phase, samples done of total,
bytes, ETA, and a count of the build's progress reports), rewritten at most every 0.5 s while
the build reports. Waiters poll it (and the size of
the store's temporary file while it is saved) and log it every 30 s; they give up only when
nothing has moved for ``stall_timeout`` seconds, with an error that names the holder and what it
last reported. A dead holder loses its flock with its process, so the next waiter takes over. The
holder removes the lock file before releasing it; a waiter that then holds a removed file's lock
takes the new one.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from ._dir import not_writable, open_own

log = logging.getLogger(__name__)

POLL_S, NOTE_S, WRITE_S = 0.2, 30.0, 0.5
RECORD = 512  # bytes: the record is padded to one fixed-size pwrite, read back whole


class NodeLock:
    """``with NodeLock(folder / "<key>.lock", store, stall_timeout) as lock:`` build, calling
    ``lock.progress(...)``; the lock file is removed on exit."""

    def __init__(self, path: Path, store: Path, stall_timeout: float):
        self.path, self.store, self.stall_timeout = path, store, stall_timeout
        self.fd: int | None = None
        self._state: dict[str, Any] = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "phase": "starting",
            "done": 0,
            "total": 0,
            "bytes": 0,
            "eta_s": None,
            "reports": 0,
        }
        self._t0 = time.monotonic()
        self._written = 0.0
        self._mutex = threading.Lock()

    # ------------------------------------------------------------------ holder side
    def __enter__(self) -> NodeLock:
        self.fd = self._acquire()
        self._write()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.fd is not None  # set by __enter__
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        finally:
            os.close(self.fd)

    def phase(self, name: str, total: int | None = None) -> None:
        with self._mutex:
            self._state.update(phase=name, done=0, bytes=0, eta_s=None)
            if total is not None:
                self._state["total"] = int(total)
            self._t0 = time.monotonic()
            self._write()

    def progress(self, *report: Any) -> None:
        """The build's progress callback: ``(stage, done, total, bytes_done, bytes_total)`` or
        ``(done, total, bytes_done)``: ``done`` of ``total`` inputs, ``bytes_done`` read."""
        named = report if isinstance(report[0], str) else ("read", *report)
        stage, done, total, bytes_done = (*named, 0)[:4]
        now = time.monotonic()
        with self._mutex:
            if stage != self._state["phase"]:
                self._state["phase"], self._t0 = stage, now
            rate = done / max(now - self._t0, 1e-6)
            eta = (total - done) / rate if done and rate > 0 else None
            self._state.update(
                done=int(done),
                total=int(total),
                bytes=int(bytes_done),
                eta_s=None if eta is None else round(eta, 1),
                reports=self._state["reports"] + 1,
            )  # a chunk done, even if
            # its numbers did not move (the build's sizing stage reports no samples)
            if now - self._written >= WRITE_S or done >= total:
                self._write()

    def _write(self) -> None:
        record = json.dumps(self._state).encode()[:RECORD].ljust(RECORD)
        assert self.fd is not None  # written only while the lock is held
        os.pwrite(self.fd, record, 0)
        self._written = time.monotonic()

    # ------------------------------------------------------------------ waiter side
    def _acquire(self) -> int:
        seen, moved, next_note = None, time.monotonic(), time.monotonic() + NOTE_S
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = False
            except BlockingIOError:
                held = True
            # waited on outside the handler: a Ctrl-C while waiting chains no BlockingIOError
            if held:
                record = _read(fd)
                os.close(fd)
                now = time.monotonic()
                state = (record, self._saving())
                if state != seen:
                    seen, moved = state, now
                elif now - moved > self.stall_timeout:
                    raise TimeoutError(
                        f"gpucache: no progress for {self.stall_timeout:.0f} s from "
                        f"{describe(record)}, which holds {self.path} to build {self.store}. If "
                        "that build is stuck, stop that process (the lock goes with it), or pass "
                        "another cache_dir."
                    ) from None
                if now > next_note:
                    log.info("gpucache: waiting for %s to build %s", describe(record), self.store)
                    next_note = now + NOTE_S
                time.sleep(POLL_S)  # polling a lock another process holds, under the stall deadline
                continue
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                return fd
            os.close(fd)  # the holder removed this lock file while we waited: take the new one

    def _open(self) -> int:
        for _ in range(3):
            try:
                fd, why = open_own(self.path, os.O_RDWR | os.O_CREAT)
            except OSError as err:
                raise not_writable(
                    err, self.path.parent, f"cannot create the lock file {self.path}"
                ) from err
            if fd is not None:
                return fd
            log.warning(
                "gpucache: removing %s, which %s (not a lock file of this user)", self.path, why
            )
            self.path.unlink(missing_ok=True)  # unlink never follows a link
        raise PermissionError(
            errno.EPERM,
            f"{self.path} keeps being replaced by a file that is "
            "not a lock file of this user; pass another cache_dir.",
        )

    def _saving(self) -> tuple[int, ...]:
        """The sizes of the store's temporary files: a save in progress grows them."""
        out = []
        for tmp in self.path.parent.glob(f".{self.store.name}.*"):
            try:
                out.append(os.lstat(tmp).st_size)
            except FileNotFoundError:
                pass
        return tuple(sorted(out))


def _read(fd: int) -> str:
    try:
        return os.pread(fd, RECORD, 0).decode(errors="replace").strip()
    except OSError:
        return ""


def describe(record: str) -> str:
    """'pid 12 on host (building: 4,000/10,000 samples, 12.0 MiB, ETA 30 s)' from a record."""
    try:
        r = json.loads(record)
        who = f"pid {int(r['pid'])} on {r['host']}"
    except (ValueError, KeyError, TypeError):
        return f"another process ({record[:80] or 'unknown'})"
    eta = r.get("eta_s")
    return (
        f"{who} ({r.get('phase')}: {r.get('done', 0):,}/{r.get('total', 0):,} samples, "
        f"{r.get('bytes', 0) / 2**20:,.1f} MiB{'' if eta is None else f', ETA {eta:.0f} s'})"
    )
