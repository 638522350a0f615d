"""The stage timings every backend reports (``Decoded.times``; gpucache/loader/_stats.py sums
them): the clock they read, the profiler ranges they open, the decode routes they name."""

from __future__ import annotations

import contextlib
import os
import time

import numpy as np
import torch

#: Per-stage timings on (``GPUCACHE_TIMINGS=0`` in the environment turns them off, in the
#: workers too, which inherit it; ``benchmarks/stats_overhead.py`` measures what they cost).
TIMED = os.environ.get("GPUCACHE_TIMINGS", "1") != "0"


def _no_clock() -> float:
    return 0.0


#: the clock every stage timing reads: ``time.perf_counter``, or 0 with the timings off
stage_clock = time.perf_counter if TIMED else _no_clock


def stage_range(name: str, profiled: bool) -> contextlib.AbstractContextManager[object]:
    """A ``torch.profiler`` range named ``name`` while a profiler runs (its trace then shows the
    stage), nothing otherwise; ``profiled`` is ``torch.autograd._profiler_enabled()``."""
    return torch.profiler.record_function(name) if profiled else contextlib.nullcontext()


#: decode routes, as ``Decoded.times`` and ``.routes`` name them: only the crop box decoded,
#: decoded at a reduced DCT scale, the whole image decoded, another format (PIL) or a GPU
#: backend's CPU fallback
ROUTES = ("region", "scaled", "full", "fallback")


def touch_pages(view: np.ndarray) -> None:
    """Read one byte of every page of ``view``: a page not in memory is read in here."""
    if len(view):
        np.bitwise_or.reduce(view[::4096])
