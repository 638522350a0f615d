"""The store: encoded images packed once into one read-only buffer.

``Store`` is the store itself; the public class, ``JpegCache`` (``gpucache.node._jpegcache``), is
a ``Store`` with the builders (``from_folder`` and the other ``from_*``), which orchestrate the
layers above this one (sources, the build once per node). This layer imports none of them.

A store is a handful of numpy arrays: one uint8 buffer of every file's bytes, int64 offsets (N+1),
int64 labels, a per-sample record (kind, components, orientation, precision, height, width), class
names and two string tables (source paths, optional metadata). No per-image Python objects.

Backing, and what sharing costs:
- in memory (just built): nothing to share under fork or with zero workers; pickling it is refused,
  because that would silently copy it into every process. ``share()`` moves it into shared memory.
- a mapped file (``JpegCache.open`` or after ``share()``): pickles as its path, O(1) bytes; the
  child maps the same pages read-only.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar, overload

import numpy as np
import torch

from .._errors import CacheFormatError
from ..base._fork import finalize_here
from ..shares._record import StoreShare, share_of
from . import _format, _parse, _readonly, _report, _save, _sections, _shm
from ._format import Columns, Kind
from ._limits import DEFAULT_MAX_PIXELS
from ._mapped import Handle
from ._masks import Masks, masks_of

S = TypeVar("S", bound="Store")  # a store class: the public JpegCache, or Store itself


class _Strings(Sequence[str]):
    """A read-only list of strings over a blob and its offsets; each string comes back as the
    ``str`` it was made from (UTF-8, non-UTF-8 bytes of OS names kept by ``surrogateescape``)."""

    def __init__(self, table: tuple[np.ndarray, np.ndarray]):
        self._offsets, self._blob = table

    def __len__(self) -> int:
        return len(self._offsets) - 1

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...
    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        i = range(len(self))[i]
        return _format.decode(bytes(self._blob[self._offsets[i] : self._offsets[i + 1]]))

    def __repr__(self) -> str:
        return f"<{len(self)} strings>"


class Store:
    """The packed buffer behind the public ``JpegCache`` (``gpucache.node._jpegcache``), which
    adds the builders (``from_folder`` and the other ``from_*``): they orchestrate the layers
    above this one. Everything a store is and does once made is here, so the layers below the
    node layer (loader, decode, ingest) take, check (``isinstance(x, Store)``) and make
    (``cls(...)``, ``type(cache)(...)``) stores without knowing of the builders.
    """

    def __init__(
        self,
        columns: Columns,
        *,
        report: _report.BuildReport | None = None,
        max_pixels: int | None = DEFAULT_MAX_PIXELS,
        _file: _parse.Parsed | None = None,
    ) -> None:
        data, offsets, labels, samples = (
            columns.data,
            columns.offsets,
            columns.labels,
            columns.samples,
        )
        paths, metadata = columns.paths, columns.metadata
        extra = {k: _format.check_extra(k, v) for k, v in columns.extra.items()}
        if _file is None:  # in memory: read-only pages, so no view can write into the store
            why = _sections.problem(extra, len(labels), samples=samples)
            if why is not None:  # a save would write a store that does not open
                raise ValueError(
                    f"{why}; give it the type and shape docs/reference/format.md "
                    "lists (gpucache.with_targets makes the targets sections)."
                )
            tables = [*paths, *(metadata or ())]
            data, offsets, labels, samples, *rest = _readonly.freeze(
                [
                    data,
                    np.asarray(offsets, "<i8"),
                    np.asarray(labels, "<i8"),
                    samples,
                    *tables,
                    *extra.values(),
                ]
            )
            paths, rest = (rest[0], rest[1]), rest[2:]
            if metadata is not None:
                metadata, rest = (rest[0], rest[1]), rest[2:]
            extra = dict(zip(extra, rest))
        self._hold(Columns(data, offsets, labels, samples, columns.classes, paths, metadata, extra))
        self.report = report
        self.max_pixels = max_pixels
        self._file = _file
        self._shm_finalizer: weakref.finalize[Any, Any] | None = None
        self._tensor: torch.Tensor | None = None

    # ------------------------------------------------------------------ opening
    @classmethod
    def open(
        cls: type[S], path: str | os.PathLike[str], *, max_pixels: int | None = DEFAULT_MAX_PIXELS
    ) -> S:
        """Map a saved store read-only. Validates header, sizes and offsets; reads no image data.

        ``max_pixels``: samples whose header claims more decoded pixels are refused at decode."""
        return cls._from_parsed(_parse.open_mapped(Path(path)), max_pixels)

    @classmethod
    def _from_parsed(cls: type[S], parsed: _parse.Parsed, max_pixels: int | None) -> S:
        return cls(
            _parsed_columns(parsed),
            report=_report.read_report(parsed.extra, parsed._name),
            max_pixels=max_pixels,
            _file=parsed,
        )

    def _replace(self: S, **changes: Any) -> S:
        """A new in-memory store with some arrays replaced (``data``, ``offsets``, ``samples``,
        ``labels``, ``extra``...): for code that derives a store from this one (e.g. transcoding).
        ``extra`` replaces the optional sections as a whole; pass ``{**cache.extra, name: a}``."""
        report = changes.pop("report", self.report)
        max_pixels = changes.pop("max_pixels", self.max_pixels)
        columns = dataclasses.replace(self._columns(), **changes)
        return type(self)(columns, report=report, max_pixels=max_pixels)

    # ------------------------------------------------------------------ access
    def __len__(self) -> int:
        return len(self._labels)

    def __getitem__(self, i: int) -> np.ndarray:
        i = range(len(self))[i]  # negative indices and a clear IndexError
        self._check_intact()
        return self._data[self._offsets[i] : self._offsets[i + 1]]

    def _check_intact(self) -> None:
        """A store file truncated under its mapping would SIGBUS on the next read: make it an error.

        One fstat (about 7 us measured) per sample handed out, against a decode of 100 us or more.
        A truncation between this check and the read still faults (docs/guides/memory.md,
        "Sharing and /dev/shm")."""
        if (
            self._file is not None
            and self._file.path is not None
            and not self._file.handle.intact()
        ):
            raise CacheFormatError(
                f"{self._file.path}: the store file was truncated or rewritten in place while it "
                "is mapped; reading it now would crash (SIGBUS). Never write into a store file "
                "that is in use: save() writes a new file and renames it, which is safe."
            )

    def _bytes_tensor(self, i: int) -> torch.Tensor:
        """Sample ``i``'s bytes as a uint8 tensor sharing the store's memory, for the decoders.

        Private on purpose: torch ignores numpy's read-only flag, so only read-only numpy views
        (``cache[i]``) are handed to users."""
        if self._tensor is None:
            self._tensor = _readonly.tensor_over(self._data)
        self._check_intact()
        return self._tensor[int(self._offsets[i]) : int(self._offsets[i + 1])]

    @property
    def labels(self) -> np.ndarray:
        """int64 label per sample (read-only); -1 where unlabeled."""
        return self._labels

    @property
    def classes(self) -> list[str]:
        return list(self._classes)

    @property
    def paths(self) -> Sequence[str]:
        """Source path of each sample, as given at build time."""
        return _Strings(self._paths)

    @property
    def metadata(self) -> Sequence[str] | None:
        """Per-sample metadata strings given to :meth:`from_files`, or None."""
        return None if self._metadata_table is None else _Strings(self._metadata_table)

    @property
    def extra(self) -> Mapping[str, np.ndarray]:
        """Named optional sections of the store (docs/reference/format.md), as read-only arrays;
        gpucache's own sections (``sample.*``, ``report.*``) are not listed."""
        return MappingProxyType(self._extra)

    @property
    def node_share(self) -> StoreShare | None:
        """The node share this store holds (``shard="node"``: partitions, the whole listing's
        size, the node layout it was built for, each sample's global rank), or None for a store
        of the whole data set (docs/guides/nodes.md)."""
        return share_of(self._extra)

    def _holding(self: S, ranks: np.ndarray) -> S | None:
        """A store of this node's share that also holds the samples of the other shares'
        global ``ranks`` (the loader asks, to finish an epoch resumed at another node count),
        or None: a store opened from a file cannot fetch them (the public ``JpegCache`` made by
        a builder can: ``node/_jpegcache.py``)."""
        return None

    @property
    def masks(self) -> Masks | None:
        """The samples' segmentation masks (``masks[i]``: sample ``i``'s encoded mask bytes, a
        read-only view; ``kinds``, ``heights``, ``widths`` per sample), or None for a store
        built without ``masks=`` (docs/guides/segmentation.md)."""
        return masks_of(self._extra, self._check_intact)

    @property
    def samples(self) -> np.ndarray:
        """Structured per-sample record: kind, components, orientation, precision, height, width."""
        return self._samples

    @property
    def nbytes(self) -> int:
        """Bytes of encoded image data held (about the size of the files on disk)."""
        return int(self._data.nbytes)

    @property
    def path(self) -> Path | None:
        """The saved store file this store was opened from; None in memory and for a shared-memory
        copy (which has no name on Linux; see :meth:`share`)."""
        return None if self._file is None else self._file.path

    def kinds(self) -> np.ndarray:
        kinds: np.ndarray = self._samples["kind"]  # a field of a structured array
        return kinds

    def gpu_decodable(self) -> np.ndarray:
        """Boolean mask: 8-bit Huffman JPEG with 1 or 3 components (what nvJPEG takes)."""
        k = self._samples["kind"]
        mask: np.ndarray = np.isin(k, [Kind.JPEG, Kind.JPEG_PROGRESSIVE]) & (
            self._samples["components"] != 4
        )
        return mask

    def __repr__(self) -> str:
        where = (
            f"file {self.path}"
            if self.path
            else "shared memory"
            if self._file is not None
            else "memory"
        )
        return (
            f"{type(self).__name__}({len(self)} samples, {classes_text(self._classes)}, "
            f"{self.nbytes / 2**20:,.1f} MiB in {where})"
        )

    # ------------------------------------------------------------------ saving and sharing
    def _columns(self) -> Columns:
        return Columns(
            data=self._data,
            offsets=self._offsets,
            labels=self._labels,
            samples=self._samples,
            classes=self._classes,
            paths=self._paths,
            metadata=self._metadata_table,
            extra=self._extra,
        )

    def _stored(self) -> Columns:
        """What a saved or shared copy holds: the arrays, plus the build report's sections."""
        report = {} if self.report is None else _report.report_sections(self.report)
        return self._columns().with_sections(report)

    def save(self, path: str | os.PathLike[str], *, mode: int | None = None) -> Path:
        """Write the store to one file, atomically (temp name, fsync, rename); ``mode``: its
        permission bits (default: 0666 less the umask, as ``open`` does)."""
        path = Path(path)
        try:
            _save.save_atomic(path, self._stored(), mode=mode)
        except OSError as err:
            import errno

            fix: dict[int | None, str] = {
                errno.ENOSPC: f"it needs {self.nbytes / 2**20:,.1f} MiB there; free room or "
                "choose another folder",
                errno.EFBIG: "the file-size limit (ulimit -f / RLIMIT_FSIZE) is lower than the "
                f"{self.nbytes / 2**20:,.1f} MiB store; raise it",
                errno.ENOENT: "the folder does not exist; create it first",
                errno.EACCES: "no permission to write there; choose another folder",
                errno.EPERM: "choose a folder that only you can write to",
            }
            raise OSError(
                err.errno,
                f"could not save the store to {path}: {err.strerror}; "
                f"{fix.get(err.errno, 'check the path and the disk')}.",
            ) from err
        return path

    @property
    def is_shared(self) -> bool:
        """True when workers of any start method can attach to this store's pages."""
        return self._file is not None and self._file.handle.fd is not None

    def share(self: S) -> S:
        """Move an in-memory store into shared memory (once; checks the room first). Idempotent.

        On Linux the shared copy has no name: only this store's descriptor (and the workers that
        attach through it) hold it, so it cannot outlive them, however they exit."""
        if self.is_shared:
            return self
        old = _readonly.mapping_of(self._data)
        before = None if old is None else weakref.ref(old)  # the in-memory copy, to see it go
        del old
        fd, kept, size = self._shared_copy()
        try:
            parsed = _parse.Parsed(
                Handle(fd, f"shared-memory copy of the store ({size} bytes)", kept)
            )
        except BaseException as err:
            if kept is not None:
                _shm.unlink(kept)
            if isinstance(err, MemoryError):  # mapping it failed: ulimit -v
                raise _shm.no_address_space(size, err.__cause__ or err) from err
            raise
        if kept is not None:  # no /proc: the name stays until close(), gc or exit
            self._shm_finalizer = finalize_here(self, _shm.unlink, kept)
        self._adopt(parsed)
        if before is not None and before() is not None:
            warnings.warn(
                f"gpucache: the store was moved into shared memory, but its in-memory copy "
                f"({self.nbytes / 2**20:,.1f} MiB) is still referenced by views taken from "
                "it before (cache[i], or a tensor over one), so the data is held twice while "
                "they live. Drop those views before the loader starts its workers, or save the "
                "store (cache.save(path)) and use JpegCache.open(path), which holds it once.",
                RuntimeWarning,
                stacklevel=2,
            )
        return self

    def _shared_copy(self) -> tuple[int, Path | None, int]:
        """The store written into shared memory (``_shm.create``): descriptor, name, size."""
        columns = self._stored()
        size = _format.write(None, columns)
        fd, kept = _shm.create(size, lambda f: _format.write(f, columns))
        return fd, kept, size

    def _hold(self, columns: Columns) -> None:
        """Hold ``columns`` as this store's arrays (checked and read-only already)."""
        c = columns
        self._data, self._offsets, self._labels, self._samples = (
            c.data,
            c.offsets,
            c.labels,
            c.samples,
        )
        self._classes = list(c.classes)
        self._paths, self._metadata_table = c.paths, c.metadata
        self._extra = dict(c.extra)

    def _adopt(self, parsed: _parse.Parsed) -> None:
        self._hold(_parsed_columns(parsed))
        self._file, self._tensor = parsed, None

    def close(self) -> None:
        """Release the store's file descriptor and shared-memory copy, if any. Idempotent.

        Views already handed out stay valid (the mapping lives until they are gone); the store can
        no longer be handed to new worker processes (call ``share()`` again for that)."""
        if self._file is not None:
            self._file.handle.close()
        if self._shm_finalizer is not None:
            self._shm_finalizer()

    def __enter__(self: S) -> S:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> tuple[Callable[..., Store], tuple[type[Store], Handle, int | None]]:
        if self._file is None:
            raise TypeError(
                "an in-memory JpegCache cannot be pickled: that would copy every image into each "
                "process. Call cache.share() to move it into shared memory once, or save it "
                "(cache.save(path)) and pass JpegCache.open(path); GpuCachedLoader does the "
                "former by itself for spawn/forkserver workers."
            )
        return (_reopen, (type(self), self._file.handle, self.max_pixels))


def classes_text(classes: Sequence[str]) -> str:
    """``"unlabeled"`` for a store with no classes (every label -1), else ``"N classes"``."""
    n = len(classes)
    return "unlabeled" if n == 0 else f"{n:,} class{'' if n == 1 else 'es'}"


def _user_sections(extra: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The optional sections a user sees in ``cache.extra``: not gpucache's own (checksums,
    build report), which are rewritten from the store itself on every save."""
    return {k: v for k, v in extra.items() if not k.startswith(_format.RESERVED)}


def _parsed_columns(parsed: _parse.Parsed) -> Columns:
    """A mapped file's arrays as a store holds them (the user's optional sections only)."""
    return Columns(
        data=parsed.data,
        offsets=parsed.offsets,
        labels=parsed.labels,
        samples=parsed.samples,
        classes=parsed.classes,
        paths=parsed.paths,
        metadata=parsed.metadata,
        extra=_user_sections(parsed.extra),
    )


def _reopen(cls: type[S], handle: Handle, max_pixels: int | None) -> S:
    """In a worker: the very file the pickling process had open and validated (see ``_mapped``),
    so only its O(1) checks run again here; a store of the class that was pickled."""
    return cls._from_parsed(_parse.Parsed(handle, trusted=handle.trusted), max_pixels)
