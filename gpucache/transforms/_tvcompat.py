"""torchvision transforms inside a gpucache ``transform=``: translated, refused, or flagged.

A torchvision pipeline given to the loader would otherwise run on the decoded batch: its crops
and flips after a full decode, and every random op with one draw for the whole batch. So, before a
``Compose`` sorts its items:

* torchvision ``Compose`` (v1 ``torchvision.transforms`` or v2) is flattened, at any depth;
* the geometric and dtype ops gpucache has are translated into gpucache's own, which draw a plan
  per sample from the loader's seed (so a translated pipeline gives exactly the crops of the same
  pipeline written with ``gpucache.transforms``): ``RandomResizedCrop``, ``Resize``, ``CenterCrop``,
  ``Pad`` (constant, zero fill), ``RandomHorizontalFlip``, ``Normalize``, ``ToDtype`` / ``ConvertImageDtype`` / v1 ``ToTensor``;
  ``ToImage``, ``PILToTensor`` and ``ToPureTensor`` are dropped (batches are tensors already);
* options gpucache cannot reproduce (another interpolation, ``antialias=False``, padding) and
  those ops inside ``RandomApply`` / ``RandomChoice`` / ``RandomOrder`` are a ``TypeError`` with
  the fix;
* any other random torchvision op left to run on a whole batch tensor warns once, naming
  ``PerSample`` (a draw per sample) and ``PerBatch`` (one draw per batch, on purpose).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch

from ._geometric import CenterCrop, Pad, RandomHorizontalFlip, RandomResizedCrop, Resize
from ._pixel import Normalize, ToDtype

_TV = "torchvision.transforms"
_COMPOSE = ("Compose",)
_CONTAINERS = ("RandomApply", "RandomChoice", "RandomOrder")
_DROPPED = ("ToImage", "PILToTensor", "ToPureTensor")
_GEOMETRIC = ("RandomResizedCrop", "Resize", "CenterCrop", "Pad", "RandomHorizontalFlip")
_RANDOM = (
    "ColorJitter",
    "GaussianBlur",
    "GaussianNoise",
    "RandAugment",
    "AutoAugment",
    "TrivialAugmentWide",
    "AugMix",
    "ElasticTransform",
    "ScaleJitter",
    "JPEG",
)


def is_torchvision(t: object) -> bool:
    return type(t).__module__.startswith(_TV)


def _name(t: object) -> str:
    return f"torchvision's {type(t).__name__}"


def _bilinear(t: object, gpucache_call: str) -> None:
    mode = getattr(t, "interpolation", None)
    if mode is not None and getattr(mode, "value", mode) not in ("bilinear", 2):
        raise TypeError(
            f"{_name(t)} with interpolation={mode} cannot be reproduced: gpucache "
            "resizes with antialiased bilinear only; drop interpolation= or use "
            f"gpucache.transforms.{gpucache_call}."
        )
    if getattr(t, "antialias", True) is False:
        raise TypeError(
            f"{_name(t)} with antialias=False cannot be reproduced: gpucache always "
            f"antialiases; drop antialias=False or use gpucache.transforms."
            f"{gpucache_call}."
        )


def _dtype(t: Any) -> torch.dtype | None:
    """The image dtype of a torchvision ``ToDtype`` (None: images are left as they are)."""
    dtype: torch.dtype | dict[object, torch.dtype | None] | None = t.dtype
    if isinstance(dtype, dict):  # v2: {tv_tensors.Image: torch.float32, "others": None}
        from torchvision import tv_tensors

        dtype = next(
            (dtype[k] for k in (tv_tensors.Image, torch.Tensor, "others") if k in dtype), None
        )
    return dtype


def _translate_one(t: Any) -> list[Any]:
    """gpucache's equivalent of one torchvision op: a list of 0 or 1 items, or [t] unchanged."""
    name = type(t).__name__
    if name == "RandomResizedCrop":
        _bilinear(t, "RandomResizedCrop(size, scale=, ratio=)")
        return [RandomResizedCrop(t.size, scale=t.scale, ratio=t.ratio)]
    if name == "Resize":
        _bilinear(t, "Resize(size, max_size=)")
        if t.size is None:
            raise TypeError(
                f"{_name(t)} with size=None (max_size only) has no gpucache "
                "equivalent; give size= or use gpucache.transforms.Resize(size)."
            )
        return [Resize(t.size, max_size=t.max_size)]
    if name == "CenterCrop":
        return [CenterCrop(t.size)]
    if name == "Pad":
        fill, mode = getattr(t, "fill", 0), getattr(t, "padding_mode", "constant")
        if mode != "constant" or not (
            fill is None or (isinstance(fill, int | float) and fill == 0)
        ):
            raise TypeError(
                f"{_name(t)} with padding_mode={mode!r}, fill={fill!r} has no gpucache "
                "equivalent: gpucache pads with constants set on the loader; use "
                "gpucache.transforms.Pad(padding) and GpuCachedLoader(fill=..., mask_fill=...)."
            )
        return [Pad(t.padding)]
    if name == "RandomHorizontalFlip":
        return [RandomHorizontalFlip(t.p)]
    if name == "Normalize":
        return [Normalize(t.mean, t.std)]
    if name == "ToDtype":  # v2; scale defaults to False there
        dtype = _dtype(t)
        return [] if dtype is None else [ToDtype(dtype, scale=bool(t.scale))]
    if name == "ConvertImageDtype":
        return [ToDtype(t.dtype, scale=True)]
    if name == "ToTensor":  # v1: uint8 HWC -> float CHW in [0, 1]; batches are CHW already
        return [ToDtype(torch.float32, scale=True)]
    if name in _DROPPED:
        return []
    return [t]


def _geometric_inside(t: object) -> Any:
    """A torchvision geometric op nested anywhere in ``t`` (a container), or None."""
    for inner in getattr(t, "transforms", None) or []:
        if is_torchvision(inner) and type(inner).__name__ in _GEOMETRIC:
            return inner
        found = _geometric_inside(inner) if is_torchvision(inner) else None
        if found is not None:
            return found
    return None


def translate(items: Iterable[Any]) -> list[Any]:
    """Flatten torchvision Compose and translate its ops (see the module docstring)."""
    out = []
    for t in items:
        if not is_torchvision(t):
            out.append(t)
            continue
        name = type(t).__name__
        if name in _COMPOSE:
            out += translate(t.transforms)
            continue
        if name in _CONTAINERS:
            inner = _geometric_inside(t)
            if inner is not None:
                raise TypeError(
                    f"{_name(t)} holds {_name(inner)}, a per-sample geometric op that would run "
                    "once per batch after decoding; use gpucache.transforms."
                    f"{type(inner).__name__} outside it, or wrap the whole {type(t).__name__} in "
                    "gpucache.transforms.PerSample(...) to run it on each decoded image."
                )
        out += _translate_one(t)
    return out


def is_random(t: object) -> bool:
    """True for a torchvision op that draws random parameters when called."""
    if not is_torchvision(t):
        return False
    name = type(t).__name__
    if name.startswith("Random") or name in _RANDOM:
        return True
    from torchvision.transforms import v2

    if isinstance(t, v2.Transform):
        return any(
            getattr(type(t), m, None) is not getattr(v2.Transform, m, None)
            for m in ("make_params", "_get_params")
            if hasattr(v2.Transform, m)
        )
    return hasattr(type(t), "get_params")


def warn_batch_draws(steps: Iterable[tuple[str, object]]) -> None:
    """Warn about each random torchvision op that will run on a whole batch tensor."""
    for kind, t in steps:
        if kind == "pixel" and is_random(t):
            name = type(t).__name__
            own = (
                "; gpucache.transforms.ColorJitter(brightness, contrast, saturation) draws per "
                "sample without it"
                if name == "ColorJitter"
                else ""
            )
            warnings.warn(
                f"torchvision's {name} runs on the whole batch here and draws its random "
                f"parameters once per batch, not per sample; wrap it as gpucache.transforms."
                f"PerSample({name}(...)) for a draw per sample, or PerBatch({name}(...)) to keep "
                f"one draw per batch and silence this warning{own}.",
                UserWarning,
                stacklevel=4,
            )
