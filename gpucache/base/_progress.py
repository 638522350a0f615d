"""Progress bars: tqdm's when it is installed, else none. tqdm is optional; nothing needs it."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

try:
    from tqdm.auto import tqdm
except ImportError:  # a machine without tqdm builds and loads all the same, without a bar
    # the stand-in takes the import's name, which the type checker sees as a second definition
    class tqdm:  # type: ignore[no-redef]  # noqa: N801 - tqdm's own name, so call sites read the same either way
        """A stand-in with tqdm's calls that draws nothing."""

        def __init__(
            self, iterable: Iterable[Any] | None = None, *args: Any, **kwargs: Any
        ) -> None:
            self.iterable = iterable

        def __iter__(self) -> Iterator[Any]:
            return iter(self.iterable if self.iterable is not None else ())

        def __enter__(self) -> tqdm:
            return self

        def __exit__(self, *exc: object) -> None:
            self.close()

        def update(self, n: int = 1) -> None:
            pass

        def set_postfix_str(self, *args: Any, **kwargs: Any) -> None:
            pass

        def set_description(self, *args: Any, **kwargs: Any) -> None:
            pass

        def close(self) -> None:
            pass


__all__ = ["tqdm"]
