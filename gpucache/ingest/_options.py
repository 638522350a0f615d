"""The build options: one frozen object, made once from the keyword arguments of a public builder
(``JpegCache.from_folder`` and the other ``from_*``, and ``gpucache build`` through them) and
handed whole to the private functions that build (``node._builders``, ``node._storage``,
``_build.build``, ``_sources``, ``storage._objects``).

The public builders list every option explicitly (typed, documented, keyword-only); nothing below
them lists them again: they read the fields they need. The fields marked ``keyed`` change what
a build makes, so they are part of the node cache's key (``BuildOptions.keyed``); the others
(threads, progress bar, cache folder and cap, storage client options, requests in flight) change
how or where it is built, not the store.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from ..shares._partition import Share
from ..store._limits import DEFAULT_MAX_PIXELS

__all__ = ["ON_ERROR", "BuildOptions", "check_on_error", "spell_on_error"]

#: What ``on_error`` takes: leave unusable files out (listed in the build report), or stop.
ON_ERROR = ("skip", "raise")
_KEYED = {"keyed": True}


def spell_on_error(value: str, option: str = "on_error") -> str:
    """``on_error='skip'`` in Python, ``--on-error skip`` on the command line (``option`` as the
    caller spells the option)."""
    return f"{option} {value}" if option.startswith("--") else f"{option}={value!r}"


def check_on_error(value: object, option: str = "on_error") -> str:
    """``value`` if it is an ``on_error`` policy, else a ``ValueError`` that names the fix in the
    caller's spelling (``option``: ``"on_error"`` for the API, ``"--on-error"`` for the CLI)."""
    if isinstance(value, str) and value in ON_ERROR:
        return value
    raise ValueError(
        f"{option} must be 'skip' or 'raise', got {value!r}: pass "
        f"{spell_on_error('skip', option)} to leave unusable files out (each listed with its "
        f"reason in the build report) or {spell_on_error('raise', option)} to stop the build at "
        "the first."
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class BuildOptions:
    """How to build a store; the fields are the public builders' keyword arguments of the same
    names, with the same defaults (documented in ``JpegCache.from_folder``)."""

    on_error: Literal["skip", "raise"] = field(default="skip", metadata=_KEYED)
    num_threads: int | None = None
    progress: bool = True
    max_pixels: int | None = field(default=DEFAULT_MAX_PIXELS, metadata=_KEYED)
    cache_dir: str | os.PathLike[str] | None = None
    cache_max_bytes: int | None = None
    restart_markers: bool = field(default=False, metadata=_KEYED)
    max_side: int | None = field(default=None, metadata=_KEYED)
    jpeg_quality: int | None = field(default=None, metadata=_KEYED)
    # for objects in storage: never in a key, a store, a log line or a repr (credentials)
    storage_options: dict[str, Any] | None = field(default=None, repr=False)
    requests_in_flight: int | None = None
    shard: Literal["node"] | None = None
    # set by the node layer from shard="node" and the job's nodes: the share this node builds
    share: Share | None = field(default=None, metadata={"internal": True})
    # set by the node layer for a resumed epoch: global ranks of other shares to hold too
    share_extra: tuple[int, ...] = field(default=(), metadata={"internal": True})

    def __post_init__(self) -> None:
        check_on_error(self.on_error)
        if self.shard not in (None, "node"):
            raise ValueError(
                f"shard must be None (every node holds the whole data set) or 'node' (each "
                f"node holds its share), got {self.shard!r}."
            )
        if self.max_pixels is not None and self.max_pixels < 1:
            raise ValueError(
                f"max_pixels must be a positive number of pixels or None (no bound), "
                f"got {self.max_pixels!r}."
            )

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every option's name, in order (the public ones: ``share`` is set by the node layer)."""
        return tuple(f.name for f in fields(cls) if not f.metadata.get("internal"))

    @classmethod
    def of(cls, arguments: dict[str, Any]) -> BuildOptions:
        """The options among a public builder's arguments (its ``locals()``); options the builder
        does not take keep their defaults."""
        return cls(**{k: arguments[k] for k in cls.names() if k in arguments})

    def keyed(self) -> tuple[object, ...]:
        """The values of the options that change what is built (on_error, max_pixels,
        restart_markers, max_side, jpeg_quality), in order, then the node's share when there is
        one: the node cache's key holds them (a store without a share keeps its key)."""
        keyed = tuple(getattr(self, f.name) for f in fields(self) if f.metadata.get("keyed"))
        return keyed if self.share is None else (*keyed, self.share)
