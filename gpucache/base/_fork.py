"""Finalizers that act only in the process that made them.

A forked child inherits every object of its parent, ``weakref.finalize`` entries included. When
the child lets go of one (a ``gc.collect()`` in a ``worker_init_fn``, a reference count reaching
zero, its own exit through ``sys.exit``), the callback would run there: a loader's finalizer
would shut down the parent's sockets and signal the parent's worker processes, a store's would
unlink the parent's shared-memory name. :func:`finalize_here` registers a callback that runs in
the registering process only and does nothing in any child.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any


def finalize_here(obj: object, fn: Callable[..., object], *args: Any) -> weakref.finalize[Any, Any]:
    """``weakref.finalize(obj, fn, *args)``, except that ``fn`` runs only in this process."""
    return weakref.finalize(obj, _in, os.getpid(), fn, *args)


def _in(pid: int, fn: Callable[..., object], *args: Any) -> None:
    if os.getpid() == pid:
        fn(*args)
