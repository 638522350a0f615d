"""Fetch the objects of a :class:`~._client.Listing` once, into a spool file that survives a kill.

The spool is one file the size of all the objects (``<key>.fetch`` in the node cache folder,
space reserved up front), each object at a fixed offset; objects over ``PART`` bytes are fetched
in parts of that size (ranged GETs, in parallel). Up to ``requests`` requests run at once, with
at most ``IN_FLIGHT_BYTES`` of response bodies in memory; each part is written where it belongs
(``pwrite``) and then recorded in the journal ``<key>.fetched`` (part number and CRC-32, 12
bytes). A build that was killed starts again from the journal: the parts it names are checked
against their CRC and kept, the rest are fetched; nothing recorded is fetched twice. The store
is built from the spool (``FileRangeSource`` ranges) and the spool removed once the store is
saved; a partial spool is never a store. ``fetch`` fills a spool and then lists the objects
again (``check_unchanged``): a build stops if any changed meanwhile.

Transient failures (connection reset or refused, timeouts, HTTP 5xx, 429 and S3's SlowDown)
are retried up to ``RETRIES`` times with exponential backoff and full jitter, within
``DEADLINE_S`` a part; anything else (403, 404, a redirect, an object shorter than listed) is
final. Each attempt has a time limit of its own, ``ATTEMPT_S`` and never past the part's
deadline, besides the client's read timeout (which a body sent a byte at a time never
reaches): an attempt still reading then is cancelled, its connection closed, and the part
retried, so a part ends, fetched or failed, within ``DEADLINE_S`` of its first attempt. An
object that stays unreadable is handed to the build as a refused input with its URL and reason,
under the build's ``on_error`` policy.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import shutil
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from ..._errors import ObjectStoreError
from ...base._owned import open_own
from ...base._progress import tqdm
from .._inputs import FileRangeSource, Refused
from .._lazy import OnAccess
from .._options import BuildOptions
from . import _calls
from ._calls import backoff, transient
from ._client import Listing, access_error, bucket_of, describe, filesystem

log = logging.getLogger(__name__)

T = TypeVar("T")

PART = 8 << 20  # bytes of one ranged GET of a large object
IN_FLIGHT_BYTES = 128 << 20  # response bodies held at once, across the requests in flight
DEFAULT_REQUESTS = 32  # requests in flight (``requests_in_flight=``)
ATTEMPT_S = 120.0  # the most one attempt at a part takes (8 MiB in 120 s: 70 KB/s)
DENIED_STOP = 8  # this many objects denied before any is fetched: the bucket is denied, stop
_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)  # a disk, a file-size limit, a quota
_RECORD = np.dtype([("part", "<u8"), ("crc", "<u4")])


class _Changed(Exception):
    """An object's bytes do not match its listing (it was rewritten during the build)."""


class Spool:
    """The objects of ``listing`` fetched into ``<base>.fetch``; ``<base>.fetched`` records
    what is there. ``fetch()`` returns the objects that could not be fetched, with reasons."""

    def __init__(
        self,
        base: Path,
        listing: Listing,
        fs: Any,  # fsspec's file system: untyped
        *,
        requests: int | None = None,
        progress: bool = True,
        on_progress: Callable[..., None] | None = None,
    ) -> None:
        self.data = base.with_name(base.name + ".fetch")
        self.journal = base.with_name(base.name + ".fetched")
        self.listing, self.fs = listing, fs
        self.requests = max(1, int(requests or DEFAULT_REQUESTS))
        self.progress, self.on_progress = progress, on_progress
        sizes = np.maximum(listing.sizes, 0)
        self.offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(sizes, out=self.offsets[1:])
        parts = (sizes + PART - 1) // PART  # an empty object has no part: nothing to fetch
        self.first_part = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(parts, out=self.first_part[1:])
        self.failed: dict[int, str] = dict(listing.missing)
        self._stop = threading.Event()
        self.fetched_parts = self.fetched_bytes = 0  # by this process (not those resumed)

    @property
    def total(self) -> int:
        return int(self.offsets[-1])

    def source(self, i: int) -> FileRangeSource | Refused:
        """Object ``i`` as a build input: its range of the spool, or refused with the reason."""
        name = self.listing.urls[i]
        if i in self.failed:
            return Refused(name, self.failed[i])
        return FileRangeSource(name, self.data, int(self.offsets[i]), int(self.listing.sizes[i]))

    def inputs(self) -> Sequence[FileRangeSource | Refused]:
        return _Inputs(self)

    def remove(self) -> None:
        for p in (self.data, self.journal):
            p.unlink(missing_ok=True)

    # ------------------------------------------------------------------ fetching
    def fetch(self) -> dict[int, str]:
        n_parts = int(self.first_part[-1])
        fd, fresh = _open_own(self.data)
        try:
            jfd, _ = _open_own(self.journal)
        except BaseException:
            os.close(fd)
            raise
        try:
            if fresh:  # a journal names parts of the data file it was written with, no other
                os.ftruncate(jfd, 0)
            self._reserve(fd)
            done = self._resume(fd, jfd, n_parts)
            os.lseek(jfd, 0, os.SEEK_END)
            self._fetch_missing(fd, jfd, done)
        finally:
            os.close(jfd)
            os.close(fd)
        return self.failed

    def _reserve(self, fd: int) -> None:
        """Room for every object, reserved before the first request (a full disk fails now,
        and a spool this build made is removed again: no sparse file of the full size stays)."""
        before = os.fstat(fd).st_size
        try:
            if before != self.total:
                os.ftruncate(fd, self.total)
            if self.total:
                try:
                    os.posix_fallocate(fd, 0, self.total)
                except OSError as err:
                    if err.errno in _FULL:
                        raise
                    # a file system without fallocate: the writes find out
        except OSError as err:
            if err.errno not in _FULL:
                raise
            if before == 0:  # this build's new spool: nothing of it is kept
                self.remove()
            else:  # a killed build's spool: as it was, its recorded parts kept for a resume
                os.ftruncate(fd, before)
            raise OSError(
                err.errno,
                f"cannot reserve {_size(self.total)} for the fetched objects in "
                f"{self.data} ({err.strerror}; {_free(self.data)}): free space there, or pass "
                "cache_dir= a folder on a larger node-local disk (the store needs as much "
                "again while it is saved)",
            ) from err

    def _resume(self, fd: int, jfd: int, n_parts: int) -> np.ndarray:
        """The parts a previous build recorded and whose bytes still match their CRC."""
        done = np.zeros(n_parts, dtype=bool)
        size = os.fstat(jfd).st_size
        whole = size - size % _RECORD.itemsize
        if size != whole:  # a record cut short by a kill: dropped
            os.ftruncate(jfd, whole)
        if not whole:
            return done
        records = np.frombuffer(os.pread(jfd, whole, 0), dtype=_RECORD)
        good = []
        for part, crc in zip(records["part"].tolist(), records["crc"].tolist()):
            if part >= n_parts or done[part]:
                continue
            start, length = self._range(part)
            if zlib.crc32(os.pread(fd, length, start)) == crc:
                done[part] = True
                good.append((part, crc))
        if len(good) != len(records):  # rewrite the journal with the parts that hold
            data = np.array(good, dtype=_RECORD).tobytes()
            os.ftruncate(jfd, 0)
            os.pwrite(jfd, data, 0)
        if good:
            log.info(
                "gpucache: resuming the fetch into %s: %d of %d parts already there",
                self.data,
                len(good),
                n_parts,
            )
        return done

    def _locate(self, part: int) -> tuple[int, int, int]:
        """(object, start, end) within the object of a part."""
        i = int(np.searchsorted(self.first_part, part, side="right")) - 1
        start = (part - int(self.first_part[i])) * PART
        return i, start, min(int(self.listing.sizes[i]), start + PART)

    def _range(self, part: int) -> tuple[int, int]:
        i, a, b = self._locate(part)
        return int(self.offsets[i]) + a, b - a

    def _get(self, fd: int, part: int) -> tuple[int, int, str | None]:
        """Fetch one part into its place: ``(part, crc, None)`` or ``(part, 0, reason)``."""
        i, a, b = self._locate(part)
        path = self.listing.path(i)
        start, attempt = time.monotonic(), 0
        timed = bool(getattr(self.fs, "async_impl", False))  # fsspec's async clients take one
        while True:
            if self._stop.is_set():
                return part, 0, "the build stopped"
            limit = min(ATTEMPT_S, _calls.DEADLINE_S - (time.monotonic() - start))
            try:
                data = self._attempt(path, a, b, limit if timed else None)
                if len(data) != b - a:
                    raise _Changed(
                        f"the server sent {len(data):,} bytes for bytes {a:,}-{b:,} of an object "
                        f"listed at {int(self.listing.sizes[i]):,} bytes: it changed since it "
                        "was listed; build again"
                    )
                break
            except _Changed as err:
                return part, 0, str(err)
            except Exception as err:
                spent = time.monotonic() - start
                if not transient(err):
                    return part, 0, f"cannot fetch: {describe(err)}"
                delay = backoff(attempt)
                if (
                    attempt >= _calls.RETRIES or _calls.DEADLINE_S - spent - delay < 0.05
                ):  # no time to retry
                    tries = f"{attempt + 1} attempt{'s' if attempt else ''} in {spent:.1f} s"
                    return part, 0, f"cannot fetch: {describe(err)}; gave up after {tries}"
                log.debug("gpucache: retrying %s after %s", self.listing.urls[i], describe(err))
            self._stop.wait(delay)  # a backoff, cut short when the build stops
            attempt += 1
        view, at = memoryview(data), int(self.offsets[i]) + a
        while view:
            written = os.pwrite(fd, view, at)
            view, at = view[written:], at + written
        return part, zlib.crc32(data), None

    def _attempt(self, path: str, a: int, b: int, limit: float | None) -> bytes:
        """Bytes ``a:b`` of ``path``; an async client's call is cancelled (its connection
        closed) after ``limit`` seconds, however slowly the body still comes."""
        if limit is None:
            data: bytes = self.fs.cat_file(path, start=a, end=b)
            return data
        try:
            data = self.fs.cat_file(path, start=a, end=b, timeout=max(limit, 0.01))
        except Exception as err:  # fsspec's sync(): asyncio.wait_for, then FSTimeoutError
            if type(err).__name__ != "FSTimeoutError":
                raise
            raise TimeoutError(
                f"no complete answer within {limit:.1f} s (an attempt's limit: a body "
                "that comes too slowly is cut off)"
            ) from err
        return data

    def _fetch_missing(self, fd: int, jfd: int, done: np.ndarray) -> None:
        n = len(self.listing)
        parts_of = np.diff(self.first_part).astype(np.int32)  # 4 bytes an object: parts...
        counted = np.zeros(len(done) + 1, dtype=np.int64)
        np.cumsum(done, out=counted[1:])
        have = (counted[self.first_part[1:]] - counted[self.first_part[:-1]]).astype(np.int32)
        del counted  # ...and parts already there (a resumed build)
        objects_done = int(np.count_nonzero(have == parts_of))  # empty objects count as done
        resumed = np.flatnonzero(done)
        owner = np.searchsorted(self.first_part, resumed, side="right") - 1
        starts = (resumed - self.first_part[owner]) * PART
        resumed_bytes = int(np.minimum(self.listing.sizes[owner] - starts, PART).sum())
        bar = tqdm(
            total=self.total,
            initial=resumed_bytes,
            desc="gpucache fetch",
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            disable=not self.progress or None,
            leave=False,
        )
        left: dict[int, int] = {}  # object -> parts still to come, for objects of several parts
        t0, shown = time.monotonic(), 0.0
        got_any, denied = bool(len(resumed)), 0
        pending: set[Future[tuple[int, int, str | None]]] = set()
        in_flight = 0
        state = {"objects": objects_done, "bytes": resumed_bytes}

        def finish(f: Future[tuple[int, int, str | None]]) -> None:
            nonlocal in_flight, got_any, denied, shown
            part, crc, reason = f.result()
            i, a, b = self._locate(part)
            in_flight -= b - a
            if reason is None:
                os.write(jfd, np.array([(part, crc)], dtype=_RECORD).tobytes())
                self.fetched_parts += 1
                self.fetched_bytes += b - a
                state["bytes"] += b - a
                bar.update(b - a)
                got_any = True
            elif i not in self.failed:
                self.failed[i] = reason
                if "HTTP 403" in reason or "denied" in reason.lower():
                    denied += 1
            remaining = left.pop(i, 1) - 1
            if remaining > 0:
                left[i] = remaining
            else:
                state["objects"] += 1
            now = time.monotonic()
            if now - shown > 0.5:
                shown = now
                rate = state["objects"] / max(now - t0, 1e-6)
                bar.set_postfix_str(f"{state['objects']:,}/{n:,} objects, {rate:,.0f} objects/s")
                if self.on_progress is not None:
                    self.on_progress("fetching", state["objects"], n, state["bytes"])

        with bar, ThreadPoolExecutor(self.requests, thread_name_prefix="gpucache-fetch") as pool:
            try:
                for part in _missing(done):
                    i, a, b = self._locate(part)
                    if i in self.failed:
                        continue
                    if parts_of[i] > 1 and i not in left:
                        left[i] = int(parts_of[i] - have[i])
                    while pending and (
                        len(pending) >= self.requests or in_flight + (b - a) > IN_FLIGHT_BYTES
                    ):
                        finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                        for f in finished:
                            finish(f)
                        if not got_any and denied >= min(DENIED_STOP, n):
                            raise self._denied()
                    in_flight += b - a
                    pending.add(pool.submit(self._get, fd, part))
                for f in _completed(pending):
                    finish(f)
                if not got_any and denied and denied >= min(DENIED_STOP, n):
                    raise self._denied()
            except BaseException:
                self._stop.set()  # threads stop at their next attempt or backoff
                raise
        if self.on_progress is not None:
            self.on_progress("fetching", state["objects"], n, state["bytes"])
        elapsed = time.monotonic() - t0
        if self.fetched_parts:
            log.info(
                "gpucache: fetched %d parts, %.1f MiB of %s in %.1f s (%.1f MiB/s)",
                self.fetched_parts,
                self.fetched_bytes / 2**20,
                self.listing.where,
                elapsed,
                self.fetched_bytes / 2**20 / max(elapsed, 1e-6),
            )

    def _denied(self) -> ObjectStoreError:
        url = self.listing.urls[next(iter(self.failed))]
        reason = next(iter(self.failed.values()))
        err = PermissionError(reason)
        clear = access_error(url, err, "read")
        return clear or ObjectStoreError(f"cannot read {url}: {reason}", bucket_of(url))


def _open_own(path: Path) -> tuple[int, bool]:
    """``(fd, fresh)``: the spool or journal file at ``path`` opened once (read and write), a
    regular file of this user that no one else may write (``open_own``), created 0600 if missing.
    Anything else under the name (another user's file, a link, a FIFO) is never read: it is
    removed and a new file made (``fresh``), so a build resumes only from its own bytes."""
    fd, why = open_own(path, os.O_RDWR | os.O_CREAT)
    if fd is not None:
        return fd, False
    if why == "missing":  # even under O_CREAT: the folder is gone
        raise FileNotFoundError(errno.ENOENT, f"cannot create {path}: its folder is gone")
    log.warning("gpucache: removing %s, which %s; fetching anew", path, why)
    path.unlink(missing_ok=True)
    fd, why = open_own(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
    if fd is None:
        raise PermissionError(errno.EPERM, f"cannot create {path}: it {why}", str(path))
    return fd, True


def _size(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def _free(path: Path) -> str:
    """How much room the disk holding ``path`` has left, in words."""
    try:
        return f"{_size(shutil.disk_usage(path.parent).free)} free there"
    except OSError:
        return "the free space there unknown"


def spool_full(err: OSError, spool: Path) -> OSError | None:
    """``err`` (saving a store built from the spool ``spool``: a full disk) saying that the
    spool holds the other copy of the data, where and how big, and that it is kept; None
    without a spool."""
    try:
        size = _size(spool.stat().st_size)
    except OSError:
        return None
    return OSError(
        err.errno,
        f"{err.strerror} The spool {spool} beside it holds the other copy of the data, the "
        f"fetched objects ({size}; {_free(spool)}): the disk needs room for the data twice "
        "while the store is saved. Free that much there, or pass cache_dir= a folder on a "
        "larger node-local disk; the spool is kept, and a build of the same objects into this "
        "folder resumes from it without fetching them again (`gpucache cache clean --all` "
        "removes it)",
    )


def _missing(done: np.ndarray) -> Iterator[int]:
    """The parts not done, in order (found 64 Ki parts at a time: no array of all of them)."""
    for s in range(0, len(done), 65536):
        yield from (np.flatnonzero(~done[s : s + 65536]) + s).tolist()


def _completed(pending: set[Future[T]]) -> Iterator[Future[T]]:
    while pending:
        finished, pending = wait(pending, return_when=FIRST_COMPLETED)
        yield from finished


class _Inputs(OnAccess[FileRangeSource | Refused]):
    """The spool's objects as build inputs, made on access (no object per input is kept)."""

    def __init__(self, spool: Spool) -> None:
        self._spool = spool

    def __len__(self) -> int:
        return len(self._spool.listing)

    def item(self, i: int) -> FileRangeSource | Refused:
        return self._spool.source(i)


def _digest(listing: Listing) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    listing.fingerprint(h)
    return h.digest()


def check_unchanged(listing: Listing, spool: Spool | None = None) -> None:
    """List again; raise :class:`ObjectStoreError` naming what changed since ``listing``."""
    again = listing.relist()
    if again is None or _digest(again) == _digest(listing):
        return
    before = {
        listing.urls[i]: (int(listing.sizes[i]), int(listing.tags[i])) for i in range(len(listing))
    }
    after = {again.urls[i]: (int(again.sizes[i]), int(again.tags[i])) for i in range(len(again))}
    changed = sorted(u for u in before.keys() & after.keys() if before[u] != after[u])
    added = sorted(after.keys() - before.keys())
    removed = sorted(before.keys() - after.keys())
    names = [f"changed {u}" for u in changed] + [f"added {u}" for u in added]
    names += [f"removed {u}" for u in removed]
    if spool is not None:
        spool.remove()  # its bytes belong to a listing that no longer exists
    raise ObjectStoreError(
        f"the objects of {listing.where} changed while they were fetched ({len(changed):,} "
        f"rewritten, {len(added):,} added, {len(removed):,} removed: "
        f"{'; '.join(names[:10])}{' ...' if len(names) > 10 else ''}); no store was "
        "published. Build again once the data set is settled: the new listing is fetched anew",
        listing.where,
    )


def fetch(
    listing: Listing,
    base: Path,
    options: BuildOptions,
    on_progress: Callable[..., None] | None,
) -> Spool:
    """Every object of ``listing`` in the spool at ``base`` (resumed if a build left one),
    checked against a second listing; ``options``: the client's ``storage_options``, the
    ``requests_in_flight`` and the progress bar."""
    fs = listing.fs or filesystem(listing.protocol + "://", options.storage_options)
    spool = Spool(
        base,
        listing,
        fs,
        requests=options.requests_in_flight,
        progress=options.progress,
        on_progress=on_progress,
    )
    spool.fetch()
    check_unchanged(listing, spool)
    return spool
