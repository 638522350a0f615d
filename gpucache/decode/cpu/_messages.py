"""What the CPU worker pool and its workers send each other (the protocol: ``_pool.py``).

Every message is an 8-byte little-endian length (:data:`LEN`), then a pickle (:func:`frame`):
from the pool a :class:`Task`, from a worker a :class:`Message`, whose ``kind`` says which of its
fields it carries; a result's raw buffers (or its memory file's descriptor) follow its header.
"""

from __future__ import annotations

import pickle
import struct
from typing import Literal, NamedTuple, TypedDict

import numpy as np

LEN = struct.Struct("<Q")  # every message: 8-byte little-endian length, then a pickle


class Task(NamedTuple):
    """One batch for a worker, as the pool sends it (pickled in one frame)."""

    number: int  # the pool's count of tasks sent, which its result carries back
    indices: np.ndarray
    plans: np.ndarray
    stack: bool
    key: tuple[int, ...]  # the batch's (seed, epoch, batch[, rank]): its steps' generator


class MaskLayout(TypedDict):
    """How a result's masks lie in their one buffer, sent after everything else."""

    stacked: bool
    shapes: list[tuple[int, ...]]
    dtype: str  # torch's name, without "torch."
    nbytes: int


class Message(TypedDict, total=False):
    """A worker's message. ``ready``: started; ``init_error``: its start (or
    ``worker_init_fn``) failed; ``error``: a task failed (``memory``: it ran out of memory, then
    no traceback); ``result``: a decoded batch's header, its bytes after it."""

    kind: Literal["ready", "init_error", "error", "result"]
    task: int | None  # the task's number (None: an error the worker cannot tie to a task)
    # init_error and error
    error: str  # "Type: message"
    where: str  # what the worker was doing
    memory: bool
    traceback: str
    sample_error: bool  # a SampleError (on_error="raise"): raised as it is in the loop
    # result
    stacked: bool
    shapes: list[tuple[int, ...]]  # one shape (stacked) or one an image
    indices: np.ndarray
    failed: list[tuple[int, str]]
    warned: list[tuple[int, str]]
    mismatched: list[tuple[int, str]]
    times: dict[str, float]
    routes: dict[str, int]
    busy: float
    nbytes: int  # of the images' buffer (or memory file)
    dtype: str  # torch's name of the images' dtype, without "torch."
    rng_state: bytes | None
    fd: bool  # the images' bytes follow as a memory file's descriptor
    masks: MaskLayout | None  # their bytes follow everything else (None: no masks)


def frame(obj: Task | Message) -> bytes:
    """``obj`` as it goes on the socket: its length, then its pickle."""
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return LEN.pack(len(payload)) + payload
