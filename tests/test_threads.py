"""The one ordered thread map: results in order, bounded work in flight, errors in place."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from gpucache.base._threads import ordered_map


def test_results_come_in_order_with_at_most_a_window_in_flight():
    drawn = [0]

    def items():
        for i in range(1000):
            drawn[0] += 1
            yield i

    for k, r in enumerate(ordered_map(lambda i: i * i, items(), 3)):
        assert r == k * k
        assert drawn[0] - (k + 1) <= 6 - 1  # twice the threads, one of them just consumed
    assert drawn[0] == 1000


def test_a_calls_error_is_raised_at_its_place():
    def fn(i: int) -> int:
        if i == 5:
            raise KeyError(i)
        return i

    got = []
    with pytest.raises(KeyError):
        for r in ordered_map(fn, range(100), 2):
            got.append(r)
    assert got == [0, 1, 2, 3, 4]


def test_stopping_early_cancels_what_did_not_start():
    gate, calls = threading.Event(), []

    def fn(i: int) -> int:
        calls.append(i)
        if i:
            gate.wait(30)  # a deadline; set below as soon as the map is closed
        return i

    with ThreadPoolExecutor(1) as pool:
        it = ordered_map(fn, range(100), pool, window=4)
        assert next(it) == 0
        it.close()
        gate.set()
    assert calls[0] == 0 and set(calls) <= {0, 1}


def test_a_shared_executor_needs_a_window():
    with ThreadPoolExecutor(1) as pool, pytest.raises(TypeError, match="window"):
        next(ordered_map(abs, [1], pool))
