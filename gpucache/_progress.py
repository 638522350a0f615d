"""Progress bars: tqdm's when it is installed, else none. tqdm is optional; nothing needs it."""

from __future__ import annotations

try:
    from tqdm.auto import tqdm
except ImportError:  # a machine without tqdm builds and loads all the same, without a bar

    class tqdm:  # noqa: N801 - tqdm's own name, so call sites read the same either way
        """A stand-in with tqdm's calls that draws nothing."""

        def __init__(self, iterable=None, *args, **kwargs):
            self.iterable = iterable

        def __iter__(self):
            return iter(self.iterable if self.iterable is not None else ())

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.close()

        def update(self, n: int = 1) -> None:
            pass

        def set_postfix_str(self, *args, **kwargs) -> None:
            pass

        def set_description(self, *args, **kwargs) -> None:
            pass

        def close(self) -> None:
            pass


__all__ = ["tqdm"]
