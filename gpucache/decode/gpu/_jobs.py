"""The nvjpeg backend's batches in flight: each one's split, its stages' futures (or results,
when the stages run inline), and the stop of the stages' thread pools."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import torch

from .._outcome import Decoded
from ._fallback import Part, Result
from ._mask_stage import PendingMasks
from ._streams import Ready


@dataclass
class Done:
    decoded: Decoded
    event: torch.cuda.Event | None  # the side stream's event after the batch (None without streams)


#: One chunk of a batch's CPU stage: its results and the seconds it took.
Chunk = tuple[list[Result], float]


#: The decode stage's outputs (or why each failed) and what marks them written.
Outputs = tuple[list[torch.Tensor | Exception], Ready]


#: A stage's future: a CPU chunk's, the decode's, the transform's, a mask chunk's.
Stage = Future[Chunk] | Future[Outputs] | Future[Done] | Future[None]


_T = TypeVar("_T")


@dataclass
class Batch:
    """One submitted batch as :func:`._fallback.split` and the CPU-stage rule divided it."""

    indices: np.ndarray
    plans: np.ndarray
    stack: bool
    gpu_pos: np.ndarray  # positions the batched decoder takes
    cpu_pos: np.ndarray  # positions the CPU stage decodes
    refused: Part  # positions over the pixel budget: never decoded
    took: dict[str, float] = field(default_factory=dict)  # each stage's seconds, its own keys


@dataclass
class Job:
    """One submitted batch: its three stages' futures (or results, unthreaded)."""

    cpu: list[Future[Chunk]] | list[Chunk]  # per chunk: results, seconds
    gpu: Future[Outputs] | Outputs | None  # None in a job whose submit failed
    done: Future[Done] | Done
    masks: PendingMasks | None = None  # the batch's masks, decoded on the CPU stage's threads

    def futures(self) -> list[Stage]:
        masks = self.masks.futures if self.masks is not None else []
        return [f for f in (self.done, self.gpu, *self.cpu, *masks) if isinstance(f, Future)]


def stage_result(x: Future[_T] | _T) -> _T:
    """A stage's result: its future's (threaded), or the result itself (run inline)."""
    if isinstance(x, Future):
        done: _T = x.result()
        return done
    return x


def stop_pools(pools: list[ThreadPoolExecutor], *, wait: bool) -> None:
    for pool in pools:  # the transform stage waits on the others: cancel its queue first
        pool.shutdown(wait=False, cancel_futures=True)
    if wait:
        for pool in pools:
            pool.shutdown(wait=True)
