"""What a decode gives back: one batch (:class:`Decoded`), and the words for a sample that fails.

Every backend returns a :class:`Decoded`; a sample that fails is left out with its reason
(:func:`failure`, which raises instead under ``on_error="raise"``), one that libjpeg warned about
is kept and named (:func:`warned_reason`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .._errors import SampleError
from ..base._plan import Col
from ..store._store import Store


@dataclass
class Decoded:
    """One decoded batch: ``images`` (stacked when every output has one size) for ``indices``."""

    images: torch.Tensor | list[torch.Tensor]
    indices: np.ndarray  # store indices of the images, in batch order
    failed: list[tuple[int, str]] = field(default_factory=list)  # (store index, reason)
    cpu_decoded: int = 0  # samples that took the CPU path (GPU backends' fallback)
    roi_decoded: int = 0  # of those, JPEGs decoded only inside their crop box (see ._roi)
    warned: list[tuple[int, str]] = field(default_factory=list)  # kept, but libjpeg warned
    #: seconds spent on this batch by stage ("read", "decode", "resize", "collate") and by decode
    #: route ("region", "scaled", "full", "fallback"); see gpucache/loader/_stats.py
    times: dict[str, float] = field(default_factory=dict)
    routes: dict[str, int] = field(default_factory=dict)  # images decoded by each route
    busy: float = 0.0  # seconds its producer (a worker, a thread) was busy on it
    worker: int = -1  # the worker that made it (-1: the loader's process)
    #: kept, but decoded without the restart interval the store records (its bytes do not match)
    mismatched: list[tuple[int, str]] = field(default_factory=list)
    #: the batch generator's state after the batch steps run with the decode (``steps=``), for
    #: the steps that follow in the loop's process; None when none ran
    rng_state: bytes | None = None
    #: each kept sample's mask through its plan (``masks=True``): (N, H, W), or a list of (H, W)
    masks: torch.Tensor | list[torch.Tensor] | None = None


def describe(cache: Store, i: int, err: BaseException) -> str:
    return (
        f"sample {i} ({cache.paths[i]}) could not be decoded: {type(err).__name__}: "
        f"{str(err).splitlines()[0] if str(err) else ''}"
    )


def check_size(cache: Store, i: int, img: torch.Tensor) -> torch.Tensor:
    """``img`` if it has the size the header promised (plans were drawn for that size)."""
    expected = (int(cache.samples["height"][i]), int(cache.samples["width"][i]))
    if tuple(img.shape[1:]) != expected:
        raise ValueError(
            f"decoded size {tuple(img.shape[1:])} differs from the header's {expected}"
        )
    return img


#: ``on_error`` values: "skip" and "raise" act on samples that fail to decode; "skip_warned" also
#: leaves out samples whose decode libjpeg warned about (corrupt data it decoded anyway).
ON_ERROR = ("skip", "raise", "skip_warned")


def warned_reason(cache: Store, i: int, warning: str) -> str:
    return f"sample {i} ({cache.paths[i]}) has corrupt JPEG data (decoded anyway): {warning}"


def failure(cache: Store, i: int, err: Exception, on_error: str) -> str:
    """The loader's policy for a sample that failed: raise ``SampleError``, or return the reason."""
    if on_error == "raise":
        raise SampleError(describe(cache, i, err)) from err
    return describe(cache, i, err)


def out_size(plans: np.ndarray) -> tuple[int, int]:
    """Output (height, width) of a fixed-size batch's plans: the shape of an empty batch."""
    return (int(plans[0, Col.HEIGHT2]), int(plans[0, Col.WIDTH2])) if len(plans) else (0, 0)
