"""The cases of a test that this run selected, for module fixtures that start the processes of
all of a test's cases at once (one interpreter instead of one a case): after ``-m`` and ``-k``,
a fixture starts the processes of the selected cases only, so a case marked ``slow`` costs the
default run nothing."""

from __future__ import annotations

import pytest


def selected(request: pytest.FixtureRequest, test: str, *names: str) -> list[tuple]:
    """The parameters ``names`` of every selected case of the test function ``test``, sorted;
    ``[()]`` for an unparametrized test that is selected, ``[]`` for one that is not."""
    return sorted(
        {
            tuple(item.callspec.params[n] for n in names) if names else ()
            for item in request.session.items
            if getattr(item, "originalname", None) == test
        }
    )
