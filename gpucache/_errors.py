"""The base of the errors gpucache raises for reasons of its own."""

from __future__ import annotations


class GpucacheError(Exception):
    """Base of gpucache's own errors (``BuildError``, ``CacheFormatError``, ``SharedMemoryError``,
    ``SampleError``, ``WorkerError``; the out-of-memory error it raises with a fix too).

    Each is also the built-in type it always was (``ValueError``, ``RuntimeError``,
    ``MemoryError``), so ``except ValueError`` keeps catching a ``BuildError``; ``except
    GpucacheError`` catches all of them and nothing else."""
