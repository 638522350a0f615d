"""The build's two passes, in chunks, with a bounded number of chunks in flight.

1. Size: every input is stat'ed (or asked its ``nbytes``) and capped, 1,024 inputs a task.
2. Read: consecutive inputs form a chunk of at most 256 inputs or a few MiB; a thread reads the
   chunk into its own scratch buffer, sniffs each input (and re-encodes or transcodes it when a
   rewriter asks), and hands back the kept bytes packed end to end; the calling thread appends
   them, in input order, to the store's buffer, which was reserved at the summed size and is
   touched only where bytes land.

At most ``2 x threads`` tasks are in flight (:func:`ordered`), so temporary memory is
O(threads x chunk), not O(N): the store's arrays, the inputs' names and the chunks being read.
The store's buffer and index arrays are ``_readonly.writable_buffer`` mappings, which the store
then makes read-only in place (no copy).
"""

from __future__ import annotations

import mmap
import queue
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from ..base._cores import usable_cores
from ..base._threads import ordered_map
from ..store._format import pack_strings
from ..store._limits import over_budget, over_work
from ..store._masks import DATA as MASK_DATA
from ..store._masks import INFO as MASK_INFO
from ..store._masks import OFFSETS as MASK_OFFSETS
from ..store._masks import MaskKind
from ..store._readonly import writable_buffer
from ._inputs import Input, Refused, Samples, name_of, read_into, size_of
from ._masks import check_mask, resize_mask
from ._sniff import SAMPLE_DTYPE, Info, SniffError, sniff

#: A sample's bytes as a rewriter takes and gives them (its slot of the read buffer, or new bytes).
Encoded = bytes | memoryview


class Rewriter(Protocol):
    """A per-sample rewrite at build (``_resize.Reencode``, ``_restart.RestartMarkers``).

    ``columns``: the per-sample sections it fills, ``{name: (dtype, width)}`` (width 0: one
    value a sample). Called with a sample's bytes and what ``sniff`` said of them, it gives the
    bytes to store, what they are, and its columns' values for the sample; ``sections``: the
    store's sections it adds once ``k`` samples are kept (beside its columns)."""

    @property
    def columns(self) -> Mapping[str, tuple[str, int]]: ...

    def __call__(self, data: Encoded, info: Info) -> tuple[Encoded, Info, dict[str, Any]]: ...

    def sections(self, columns: dict[str, np.ndarray], k: int) -> dict[str, np.ndarray]: ...


SIZE_CHUNK = 1024  # inputs sized per task
READ_CHUNK = 256  # at most this many inputs read per task...
MIN_CHUNK_BYTES = 16 << 10  # ...and about this many bytes or more (or one larger input)


class Sized(NamedTuple):
    """The inputs sized: cumulative sizes (``cum[i+1] - cum[i]`` is input ``i``'s size; 0 for one
    refused) and the reason each refused input was refused."""

    cum: np.ndarray
    refused: dict[int, str]


def size_all(
    pool: Executor,
    inputs: Sequence[Input],
    max_pixels: int | None,
    window: int,
    tick: Callable[[int, int], None],
) -> Sized:
    """Every input's size (``size_of``), or why it was refused."""
    n = len(inputs)
    cum = np.zeros(n + 1, dtype=np.int64)
    errors: dict[int, str] = {}

    def task(a: int) -> tuple[int, np.ndarray, list[tuple[int, str]]]:
        sizes = np.zeros(min(n, a + SIZE_CHUNK) - a, dtype=np.int64)
        errs: list[tuple[int, str]] = []
        for k in range(len(sizes)):
            try:
                sizes[k] = size_of(inputs[a + k], max_pixels)
            except SniffError as err:
                errs.append((a + k, str(err)))
            except (OSError, ValueError) as err:  # ValueError: a path with a NUL byte
                errs.append((a + k, f"cannot stat: {getattr(err, 'strerror', None) or err}"))
        return a, sizes, errs

    for a, sizes, errs in ordered_map(task, range(0, n, SIZE_CHUNK), pool, window=window):
        cum[a + 1 : a + 1 + len(sizes)] = sizes
        errors.update(errs)
        tick(0, 0)
    np.cumsum(cum, out=cum)
    return Sized(cum, errors)


def chunks(cum: np.ndarray, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    """Consecutive ``[a, b)`` input ranges of at most READ_CHUNK inputs and ``chunk_bytes``."""
    n, a = len(cum) - 1, 0
    while a < n:
        b = int(np.searchsorted(cum, cum[a] + chunk_bytes, side="right")) - 1
        b = min(max(b, a + 1), a + READ_CHUNK, n)
        yield a, b
        a = b


@dataclass
class Chunk:
    """What one read task hands back: the kept inputs of ``[a, b)`` and their bytes, packed."""

    a: int
    b: int
    data: np.ndarray  # the kept (possibly rewritten) bytes, end to end
    kept: list[int] = field(default_factory=list)
    lens: list[int] = field(default_factory=list)
    recs: list[tuple[int, int, int, int, int, int]] = field(default_factory=list)
    name_lens: np.ndarray | None = None
    meta_lens: np.ndarray | None = None
    columns: dict[str, list[Any]] = field(default_factory=dict)
    errors: list[tuple[int, str]] = field(default_factory=list)
    masks: list[bytes] = field(default_factory=list)  # with masks: each kept sample's mask
    mask_recs: list[tuple[int, int, int]] = field(default_factory=list)  # kind, height, width
    nbytes: int = 0  # input bytes consumed
    raw: np.ndarray | None = None  # the scratch buffer ``data`` lies in, to give back


class Scratch:
    """Reusable read buffers for the chunks in flight (at most ``window`` exist at once).

    Each is its own anonymous mapping, so it goes back to the system when dropped; reusing them
    spares the page faults of a fresh buffer per chunk, and keeps the threads' malloc arenas from
    growing by a chunk each (glibc keeps freed heap memory per thread)."""

    def __init__(self, chunk_bytes: int) -> None:
        self.size = chunk_bytes
        self._free: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()

    def get(self, nbytes: int) -> np.ndarray:
        try:
            buf = self._free.get_nowait()
        except queue.Empty:
            buf = None
        if buf is None or len(buf) < nbytes:
            m = mmap.mmap(-1, max(nbytes, self.size, 1), flags=mmap.MAP_PRIVATE)
            buf = np.frombuffer(m, dtype=np.uint8)
        return buf

    def put(self, buf: np.ndarray | None) -> None:
        if (
            buf is not None and buf.base is not None and len(buf) <= 4 * self.size
        ):  # an oversized one is let go
            self._free.put(buf)


def read_chunk(
    span: tuple[int, int],
    *,
    inputs: Sequence[Input],
    samples: Samples,
    sized: Sized,
    max_pixels: int | None,
    rewriters: Sequence[Rewriter],
    scratch: Scratch,
) -> Chunk:
    """Inputs ``span`` (``a:b``) read into one buffer of ``scratch``, sniffed, checked against
    ``max_pixels`` (with their masks, ``samples.masks``) and rewritten (``rewriters``, in order):
    what the store keeps of each, or why it was left out."""
    a, b = span
    cum, refused = sized
    metadata, masks = samples.metadata, samples.masks
    raw = scratch.get(int(cum[b] - cum[a]))
    # numpy's stubs give ndarray the buffer protocol only from Python 3.12 on (numpy#26783)
    view, pos = memoryview(raw), 0  # type: ignore[arg-type]
    out = Chunk(a, b, raw, nbytes=int(cum[b] - cum[a]))
    pieces: list[Encoded] = []  # with rewriters: each kept sample's final bytes
    for rw in rewriters:
        for name in rw.columns:
            out.columns[name] = []
    for i in range(a, b):
        if refused and i in refused:
            continue
        size = int(cum[i + 1] - cum[i])
        slot = view[pos : pos + size]
        x = inputs[i]
        assert not isinstance(x, Refused)  # size_all refused it: it is in ``refused``
        try:
            read_into(x, slot)
            info = sniff(slot)
        except SniffError as err:
            out.errors.append((i, str(err)))
            continue
        except OSError as err:
            out.errors.append((i, f"cannot read: {err.strerror or err}"))
            continue
        why = over_budget(info.height, info.width, max_pixels)
        if why is not None:
            out.errors.append((i, f"header claims {why}"))
            continue
        why = over_work(info.scans, info.work, max_pixels)
        if why is not None:
            out.errors.append((i, why))
            continue
        if masks is not None:
            try:
                mask, kind = read_mask(masks[i], info.height, info.width, max_pixels)
            except SniffError as err:
                out.errors.append((i, f"mask {name_of(masks[i])}: {err}"))
                continue
            shown = (info.height, info.width)
        pos += size
        if rewriters:
            data: Encoded = slot
            for rw in rewriters:
                data, info, values = rw(data, info)
                for name, v in values.items():
                    out.columns[name].append(v)
            pieces.append(data)
            size = len(data)
        if masks is not None:  # a mask follows its image's re-encode to a smaller size (max_side)
            if (info.height, info.width) != shown:
                mask = resize_mask(mask, info.height, info.width)
            out.masks.append(mask)
            out.mask_recs.append((int(kind), info.height, info.width))
        out.kept.append(i)
        out.lens.append(size)
        out.recs.append(
            (info.kind, info.components, info.orientation, info.precision, info.height, info.width)
        )
    if rewriters:  # the final bytes, packed into a buffer of their own; the reads' one is freed
        out.data = scratch.get(sum(out.lens))
        at = 0
        for piece, size in zip(pieces, out.lens):
            out.data[at : at + size] = np.frombuffer(piece, np.uint8)
            at += size
        del pieces, view
        scratch.put(raw)
    out.raw, out.data = out.data, out.data[: sum(out.lens)]
    out.name_lens = _lengths([name_of(inputs[i]) for i in out.kept])
    if metadata is not None:
        out.meta_lens = _lengths([str(metadata[i]) for i in out.kept])
    return out


def read_mask(
    x: Input | None, height: int, width: int, max_pixels: int | None
) -> tuple[bytes, MaskKind]:
    """Mask input ``x`` (a path or a source) read and checked against its image's displayed
    ``height`` x ``width``: ``(bytes to store, kind)``, or a :class:`SniffError` with the reason."""
    if x is None:
        raise SniffError("no mask was given for this image")
    try:
        buf = bytearray(size_of(x, max_pixels))
        assert not isinstance(x, Refused)  # size_of refused it with its reason
        read_into(x, memoryview(buf))
    except FileNotFoundError:
        raise SniffError("the mask file does not exist") from None
    except OSError as err:
        raise SniffError(f"cannot read the mask: {err.strerror or err}") from err
    return check_mask(memoryview(buf), height, width)


def _lengths(strings: list[str]) -> np.ndarray:
    return np.diff(pack_strings(strings)[0]).astype(np.int64)


def _buffer(count: int, dtype: npt.DTypeLike) -> np.ndarray:
    """A writable array of ``count`` items that the store freezes in place (no copy)."""
    dtype = np.dtype(dtype)
    return writable_buffer(count * dtype.itemsize).view(dtype)


class Assembler:
    """The store's arrays, filled chunk by chunk in input order. ``columns``: the rewriters'
    per-sample sections, ``{name: (dtype, width)}`` (width 0: one value per sample)."""

    def __init__(
        self,
        n: int,
        reserve: int,
        columns: dict[str, tuple[str, int]],
        labels: np.ndarray,
        metadata: Sequence[str] | None,
        masks: bool = False,
    ) -> None:
        self.data = writable_buffer(reserve)
        self.cursor = self.count = 0
        self.offsets = _buffer(n + 1, "<i8")
        self.offsets[0] = 0
        self.labels_in, self.labels = labels, _buffer(n, "<i8")
        self.samples = _buffer(n, SAMPLE_DTYPE)
        self.keep = np.zeros(n, dtype=bool)
        self.name_ends = _buffer(n + 1, "<u8")
        self.name_ends[0] = 0
        self.meta_ends = None if metadata is None else _buffer(n + 1, "<u8")
        if self.meta_ends is not None:
            self.meta_ends[0] = 0
        self.columns = {
            k: _buffer(n * max(w, 1), dt).reshape((n, w) if w else (n,))
            for k, (dt, w) in columns.items()
        }
        # masks: their bytes (grown by half when full: their sizes are known only once read and
        # checked; untouched reserved pages cost nothing), offsets and (kind, height, width)
        self.masks = writable_buffer(max(1 << 20, reserve // 4)) if masks else None
        self.mask_cursor = 0
        self.mask_offsets = _buffer(n + 1, "<i8") if masks else None
        self.mask_info = _buffer(3 * n, "<u4").reshape(n, 3) if masks else None
        if self.mask_offsets is not None:
            self.mask_offsets[0] = 0

    def add(self, c: Chunk) -> None:
        k, m, end = self.count, len(c.kept), self.cursor + len(c.data)
        if end > len(self.data):  # rewritten bytes outgrew the reservation: rare, one copy
            grown = writable_buffer(max(end, len(self.data) + len(self.data) // 2))
            grown[: self.cursor] = self.data[: self.cursor]
            self.data = grown
        self.data[self.cursor : end] = c.data
        if m:
            self.offsets[k + 1 : k + 1 + m] = self.cursor + np.cumsum(c.lens)
            self.samples[k : k + m] = np.array(c.recs, dtype=SAMPLE_DTYPE)
            self.labels[k : k + m] = self.labels_in[c.kept]
            self.keep[c.kept] = True
            assert c.name_lens is not None  # read_chunk measures every kept name
            self.name_ends[k + 1 : k + 1 + m] = self.name_ends[k] + np.cumsum(c.name_lens)
            if self.meta_ends is not None:
                assert c.meta_lens is not None  # and the metadata, when there is some
                self.meta_ends[k + 1 : k + 1 + m] = self.meta_ends[k] + np.cumsum(c.meta_lens)
            for name, values in c.columns.items():
                self.columns[name][k : k + m] = values
            if self.masks is not None:
                self._add_masks(k, c)
        self.count, self.cursor = k + m, end

    def _add_masks(self, k: int, c: Chunk) -> None:
        assert self.masks is not None and self.mask_offsets is not None  # made with masks
        assert self.mask_info is not None
        m = len(c.masks)
        end = self.mask_cursor + sum(len(b) for b in c.masks)
        if end > len(self.masks):
            grown = writable_buffer(max(end, len(self.masks) + len(self.masks) // 2))
            grown[: self.mask_cursor] = self.masks[: self.mask_cursor]
            self.masks = grown
        at = self.mask_cursor
        for b in c.masks:
            self.masks[at : at + len(b)] = np.frombuffer(b, np.uint8)
            at += len(b)
        self.mask_offsets[k + 1 : k + 1 + m] = self.mask_cursor + np.cumsum(
            [len(b) for b in c.masks]
        )
        self.mask_info[k : k + m] = c.mask_recs
        self.mask_cursor = end

    def mask_sections(self) -> dict[str, np.ndarray]:
        """The store's mask sections (``store._masks``) of the kept samples; {} without masks."""
        if self.masks is None or self.mask_offsets is None or self.mask_info is None:
            return {}
        k = self.count
        return {
            MASK_DATA: self.masks[: self.mask_cursor],
            MASK_OFFSETS: self.mask_offsets[: k + 1],
            MASK_INFO: self.mask_info[:k],
        }

    def strings(
        self, ends: np.ndarray, texts: Callable[[int], str]
    ) -> tuple[np.ndarray, np.ndarray]:
        """The string table (offsets, blob) of the kept inputs' ``texts(i)``, packed in chunks."""
        ends = ends[: self.count + 1]
        blob = writable_buffer(int(ends[-1]))
        kept = np.flatnonzero(self.keep)
        for s in range(0, len(kept), 4096):
            part = kept[s : s + 4096]
            _, chunk = pack_strings([texts(int(i)) for i in part])
            blob[int(ends[s]) : int(ends[s + len(part)])] = chunk
        return ends, blob


def in_flight(total: int) -> int:
    """Bytes of input the chunks in flight may hold: 1/256 of the data, 256 KiB to 64 MiB."""
    return min(64 << 20, max(256 << 10, total // 256))


def default_threads() -> int:
    """``num_threads=None``: two reader threads per usable core (``_cores.usable_cores``), at
    most 16; reads block on the disk or network, so a second thread a core keeps it busy."""
    return min(16, 2 * usable_cores())
