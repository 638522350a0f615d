"""The columns of a geometric plan, by name (see :mod:`gpucache.transforms`).

A plan is 11 integers a sample: crop1 (top, left, height, width) in the decoded image, the size it
is resized to, crop2 (top, left, height, width) in the resized image, and a flip. Every layer that
reads or writes plans indexes them through :class:`Col` (``plans[:, Col.HEIGHT2]``), never by
bare column numbers.
"""

from __future__ import annotations

from enum import IntEnum


class Col(IntEnum):
    """A plan's columns, in order."""

    TOP1 = 0
    LEFT1 = 1
    HEIGHT1 = 2
    WIDTH1 = 3
    RH = 4
    RW = 5
    TOP2 = 6
    LEFT2 = 7
    HEIGHT2 = 8
    WIDTH2 = 9
    FLIP = 10


#: The columns' names, in order (``gpucache.transforms.PLAN_FIELDS``).
PLAN_FIELDS: tuple[str, ...] = tuple(c.name.lower() for c in Col)
PLAN_WIDTH = len(PLAN_FIELDS)
#: crop1's columns, the resize's, crop2's: slices for ``plan[BOX1]`` and friends
BOX1 = slice(Col.TOP1, Col.WIDTH1 + 1)
AFTER_BOX1 = slice(Col.RH, Col.FLIP + 1)
OUT_SIZE = slice(Col.HEIGHT2, Col.WIDTH2 + 1)
