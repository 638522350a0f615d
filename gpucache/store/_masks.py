"""Segmentation masks in the store: one 2-D label image per sample, stored encoded, once.

Three named optional sections of the store file (docs/reference/format.md), present together:
- ``masks``: uint8, every sample's mask bytes end to end (PNG, as on disk or re-encoded
  losslessly from another lossless format at build);
- ``masks.offsets``: int64 (N + 1), sample ``i``'s bytes are ``masks[offsets[i]:offsets[i+1]]``;
- ``masks.info``: uint32 (N, 3), per sample the mask's kind (:class:`MaskKind`), height, width.

A mask is in the displayed orientation of its image: its height and width are the image's after
EXIF orientation (the ``samples`` record's), which the build checks and an open checks again, so
the loader can plan a batch's masks without decoding one. Like the image data the mask bytes are
views of the store's read-only memory (a mapped file or shared memory), so they are shared by
every worker under fork, spawn and forkserver and a store still pickles as O(1) bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import IntEnum

import numpy as np
import torch

from ._readonly import tensor_over

DATA, OFFSETS, INFO = "masks", "masks.offsets", "masks.info"
SECTIONS = (DATA, OFFSETS, INFO)


class MaskKind(IntEnum):
    """What a stored mask holds per pixel (stored as the first column of ``masks.info``)."""

    L = 1  # 8-bit values (a PNG of mode "L")
    P = 2  # 8-bit palette indices (a PNG of mode "P": the index, never the palette colour)
    I16 = 3  # 16-bit values (a PNG of mode "I;16")

    @property
    def dtype(self) -> np.dtype:
        """The numpy type of the decoded values: uint8, or uint16 for :attr:`I16`."""
        return np.dtype(np.uint16 if self is MaskKind.I16 else np.uint8)


_KINDS = np.array([int(k) for k in MaskKind], dtype=np.uint32)


class Masks:
    """The masks of a store (``cache.masks``), read-only: ``masks[i]`` is sample ``i``'s encoded
    mask bytes (a read-only uint8 view, zero copy); ``kinds``, ``heights`` and ``widths`` are
    per-sample arrays (read-only views), known without decoding."""

    def __init__(
        self,
        data: np.ndarray,
        offsets: np.ndarray,
        info: np.ndarray,
        check: Callable[[], None] = lambda: None,
    ) -> None:
        self._data, self._offsets, self._info, self._check = data, offsets, info, check
        self._tensor: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self._info)

    def __getitem__(self, i: int) -> np.ndarray:
        i = range(len(self))[i]  # negative indices and a clear IndexError
        self._check()
        return self._data[self._offsets[i] : self._offsets[i + 1]]

    def kind(self, i: int) -> MaskKind:
        """Sample ``i``'s mask kind."""
        return MaskKind(int(self._info[range(len(self))[i], 0]))

    @property
    def kinds(self) -> np.ndarray:
        """Each sample's :class:`MaskKind` value (uint32, read-only)."""
        return self._info[:, 0]

    @property
    def heights(self) -> np.ndarray:
        """Each mask's height (uint32, read-only): its image's height after EXIF orientation."""
        return self._info[:, 1]

    @property
    def widths(self) -> np.ndarray:
        """Each mask's width (uint32, read-only): its image's width after EXIF orientation."""
        return self._info[:, 2]

    @property
    def nbytes(self) -> int:
        """Bytes of encoded mask data held."""
        return int(self._data.nbytes)

    def counts(self) -> dict[str, int]:
        """How many masks of each kind: ``{"L": 120, "P": 3}`` (kinds present only)."""
        got = np.bincount(self.kinds, minlength=max(MaskKind) + 1)
        return {MaskKind(v).name: int(c) for v, c in enumerate(got) if c}

    def _bytes_tensor(self, i: int) -> torch.Tensor:
        """Sample ``i``'s mask bytes as a uint8 tensor over the store's memory, for decoders
        (private: torch ignores numpy's read-only flag; see ``Store._bytes_tensor``)."""
        if self._tensor is None:
            self._tensor = tensor_over(self._data)
        self._check()
        return self._tensor[int(self._offsets[i]) : int(self._offsets[i + 1])]

    def __repr__(self) -> str:
        kinds = ", ".join(f"{c:,} {k}" for k, c in self.counts().items())
        return f"<{len(self):,} masks ({kinds}), {self.nbytes / 2**20:,.1f} MiB>"


def problem(sections: Mapping[str, np.ndarray], samples: np.ndarray | None) -> str | None:
    """What is wrong with the values of a store's mask sections (their types and shapes are
    checked by ``_sections``), or None. ``samples``: the store's per-sample records, whose
    height and width each mask must have (None: not compared). Vectorised, O(N)."""
    data, offsets, info = (sections.get(k) for k in SECTIONS)
    if data is None or offsets is None or info is None:
        return None
    step = offsets[1:] - offsets[:-1]
    down = np.flatnonzero(step <= 0)
    if offsets[0] != 0 or offsets[-1] != len(data) or down.size:
        where = (
            f"; sample {int(down[0])}'s mask spans [{int(offsets[down[0]])}, "
            f"{int(offsets[down[0] + 1])})"
            if down.size
            else ""
        )
        return (
            f"section {OFFSETS!r} must start at 0, increase with every sample (each mask "
            f"has bytes) and end at the {len(data)} bytes of {DATA!r}; it goes from "
            f"{int(offsets[0])} to {int(offsets[-1])}{where}"
        )
    bad = ~np.isin(info[:, 0], _KINDS) | (info[:, 1] == 0) | (info[:, 2] == 0)
    if samples is not None and len(samples) == len(info):
        bad |= (info[:, 1] != samples["height"]) | (info[:, 2] != samples["width"])
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        size = (
            "" if samples is None else f" (its image: {samples['height'][i]}x{samples['width'][i]})"
        )
        return (
            f"section {INFO!r} holds an invalid record for {int(bad.sum())} samples, first "
            f"sample {i}: kind {int(info[i, 0])}, {int(info[i, 1])}x{int(info[i, 2])}{size}; "
            f"a mask has kind {', '.join(f'{int(k)} ({k.name})' for k in MaskKind)} and its "
            "image's height and width after EXIF orientation"
        )
    return None


def masks_of(
    extra: Mapping[str, np.ndarray], check: Callable[[], None] = lambda: None
) -> Masks | None:
    """The :class:`Masks` view of a store's optional sections, or None without masks."""
    data, offsets, info = (extra.get(k) for k in SECTIONS)
    if data is None or offsets is None or info is None:
        return None
    return Masks(data, offsets, info, check)
