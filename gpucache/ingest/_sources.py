"""Where data sets come from: files, bytes, file-likes, a CSV list, WebDataset tar shards, and
Hugging Face ``datasets``.

Each function turns its input into the build's inputs (paths or ``Source`` objects that know their
size and read straight into their slot of the store's buffer), then calls the one build: sizes
first, one buffer, every image read into its slot by a thread pool under a progress bar. No list
of bytes is made, so the build peaks at one copy of the data.
"""

from __future__ import annotations

import csv
import io
import logging
import os
import posixpath
import re
import tarfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ..base._progress import tqdm
from ..store._store import S
from ._build import BytesSource, FileObjSource, FileRangeSource, Source, build, check_labels
from ._inputs import Input, Refused, Samples
from ._options import BuildOptions
from .storage._calls import read_text
from .storage._client import is_url

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

log = logging.getLogger(__name__)

#: Member extensions taken as the image of a WebDataset sample, in order of preference.
WDS_IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff", "ppm", "pgm")


def as_input(x: Any, i: int, what: str = "item") -> Input:
    """One ``from_files`` item (``what``: ``"item"``, or ``"mask"`` for an entry of ``masks=``)
    as a build input: a path, bytes-like, file-like or ``Source``."""
    named = "" if what == "item" else f"{what} "
    if isinstance(x, (str, os.PathLike)):
        return os.fspath(x)
    if isinstance(x, (bytes, bytearray, memoryview, np.ndarray)):
        return BytesSource(f"<{named}bytes #{i}>", x)
    if isinstance(x, Source):
        return x
    if hasattr(x, "readinto") and hasattr(x, "seek") and hasattr(x, "tell"):
        name = getattr(x, "name", None)
        return FileObjSource(name if isinstance(name, str) else f"<{named}file object #{i}>", x)
    raise TypeError(
        f"{what} {i} of from_files is a {type(x).__name__}; give paths (str or "
        "os.PathLike), bytes-like objects (bytes, bytearray, memoryview, uint8 array) "
        "or seekable binary file objects (open(path, 'rb'), io.BytesIO)."
    )


def _labels_from_column(
    values: Sequence[str], classes: Sequence[str] | None
) -> tuple[np.ndarray, list[str] | None]:
    """CSV labels: all ints (or empty) are taken as ints, otherwise as class names (sorted)."""
    if all(re.fullmatch(r"\s*-?\d+\s*", v) or not v.strip() for v in values):
        return np.array(
            [int(v) if v.strip() else -1 for v in values], dtype=np.int64
        ), None if classes is None else list(classes)
    names = list(classes) if classes is not None else sorted({v for v in values if v})
    index = {c: k for k, c in enumerate(names)}
    unknown = sorted({v for v in values if v and v not in index})
    if unknown:
        raise ValueError(
            f"labels {unknown[:5]} are not among classes={names[:10]}...; pass "
            "classes= naming every label, or use integer labels."
        )
    return np.array([index[v] if v else -1 for v in values], dtype=np.int64), names


def read_csv(
    path: str | os.PathLike[str],
    *,
    classes: Sequence[str] | None = None,
    delimiter: str = ",",
    header: bool | None = None,
    storage_options: dict[str, Any] | None = None,
    mask_column: str | int | None = None,
) -> tuple[list[str], np.ndarray, list[str], list[str] | None, list[str] | None]:
    """``(files, labels, classes, metadata, masks)`` of a CSV's rows ``path,label[,metadata]``;
    relative paths are taken against the CSV's folder (a CSV in storage: against its URL's
    folder), URLs (``s3://...``) as they are.

    Labels are ints (empty = unlabeled) or class names (mapped to ``classes``, or to the sorted
    names found). ``header=None`` skips a first row whose label cell is ``label``/``class``.
    ``mask_column``: the column of mask paths (its name in the header row, or its 0-based
    index), taken out of each row before the rest is read as above; ``masks`` is None without."""
    if isinstance(path, str) and is_url(path):
        text = read_text(path, storage_options)
        rows = [
            r
            for r in csv.reader(io.StringIO(text, newline=""), delimiter=delimiter)
            if r and any(c.strip() for c in r)
        ]
        url_base = path.rpartition("/")[0]
    else:
        path = Path(path)
        url_base = None
        with open(path, newline="", encoding="utf-8") as f:
            rows = [
                r for r in csv.reader(f, delimiter=delimiter) if r and any(c.strip() for c in r)
            ]
    mask_cells = None
    if mask_column is not None:
        rows, mask_cells, header = _take_column(rows, mask_column, header, path)
    if rows and (
        header
        or header is None
        and len(rows[0]) > 1
        and rows[0][1].strip().lower() in ("label", "class", "target", "y")
    ):
        rows = rows[1:]
        mask_cells = None if mask_cells is None else mask_cells[1:]
    for k, r in enumerate(rows):
        if len(r) > 3:
            raise ValueError(
                f"{path}: row {k + 1} has {len(r)} columns; expected "
                "path,label[,metadata] (quote metadata that contains the delimiter)."
            )
    files = [_row_path(r[0].strip(), path, url_base) for r in rows]
    labels, names = _labels_from_column([r[1] if len(r) > 1 else "" for r in rows], classes)
    labels, names = check_labels(len(files), labels, names)
    meta = [r[2] if len(r) > 2 else "" for r in rows] if any(len(r) > 2 for r in rows) else None
    masks = (
        None if mask_cells is None else [_row_path(c.strip(), path, url_base) for c in mask_cells]
    )
    return files, labels, names, meta, masks


def _take_column(
    rows: list[list[str]], column: str | int, header: bool | None, path: str | os.PathLike[str]
) -> tuple[list[list[str]], list[str], bool | None]:
    """``rows`` less the mask column, the mask cells (header row excluded) and what is left of
    the header: a column named by the header row takes that row out (``header=False``)."""
    if isinstance(column, str):
        names = [c.strip() for c in rows[0]] if rows else []
        if header is False or column not in names:
            raise ValueError(
                f"{path}: mask_column={column!r} names a column of the header row, and the "
                f"first row is {names[:6]}; add a header row naming the columns, or pass the "
                "column's 0-based index."
            )
        at, rows, header = names.index(column), rows[1:], False
    else:
        at = int(column)
    short = next((k for k, r in enumerate(rows) if len(r) <= at), None)
    if short is not None:
        raise ValueError(
            f"{path}: row {short + 1} has {len(rows[short])} columns, no mask column {at}."
        )
    return [r[:at] + r[at + 1 :] for r in rows], [r[at] for r in rows], header


def _row_path(cell: str, csv_path: str | os.PathLike[str], url_base: str | None) -> str:
    """A CSV row's file: a URL as it is; else relative to the CSV's folder or URL (absolute
    local paths stay as they are)."""
    if is_url(cell):
        return cell
    if url_base is not None:
        scheme, _, rest = url_base.partition("://")
        return f"{scheme}://{posixpath.normpath(posixpath.join('/' + rest, cell)).lstrip('/')}"
    return os.path.join(Path(csv_path).parent, cell)


def _split_key(name: str) -> tuple[str, str]:
    """WebDataset's sample key and extension: ``dir/abc.seg.png`` -> (``dir/abc``, ``seg.png``)."""
    folder, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext.lower() if dot else ""


class _Range(io.RawIOBase):
    """``size`` bytes at ``offset`` of the file at ``path``, as a seekable file (a shard held
    in a larger file, such as the spool of fetched objects)."""

    def __init__(self, path: str | os.PathLike[str], offset: int, size: int) -> None:
        super().__init__()
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self._offset, self._size, self._pos = offset, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = (0, self._pos, self._size)[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, b: WriteableBuffer) -> int:
        view = memoryview(b)
        n = max(0, min(len(view), self._size - self._pos))
        got = os.preadv(self._fd, [view[:n]], self._offset + self._pos) if n else 0
        self._pos += got
        return got

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()


#: A WebDataset sample as ``shard_samples`` reads it: its image (None: no image member), the
#: texts of its ``.cls`` and metadata members, its key, and its mask.
Member = FileRangeSource | Refused
Row = tuple[Member | None, str | None, str | None, str, Member | None]


def shard_samples(
    shard: str,
    metadata_ext: str | None,
    at: tuple[str | os.PathLike[str], int, int] | None = None,
    mask_ext: str | None = None,
) -> Iterator[Row]:
    """(build input or None, label text or None, metadata text or None, key, mask input or
    None) per sample; ``mask_ext``: the extension of the mask member (never taken for the image).

    The input is the image member as a ``FileRangeSource``, or a ``Refused`` one when its header
    claims more bytes than the shard holds. A shard that cannot be opened as a plain tar, or that
    ends early or holds garbage after its members, yields one ``Refused`` input named after the
    shard (the samples listed before the damage are kept): a bad shard is a bad input.
    ``at``: the shard's bytes are ``(path, offset, size)`` (fetched from storage), ``shard`` its
    name (members are named ``shard/member``)."""
    path, base = (shard, 0) if at is None else (at[0], at[1])
    held = None if at is None else _Range(*at)  # tarfile leaves a file object it is given open
    try:
        size = os.stat(shard).st_size if at is None else at[2]
        # plain tar only: members are read in place
        tf = (
            tarfile.open(shard, mode="r:")
            if held is None
            else tarfile.open(fileobj=held, mode="r:")
        )
    except OSError as err:
        if held is not None:
            held.close()
        yield (
            Refused(shard, f"cannot open the shard: {err.strerror or err}"),
            None,
            None,
            shard,
            None,
        )
        return
    except tarfile.TarError as err:
        if held is not None:
            held.close()
        yield (
            Refused(
                shard,
                f"not an uncompressed tar ({err}); members of a compressed shard "
                "cannot be read in place: decompress it (gunzip) first",
            ),
            None,
            None,
            shard,
            None,
        )
        return
    samples: dict[str, dict[str, Any]] = {}
    damage = None
    m: tarfile.TarInfo | None  # a member; below, each sample's image member (or None)
    with tf:
        try:
            for m in tf:
                if not m.isfile():
                    continue
                key, ext = _split_key(m.name)
                s = samples.setdefault(key, {})
                if mask_ext is not None and ext == mask_ext:
                    s["mask"] = m
                elif ext.rpartition(".")[2] in WDS_IMAGE_EXTS:  # "jpg", or "left.jpg"
                    s.setdefault("images", {}).setdefault(ext.rpartition(".")[2], m)
                elif ext == "cls" or ext == metadata_ext:
                    member = tf.extractfile(m)
                    assert member is not None  # a regular file's (checked above)
                    raw = member.read()
                    try:
                        text = raw.decode("utf-8")
                    except UnicodeDecodeError as err:  # a reason, not a crash
                        text = raw.decode("utf-8", "backslashreplace")  # a .cls's error shows it
                        if ext == metadata_ext:
                            s["bad metadata"] = (
                                f"its .{ext} member is not UTF-8 text (byte "
                                f"{err.start} is {raw[err.start]:#04x})"
                            )
                    s[ext] = text.strip()
            if tf.offset < size:  # after the last member: the end-of-archive zeros, or damage
                with open(path, "rb") as f:
                    f.seek(base + tf.offset)
                    tail = f.read(min(1 << 16, size - tf.offset))
                if tail.strip(b"\0"):
                    damage = f"bytes after the last member at byte {tf.offset:,} are no tar header"
            elif tf.offset:  # a tar ends with zero blocks; one cut at a header ends without
                damage = (
                    f"the shard ends right after a member, at byte {size:,}, without the tar's "
                    "end-of-archive blocks: it was cut short (a partial upload or copy)"
                )
        except (tarfile.TarError, EOFError, OSError) as err:
            damage = f"{err} (the headers lead to byte {tf.offset:,}; the shard has {size:,})"
    if held is not None:
        held.close()
    for key, s in samples.items():
        images = s.get("images", {})
        m = next((images[e] for e in WDS_IMAGE_EXTS if e in images), None)
        item: FileRangeSource | Refused | None = (
            None
            if m is None
            else FileRangeSource(f"{shard}/{m.name}", path, base + m.offset_data, m.size)
        )
        if m is not None and "bad metadata" in s:
            assert item is not None  # made for m
            item = Refused(
                item.name,
                f"{s['bad metadata']}; metadata must be UTF-8 text (e.g. "
                "JSON): rewrite that member",
            )
        elif m is not None and m.offset_data + m.size > size:
            assert item is not None  # made for m
            item = Refused(
                item.name,
                f"its tar header claims {m.size:,} bytes, but the shard ends "
                f"{size - m.offset_data:,} bytes after its start (a "
                "truncated shard, or a header that lies)",
            )
        yield (
            item,
            s.get("cls"),
            s.get(metadata_ext) if metadata_ext else None,
            key,
            _mask_member(s.get("mask"), shard, key, mask_ext, path, base, size),
        )
    if damage is not None:
        yield (
            Refused(
                shard,
                f"truncated or corrupt tar: {damage}; the samples listed before "
                "the damage are kept, any after it are lost: rewrite the shard",
            ),
            None,
            None,
            shard,
            None,
        )


def _mask_member(
    m: tarfile.TarInfo | None,
    shard: str,
    key: str,
    mask_ext: str | None,
    path: str | os.PathLike[str],
    base: int,
    size: int,
) -> Member | None:
    """A sample's mask member as a build input: in place in the shard, or why there is none."""
    if mask_ext is None:
        return None
    if m is None:
        return Refused(f"{shard}/{key}.{mask_ext}", "the sample has no mask member")
    if m.offset_data + m.size > size:
        return Refused(f"{shard}/{m.name}", "its tar header claims more bytes than the shard holds")
    return FileRangeSource(f"{shard}/{m.name}", path, base + m.offset_data, m.size)


@dataclass(frozen=True)
class Members:
    """What a WebDataset sample gives the build besides its image: ``classes``, the names its
    ``key.cls`` labels index (None: ``0..max``); ``metadata_ext``, the extension of the member
    whose text is its metadata (``"json"``; None: no metadata); ``mask_ext``, that of its mask
    (``"png"`` beside a ``jpg``, or ``"seg.png"``; None: no masks)."""

    classes: Sequence[str] | None = None
    metadata_ext: str | None = None
    mask_ext: str | None = None

    def samples(
        self,
        labels: Sequence[int],
        metadata: Sequence[str],
        masks: Sequence[Input | None] | None,
    ) -> Samples:
        """The build's :class:`Samples` of the shards' samples: their labels checked against
        ``classes``, their metadata and masks kept where these members were asked for."""
        labels_arr, names = check_labels(len(labels), labels, self.classes)
        return Samples(
            labels_arr,
            names,
            metadata if self.metadata_ext else None,
            masks if self.mask_ext is not None else None,
        )


def from_webdataset(
    cls: type[S],
    shards: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    options: BuildOptions,
    members: Members,
    *,
    locate: Callable[[int], tuple[str | os.PathLike[str], int, int] | Refused] | None = None,
    on_progress: Callable[[int, int, int], None] | None = None,
) -> S:
    """Samples of WebDataset tar shards, read straight out of the tars (no extraction).

    A sample is the members sharing a key (``dir/key.ext``); its image is the first member with an
    image extension (``WDS_IMAGE_EXTS`` order), its label the integer in ``key.cls`` (-1 if none),
    its metadata the text of ``key.<metadata_ext>`` (e.g. ``"json"``), its mask the member
    ``key.<mask_ext>`` (``members``). ``locate(k)``: where shard ``k``'s bytes are, ``(path,
    offset, size)``, or why it has none (shards fetched from storage, named by their URLs)."""
    metadata_ext, mask_ext = members.metadata_ext, members.mask_ext
    shards = (
        [os.fspath(shards)]
        if isinstance(shards, (str, os.PathLike))
        else [os.fspath(s) for s in shards]
    )
    inputs: list[Source | Refused] = []
    masks: list[Source | Refused] = []
    labels: list[int] = []
    meta: list[str] = []
    missing: list[str] = []
    for k, shard in enumerate(
        tqdm(
            shards,
            desc="gpucache scan shards",
            unit="shard",
            disable=not options.progress or None,
            leave=False,
        )
    ):
        at = None if locate is None else locate(k)
        if isinstance(at, Refused):
            inputs.append(at)
            masks.append(at)
            labels.append(-1)
            meta.append("")
            continue
        for item, cls_text, meta_text, key, mask in shard_samples(
            shard, metadata_ext, at, mask_ext
        ):
            if item is None:
                missing.append(f"{shard}/{key}")
                continue
            labels.append(shard_label(shard, key, cls_text))
            inputs.append(item)
            masks.append(mask if mask is not None else Refused(item.name, "no mask"))
            meta.append(meta_text or "")
    return build_samples(
        cls, inputs, members.samples(labels, meta, masks), missing, options, on_progress=on_progress
    )


def shard_label(shard: str, key: str, cls_text: str | None) -> int:
    """A WebDataset sample's label: the integer of its ``.cls`` member, -1 without one."""
    try:
        return int(cls_text) if cls_text else -1
    except ValueError as err:
        raise ValueError(
            f"{shard}/{key}.cls holds {cls_text!r}, not an integer class index."
        ) from err


def build_samples(
    cls: type[S],
    inputs: Sequence[Input],
    samples: Samples,
    missing: Sequence[str],
    options: BuildOptions,
    *,
    on_progress: Callable[..., None] | None,
) -> S:
    """The store of WebDataset samples read out of their shards; ``missing``: the samples with
    no image member, left out (logged)."""
    if missing:
        log.warning(
            "gpucache: %d WebDataset samples have no image member (extensions %s), left out: %s",
            len(missing),
            ", ".join(WDS_IMAGE_EXTS),
            ", ".join(missing[:10]),
        )
    return build(cls, inputs, samples, options, on_progress=on_progress)


class _HFImage:
    """Row ``row`` of a Hugging Face dataset's image column (bytes left encoded), as a Source."""

    def __init__(self, table: Any, row: int, column: str, nbytes: int, name: str) -> None:
        # table: a pyarrow Table (pyarrow is read as untyped)
        self._table, self._row, self._column = table, row, column
        self.name, self.nbytes = name, nbytes

    def readinto(self, slot: memoryview) -> None:
        try:
            cell = self._table[self._row].column(self._column)[0]["bytes"]
            slot[:] = memoryview(cell.as_buffer()).cast("B")  # Arrow's buffer, copied once
        except MemoryError:  # the machine's problem, not a bad sample
            raise
        except Exception as err:  # the build reports OSError as this sample's skip reason
            raise OSError(f"cannot read row {self._row} of the dataset: {err}") from err


def from_hf(
    cls: type[S],
    dataset: Any,  # a datasets.Dataset (datasets is read as untyped)
    options: BuildOptions,
    *,
    image_column: str = "image",
    label_column: str | None = "label",
    classes: Sequence[str] | None = None,
    mask_column: str | None = None,
) -> S:
    """A Hugging Face ``datasets.Dataset`` with an ``Image`` feature; the encoded bytes are taken
    as they are stored (``Image(decode=False)``: no decode, no re-encode). Labels from
    ``label_column`` (a ``ClassLabel`` gives the class names) or -1 without one; masks from
    ``mask_column``, another ``Image`` column, taken the same way."""
    import pyarrow.compute as pc
    from datasets import ClassLabel, Image

    ds = dataset
    for column, what in ((image_column, "image_column"), (mask_column, "mask_column")):
        if column is None:
            continue
        if column not in dataset.features:
            raise ValueError(
                f"the dataset has no column {column!r} (columns: "
                f"{list(dataset.features)}); pass {what}=."
            )
        if not isinstance(dataset.features[column], Image):
            raise ValueError(
                f"column {column!r} is a {dataset.features[column]!r}, not a "
                "datasets.Image feature."
            )
        ds = ds.cast_column(column, Image(decode=False))
    table = ds.with_format("arrow")
    n, chunk = len(ds), 4096
    inputs: list[Input] = []
    masks: list[Input | None] | None = None if mask_column is None else []
    for start in tqdm(
        range(0, n, chunk),
        desc="gpucache scan dataset",
        unit="chunk",
        disable=not options.progress or None,
        leave=False,
    ):
        part = table[start : start + chunk]
        inputs.extend(_hf_inputs(pc, part, table, image_column, start, ""))
        if masks is not None:
            assert mask_column is not None  # masks is a list only with a mask column
            masks.extend(_hf_inputs(pc, part, table, mask_column, start, "mask "))
    if label_column is not None and label_column in ds.features:
        labels = np.asarray(ds.with_format("numpy")[label_column], dtype=np.int64)
        feature = ds.features[label_column]
        if classes is None and isinstance(feature, ClassLabel):
            classes = feature.names
    elif label_column not in (None, "label"):
        raise ValueError(
            f"the dataset has no column {label_column!r} (columns: "
            f"{list(ds.features)}); pass label_column=None for unlabeled data."
        )
    else:
        labels = None
    labels_arr, names = check_labels(n, labels, classes)
    return build(cls, inputs, Samples(labels_arr, names, None, masks), options)


def _hf_inputs(pc: Any, part: Any, table: Any, column: str, start: int, what: str) -> list[Input]:
    # pc: pyarrow.compute, part and table: pyarrow Tables (pyarrow is read as untyped)
    """The build inputs of ``column``'s cells in ``part`` (rows from ``start``) of ``table``:
    the stored bytes, or the file a cell points to (a missing one is reported)."""
    col = part.column(column)
    sizes = pc.binary_length(pc.struct_field(col, "bytes")).fill_null(-1).to_numpy()
    paths = pc.struct_field(col, "path").to_pylist()
    out: list[Input] = []
    for k, (size, p) in enumerate(zip(sizes.tolist(), paths)):
        i = start + k
        name = f"hf[{i}] {what}".rstrip() + (f" {p}" if p else "")
        if size >= 0:
            out.append(_HFImage(table, i, column, size, name))
        else:
            out.append(p if p else BytesSource(name, b""))
    return out


def given(
    n: int,
    labels: npt.ArrayLike | None,
    classes: Sequence[str] | None,
    metadata: Sequence[Any] | None,
    masks: Sequence[Any] | None = None,
) -> Samples:
    """The labels, metadata and masks given for ``n`` items (``from_files``), checked: one
    label, one string and one mask per item; each mask a path, bytes-like or file-like."""
    labels_arr, names = check_labels(n, labels, classes)
    if masks is not None and len(masks) != n:
        raise ValueError(
            f"masks has {len(masks)} entries for {n} items; give one mask per item (or masks=None)."
        )
    if metadata is not None and len(metadata) != n:
        raise ValueError(
            f"metadata has {len(metadata)} entries for {n} items; "
            "give one string per item (or metadata=None)."
        )
    return Samples(
        labels_arr,
        names,
        None if metadata is None else [str(m) for m in metadata],
        None if masks is None else [as_input(m, i, "mask") for i, m in enumerate(masks)],
    )


def from_files(
    cls: type[S],
    items: Sequence[Any],
    samples: Samples,
    options: BuildOptions,
    *,
    on_progress: Callable[[int, int, int], None] | None = None,
) -> S:
    """``from_files`` with paths, bytes-like or file-like items (mixed freely), with their
    labels, metadata and masks (``given``)."""
    inputs = [as_input(x, i) for i, x in enumerate(items)]
    return build(cls, inputs, samples, options, on_progress=on_progress)
