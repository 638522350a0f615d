"""A sequence made on access: the build's inputs, masks and names over a listing are never lists."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar, overload

T = TypeVar("T", covariant=True)

__all__ = ["OnAccess"]


class OnAccess(Sequence[T]):
    """A sequence whose items are made when indexed: a subclass gives ``__len__`` and
    ``item(i)`` for ``0 <= i < len(self)``; negative indices, the range check (an
    :class:`IndexError`, which also ends iteration) and slices (a list) are handled here."""

    def item(self, i: int) -> T:
        raise NotImplementedError

    @overload
    def __getitem__(self, i: int) -> T: ...
    @overload
    def __getitem__(self, i: slice) -> list[T]: ...
    def __getitem__(self, i: int | slice) -> T | list[T]:
        n = len(self)
        if isinstance(i, slice):
            return [self.item(k) for k in range(*i.indices(n))]
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(i)
        return self.item(i)
