"""The base classes: a transform is geometric (it adds to each sample's plan) or a batch step."""

from __future__ import annotations

import numpy as np


class Transform:
    """Base class. Geometric ones implement ``plan``; pixel ones implement ``__call__``."""

    geometric = False

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


class Geometric(Transform):
    geometric = True

    def plan(self, p: np.ndarray, rng: np.random.Generator) -> None:
        """Update the plans ``p`` (n x 11, in place) for samples whose current size is their
        (height2, width2)."""
        raise NotImplementedError
