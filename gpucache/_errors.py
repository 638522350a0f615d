"""Every exception gpucache raises to its users, in one place.

Each public error derives from :class:`GpucacheError` and from the built-in type it has always been
(``ValueError``, ``RuntimeError``, ``OSError``, ``MemoryError``), so ``except ValueError`` keeps
catching a ``BuildError``; ``except GpucacheError`` catches all of them and nothing else.

One rule for their names: the errors ``gpucache.__all__`` lists present themselves by their public
name (``__module__ = "gpucache"``: a traceback says ``gpucache.BuildError``, the name users import
and catch, and pickle finds them there); the others (:class:`OutOfMemory`, :class:`BenchError`)
keep this module's name. Exceptions a module raises and catches inside itself (a sniff's reason, a
decoder refusing a scale) stay beside the code that uses them; none of them reaches a user.

A leaf: it imports nothing of gpucache's. What an error carries is duck-typed (``BuildError``'s
report is any object with ``total``, ``kept``, ``skipped`` and a ``str``); the helpers that decide
when to raise one stay with the code that raises it (``store/_oom.py`` for :class:`OutOfMemory`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = [
    "GpucacheError",
    "BuildError",
    "CacheFormatError",
    "ObjectStoreError",
    "SharedMemoryError",
    "ShareError",
    "SampleError",
    "WorkerError",
    "OutOfMemory",
    "BenchError",
    "said",
]


class GpucacheError(Exception):
    """Base of gpucache's own errors (``BuildError``, ``CacheFormatError``, ``ObjectStoreError``,
    ``SharedMemoryError``, ``SampleError``, ``WorkerError``; the out-of-memory error it raises
    with a fix too).

    Each is also the built-in type it always was (``ValueError``, ``RuntimeError``, ``OSError``,
    ``MemoryError``), so ``except ValueError`` keeps catching a ``BuildError``; ``except
    GpucacheError`` catches all of them and nothing else."""

    __module__ = "gpucache"


class _Report(Protocol):
    """What :class:`BuildError` reads of a build report (``gpucache.BuildReport``)."""

    @property
    def total(self) -> int: ...
    @property
    def kept(self) -> int: ...
    @property
    def skipped(self) -> Sequence[object]: ...


class BuildError(GpucacheError, ValueError):
    """Raised by ``on_error="raise"``, and by any build that would keep no sample; ``.report``
    lists every bad file with its reason. ``skip``: how the caller spells the option that leaves
    bad files out (the command line's ``--on-error skip``)."""

    __module__ = "gpucache"

    def __init__(self, report: _Report, skip: str = "on_error='skip'"):
        self.report = report
        if report.total == 0:
            msg = (
                "nothing to build: no input was given (an empty file list, or shards without "
                "an image member); a store needs at least one image"
            )
        elif report.kept == 0:
            msg = (
                f"none of the {report.total} files can be used, so the store would be empty "
                "(a training loop over it would run zero steps); the reasons are below: fix "
                "the inputs or point at the right files"
            )
        else:
            msg = (
                f"{len(report.skipped)} of {report.total} files cannot be used (pass "
                f"{skip} to leave them out)"
            )
        super().__init__(f"{msg}:\n{report}" if report.total else msg)


class CacheFormatError(GpucacheError, ValueError):
    """A file is not a valid gpucache store (bad magic, version, sizes, bounds or checksum)."""

    __module__ = "gpucache"


class ObjectStoreError(GpucacheError, OSError):
    """Objects in storage cannot be used as listed: a bucket that does not exist or denies
    access, a listing that fails after its retries, or objects that changed while a build
    fetched them. ``url`` names the bucket or prefix (never a credential)."""

    __module__ = "gpucache"

    def __init__(self, message: str, url: str = "") -> None:
        super().__init__(message)
        self.url = url

    def __str__(self) -> str:
        return str(self.args[0])


class ShareError(GpucacheError, RuntimeError):
    """A node's share (``shard="node"``) cannot be built or played as asked: it does not fit
    where the store must live (checked before any byte is read or fetched, with the numbers and
    the fix), or the job's ranks hold shares of different listings or layouts."""

    __module__ = "gpucache"


class SharedMemoryError(GpucacheError, RuntimeError):
    """Not enough room (or no permission) to place a store in shared memory."""

    __module__ = "gpucache"


class SampleError(GpucacheError, RuntimeError):
    """A sample could not be decoded; names the index, the file and the reason."""

    __module__ = "gpucache"


class WorkerError(GpucacheError, RuntimeError):
    """A worker raised, ran out of memory, died or hung; the message names the worker, its pid,
    the samples and the cause (for out of memory, the fix)."""

    __module__ = "gpucache"


def said(err: BaseException) -> str:
    """``Type: first line`` of what the allocator said (torch's messages run to a backtrace)."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


class OutOfMemory(GpucacheError, MemoryError):
    """A ``MemoryError`` that says what ran out (``what``), what the allocator said
    (``detail``) and the fix; raised ``from`` the allocator's error (``store/_oom.py``)."""

    def __init__(self, what: str, err: BaseException, *, fix: str) -> None:
        self.what, self.detail = what, said(err)
        super().__init__(
            f"gpucache: out of memory {what} ({self.detail}). This is not a bad "
            f"sample: the process has too little memory for the work it was given. "
            f"Fix: {fix}."
        )

    def __reduce__(
        self,
    ) -> tuple[
        type[MemoryError], tuple[object, ...]
    ]:  # pickled (multiprocessing) as the MemoryError it is, message kept
        return MemoryError, self.args


class BenchError(RuntimeError):
    """A benchmark check failed (``gpucache bench``): what was timed is not what it should be."""
