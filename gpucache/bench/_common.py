"""What every part of the bench shares: the run's settings, its data, its one error type, output."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tqdm.auto import tqdm

CROP = 224
#: ImageNet's per-channel mean and std: the Normalize of the README's pipeline (``--normalize``)
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@dataclass
class Config:
    pipeline: str = "train"
    normalize: bool = False  # end in Normalize: float32 batches (``--normalize``)
    workers: int = 2
    batch_size: int = 64
    epochs: int = 3
    seed: int = 0
    decoded: int = 256  # the decoded tier's side of ``cpu-decoded-fork`` (``--decoded S``)


@dataclass
class Source:
    """The images every contender reads: ImageFolder order (path, label) pairs and their store."""

    root: str
    samples: list[tuple[str, int]]
    classes: list[str]
    store: str | None = None  # a saved store of exactly these samples (file-backed contenders)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(os.path.getsize(p) for p, _ in self.samples)


def say(msg: str) -> None:
    """A status line on stderr (the tables go to stdout)."""
    print(msg, file=sys.stderr, flush=True)


def progress(total: int, desc: str) -> tqdm | None:
    """A tqdm bar on a terminal; None (plain status lines instead) otherwise."""
    if not sys.stderr.isatty():
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="epoch", leave=False, file=sys.stderr)
