"""A sample's geometric plan run on its decoded image: crop, antialiased bilinear resize, crop
(padded with the fill), flip. Device-agnostic: the cpu backend runs it on CPU tensors (uint8 in,
uint8 out), the GPU backends on the device (the same filter in float, rounded back)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..base._plan import AFTER_BOX1, BOX1


def apply_plan(img: torch.Tensor, plan: Sequence[int], fill: int = 0) -> torch.Tensor:
    """Run one sample's plan (see :mod:`gpucache.transforms`) on a decoded CHW uint8 image,
    ``fill`` where it pads.

    Device-agnostic: the GPU backends run this same function on CUDA tensors."""
    t1, l1, h1, w1 = (int(v) for v in plan[BOX1])
    return finish_plan(img[:, t1 : t1 + h1, l1 : l1 + w1], plan, fill)


def finish_plan(x: torch.Tensor, plan: Sequence[int], fill: int = 0) -> torch.Tensor:
    """The rest of ``plan`` (a plan row) after its first crop, ``x``: resize to (rh, rw), crop
    (padded with ``fill`` where the crop leaves the image), flip."""
    rh, rw, t2, l2, h2, w2, flip = (int(v) for v in plan[AFTER_BOX1])
    h1, w1 = x.shape[-2:]
    if (rh, rw) != (h1, w1):
        if x.device.type == "cpu":  # uint8 in, uint8 out: torch's vectorized CPU kernel
            x = F.interpolate(x[None], size=(rh, rw), mode="bilinear", antialias=True)[0]
        else:  # the same filter in float on other devices, rounded back to uint8
            x = (
                F.interpolate(x[None].float(), size=(rh, rw), mode="bilinear", antialias=True)[0]
                .round_()
                .clamp_(0, 255)
                .to(torch.uint8)
            )
    if (t2, l2, h2, w2) != (0, 0, rh, rw):
        if t2 < 0 or l2 < 0 or t2 + h2 > rh or l2 + w2 > rw:  # crop larger than image: zero pad
            pads = (max(0, -l2), max(0, l2 + w2 - rw), max(0, -t2), max(0, t2 + h2 - rh))
            x = F.pad(x, pads, value=fill)
            t2, l2 = max(t2, 0), max(l2, 0)
        x = x[:, t2 : t2 + h2, l2 : l2 + w2]
    if flip:
        x = x.flip(-1)
    return x


def no_autocast(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Autocast off on ``device``'s type and the CPU's: the batched resize's float matrix
    products (and :func:`finish_plan`'s float filter) keep float32 inside a caller's
    ``torch.autocast`` region, which would otherwise run them in bfloat16 or float16 and move
    pixels by a level or two. Autocast is per thread: the GPU backends' own threads never see it,
    a synchronous backend runs on the caller's."""
    stack = contextlib.ExitStack()
    for kind in dict.fromkeys((device.type, "cpu")):
        if torch.amp.is_autocast_available(kind):  # not for "meta", say
            stack.enter_context(torch.autocast(kind, enabled=False))
    return stack
