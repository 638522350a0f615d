"""Running a Compose's batch steps on a batch (images and labels, or masks), and which of the
first ones may run where a sample was decoded (per sample, or per pixel straight into the
batch's output)."""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from ._generator import seeded_global_rng
from ._pixel import ColorJitter, Normalize, PerSample, ToDtype
from ._transform import Transform

#: A batch's labels through Compose.apply: a tensor from the loader, None from a plain call.
_Labels = TypeVar("_Labels", torch.Tensor, None)


def _run(
    t: Callable[..., Any],
    x: torch.Tensor | list[torch.Tensor],
    generator: torch.Generator | None,
) -> torch.Tensor | list[torch.Tensor]:
    """One pixel step on a batch tensor, or on each image of a list (variable sizes)."""
    if isinstance(t, Transform):
        return t(x) if isinstance(x, torch.Tensor) else [t(i[None])[0] for i in x]
    if getattr(t, "random", False):  # gpucache's seeded ops take the generator
        return (
            t(x, generator=generator)
            if isinstance(x, torch.Tensor) or isinstance(t, PerSample)
            else [t(i[None], generator=generator)[0] for i in x]
        )
    device = x.device if isinstance(x, torch.Tensor) else x[0].device
    with seeded_global_rng(generator, device):  # foreign callables draw from torch's global RNG
        return t(x) if isinstance(x, torch.Tensor) else [t(i) for i in x]


def apply_steps(
    steps: Sequence[tuple[str, Any]],
    images: torch.Tensor | list[torch.Tensor],
    labels: _Labels,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor | list[torch.Tensor], _Labels]:
    """Run ``steps`` (``Compose.steps``: (kind, step) pairs) on a batch, drawing from
    ``generator``; ``(images, labels)`` in, ``(images, labels)`` out."""
    for kind, t in steps:
        if kind == "pixel":
            images = _run(t, images, generator)
            continue
        if kind == "masks":  # run on the masks by apply_mask_steps
            continue
        if not isinstance(images, torch.Tensor):
            raise ValueError(
                f"{t!r} mixes samples, which needs one fixed-size batch tensor; "
                "add RandomResizedCrop/CenterCrop/Resize((h, w)) before it."
            )
        if getattr(t, "random", False):
            images, labels = t(images, labels, generator=generator)
        else:
            with seeded_global_rng(generator, images.device):
                images, labels = t(images, labels)
    return images, labels


def apply_mask_steps(
    steps: Sequence[tuple[str, Any]], masks: torch.Tensor | list[torch.Tensor]
) -> torch.Tensor | list[torch.Tensor]:
    """Run the mask steps of ``steps`` (``Compose.steps``) on a batch's masks, in order."""
    for kind, t in steps:
        if kind == "masks":
            masks = t(masks) if isinstance(masks, torch.Tensor) else [t(m) for m in masks]
    return masks


def _per_sample(t: object) -> bool:
    """Whether batch step ``t`` acts on each sample alone and can be sent to a worker process:
    gpucache's ToDtype and Normalize (not into channels-last memory, which a batch sent as one
    buffer would not keep), ColorJitter (its draws are per sample, from the batch's generator)
    and PerSample (a picklable transform on each image)."""
    if isinstance(t, (ToDtype, Normalize)):
        return t.layout != "channels_last"
    if not isinstance(t, (ColorJitter, PerSample)):
        return False
    try:
        pickle.dumps(t)
    except Exception:  # noqa: BLE001 - a lambda, a local function: it stays in the loop's process
        return False
    return True


def per_sample_prefix(steps: Sequence[object]) -> int:
    """The number of leading ``steps`` that act on each sample alone (and pickle): they may run
    in the worker that decoded the batch, on the same generator, with the same result; the
    steps after the first other one (MixUp, CutMix, any callable) stay in the loop's process."""
    n = 0
    while n < len(steps) and _per_sample(steps[n]):
        n += 1
    return n


def elementwise_prefix(steps: Sequence[object]) -> int:
    """The number of leading ``steps`` that map each pixel alone (ToDtype, Normalize into
    NCHW): they can run on each sample as soon as it is resized, straight into the batch's
    output (one pass to float), with the same result as on the batch."""
    n = 0
    while n < len(steps) and isinstance(steps[n], (ToDtype, Normalize)):
        if getattr(steps[n], "layout", "NCHW") != "NCHW":
            break
        n += 1
    return n


def elementwise_into(steps: Sequence[Any], x: torch.Tensor, out: torch.Tensor) -> None:
    """Run ``steps`` (an :func:`elementwise_prefix`) on one sample ``x`` (1, C, H, W) into
    ``out`` (1, C, H, W, of the steps' output dtype): a float32 Normalize at the end writes there
    directly, the same values as on the batch."""
    for t in steps[:-1]:
        x = t(x)
    last = steps[-1]
    if isinstance(last, Normalize) and last.dtype == torch.float32 and last.layout == "NCHW":
        last._into(x, out)
    else:
        out.copy_(last(x))
