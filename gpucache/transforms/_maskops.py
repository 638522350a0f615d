"""Batch steps on masks: a value lookup (Cityscapes ``labelIds`` -> ``trainIds``, say)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ._device import DeviceConstants


class MapMaskValues:
    """Map every mask value through ``table`` on the masks' device, in a constant number of ops.

    ``table`` is a mapping ``{value: new value}`` or a sequence (``table[v]`` is value ``v``'s new
    value); a value the table does not name becomes ``default`` (255, the usual ignore index).
    The images are left alone. The masks keep their dtype when every new value fits in it
    (uint8: 0-255), else they come out int32. Runs as a batch step after the geometric ones::

        T.MapMaskValues({7: 0, 8: 1, 11: 2, ...})  # Cityscapes labelIds -> trainIds
    """

    geometric = False
    on_masks = True  # a step on the masks, not the images (``transforms._kind``)

    def __init__(self, table: Mapping[int, int] | Sequence[int], *, default: int = 255):
        pairs = dict(table) if isinstance(table, Mapping) else dict(enumerate(table))
        if any(int(k) < 0 for k in pairs):
            raise ValueError(f"mask values are >= 0; the table names {min(pairs)}")
        self.table = {int(k): int(v) for k, v in pairs.items()}
        self.default = int(default)
        self._size = max(256, max(self.table, default=0) + 1)
        values = [*self.table.values(), self.default]
        self._fits_uint8 = 0 <= min(values) and max(values) <= 255
        self._constants = DeviceConstants()

    def _lut(self, dtype: torch.dtype) -> torch.Tensor:
        lut = torch.full((self._size,), self.default, dtype=dtype)
        for k, v in self.table.items():
            lut[k] = v
        return lut

    def __call__(self, masks: torch.Tensor) -> torch.Tensor:
        dtype = masks.dtype if masks.dtype == torch.uint8 and self._fits_uint8 else torch.int32
        lut = self._constants.get(masks.device, dtype, lambda: self._lut(dtype))
        idx = masks.long()
        out = lut[idx.clamp(0, self._size - 1)]
        if masks.dtype != torch.uint8:  # values past the table (or negative): the default
            out = torch.where((idx >= 0) & (idx < self._size), out, lut.new_full((), self.default))
        return out

    def __repr__(self) -> str:
        return f"MapMaskValues({len(self.table)} values, default={self.default})"
