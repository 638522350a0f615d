"""One ordered map over a thread pool, with bounded work in flight.

Every place that maps a function over many items on threads and needs the results in the items'
order (the build's size and read passes, the object listings, the checksums, ``gpucache verify``)
goes through :func:`ordered_map`: items are drawn lazily and at most ``window`` calls are submitted
and not yet consumed, so memory stays bounded for millions of items (no future per item).

A leaf: it imports nothing of gpucache's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import TypeVar

__all__ = ["ordered_map"]

_T = TypeVar("_T")
_R = TypeVar("_R")


def ordered_map(
    fn: Callable[[_T], _R],
    items: Iterable[_T],
    threads: int | Executor,
    *,
    window: int | None = None,
    name: str = "gpucache",
) -> Iterator[_R]:
    """``fn(item)`` for each item, results in the items' order, at most ``window`` in flight.

    ``threads``: a number of threads (a pool named ``name`` is made for this map and shut down
    after it) or an executor to share (then ``window`` is required). ``window`` defaults to twice
    the threads. A call's exception is raised where its result would have been yielded; when the
    caller stops early (an exception, a ``break``), calls not yet started are cancelled."""
    if isinstance(threads, Executor):
        if window is None:
            raise TypeError("ordered_map over a shared executor needs window=")
        yield from _ordered(threads, fn, items, window)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix=name) as pool:
        yield from _ordered(pool, fn, items, window or 2 * threads)


def _ordered(
    pool: Executor, fn: Callable[[_T], _R], items: Iterable[_T], window: int
) -> Iterator[_R]:
    pending: deque[Future[_R]] = deque()
    try:
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= window:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for f in pending:
            f.cancel()
