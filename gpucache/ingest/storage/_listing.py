"""Listings of objects in storage, paged and bounded: the :class:`~._client.Listing` a build
fetches (``from_folder``, ``from_files``, ``from_csv``, ``from_webdataset``).

On S3 gpucache asks for each page itself (``_pages``: ``ListObjectsV2``, 1,000 keys a page), so that

- every page is retried like a GET (``_calls.retrying``); a page that still fails, or that the
  client cannot parse, stops the build with an :class:`~gpucache.ObjectStoreError` naming the
  prefix: a listing never leaves a folder out;
- a listing is bounded: keys come in S3's ascending order and a continuation token never comes
  twice (a server that repeats itself is stopped at its first repeat), and one listing holds at
  most ``MAX_OBJECTS`` objects in ``MAX_PAGES`` pages (a paginator that never ends is stopped);
- each page is packed as it comes (names as bytes, sizes and ETag hashes in arrays): no dict or
  ``str`` is kept an object;
- objects named by a list (``from_files``) are looked up by name: a HEAD request each for a few
  in one folder, else pages that start at the next name sought (``StartAfter``), skipping the
  objects between, so a lookup costs at most one request a name and never lists a whole folder.

Other services (GCS, Azure) are listed a folder at a time through fsspec's ``ls``, every
folder's listing retried and a lasting failure raised with the folder's prefix (a sub-folder
never left out), within ``MAX_OBJECTS``, and lists of URLs with a request an object.
"""

from __future__ import annotations

import logging
import os
import re
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from ...base._threads import ordered_map
from .._build import IMG_EXTENSIONS, PathList
from .._patterns import expand_braces
from . import _pages
from ._calls import call
from ._client import (
    Listed,
    Listing,
    _tag_hash,
    bucket_of,
    filesystem,
    protocol_of,
    redact,
    strip,
    tag_of,
)
from ._pages import Prefix, _Budget, _entries, _folders, _page, _Tokens

log = logging.getLogger(__name__)

#: Listing requests in flight (one a class folder, or one a run of URLs of a list).
LIST_THREADS = 32
_NAME = "gpucache-list"  # the listing threads' name
#: A folder named by at least this many consecutive URLs of a list is looked up in pages that
#: start at the names sought; fewer are asked for one by one (a HEAD request each).
LIST_FOLDER_FROM = 32


def _order(name: str) -> tuple[int, str, str]:
    """ImageFolder's order of a name in a class folder: its own files first (by name), then each
    sub-folder's by folder path (``os.walk`` sorted) and name."""
    cut = name.rfind("/")
    return (0, "", name) if cut < 0 else (1, name[:cut], name[cut + 1 :])


class _Names:
    """Names relative to one prefix, with sizes and ETag hashes, packed as they are listed."""

    def __init__(self) -> None:
        self.blob, self.ends = bytearray(), array("Q")
        self.sizes, self.tags = array("q"), array("Q")
        self.last: tuple[int, str, str] | None = None
        self.in_order = True

    def __len__(self) -> int:
        return len(self.ends)

    def add(self, name: str, size: int, tag: int) -> None:
        self.blob += os.fsencode(name)
        self.ends.append(len(self.blob))
        self.sizes.append(size)
        self.tags.append(tag)
        key = _order(name)
        if self.last is not None and key < self.last:
            self.in_order = False
        self.last = key

    @classmethod
    def of(cls, names: list[str], sizes: array[int], tags: array[int]) -> _Names:
        """Names as given (no order kept), with their sizes and ETag hashes."""
        out = cls()
        for n in names:
            out.blob += os.fsencode(n)
            out.ends.append(len(out.blob))
        out.sizes, out.tags = sizes, tags
        return out

    def name(self, i: int) -> str:
        return os.fsdecode(bytes(self.blob[self.ends[i - 1] if i else 0 : self.ends[i]]))

    def ordered(self) -> _Names:
        """These names in ImageFolder's order (``self`` when the listing gave them so)."""
        if self.in_order:
            return self
        names = [self.name(i) for i in range(len(self))]
        out = _Names()
        for i in sorted(range(len(names)), key=lambda i: _order(names[i])):
            out.add(names[i], self.sizes[i], self.tags[i])
        return out


class _Packer:
    """Objects appended prefix by prefix into a :class:`~._client.Listing`."""

    def __init__(self) -> None:
        self.prefixes: list[str] = []
        self.blob = bytearray()
        self.folder_of, self.ends = array("I"), array("Q")
        self.sizes, self.tags = array("q"), array("Q")

    def add(self, prefix: str, names: _Names) -> None:
        if not len(names):
            return
        self.folder_of.extend(array("I", [len(self.prefixes)]) * len(names))
        self.prefixes.append(prefix)
        base = len(self.blob)
        self.blob += names.blob
        self.ends.extend(e + base for e in names.ends)
        self.sizes.extend(names.sizes)
        self.tags.extend(names.tags)

    def listing(self, protocol: str, listed: Listed) -> Listing:
        blob, self.blob = bytes(self.blob), bytearray()
        urls = PathList(self.prefixes, self.folder_of, self.ends, blob)
        sizes = np.frombuffer(self.sizes, dtype=np.int64) if len(self.sizes) else np.zeros(0, int)
        tags = np.frombuffer(self.tags, dtype=np.uint64) if len(self.tags) else np.zeros(0, "u8")
        return Listing(protocol, urls, sizes, tags, listed=listed)


def list_folder(
    url: str, storage_options: dict[str, Any] | None, fs: Any = None
) -> tuple[Listing, np.ndarray, list[str]]:
    """Objects, labels and class names of an ImageFolder layout under a prefix, in the order
    ``torchvision.datasets.ImageFolder`` gives the same tree on a disk (classes sorted; in each,
    folders sorted by path and files by name; the same extensions). Each class folder is listed
    whole (its sub-folders too, a key with ``//`` or any character included), ``LIST_THREADS``
    at a time; a class whose listing fails stops the build."""
    proto = protocol_of(url)
    fs = fs or filesystem(url, storage_options)
    bucket, _, key = strip(url).partition("/")
    prefix = key.rstrip("/") + "/" if key.strip("/") else ""
    base = f"{proto}://{bucket}/"
    budget = _Budget(redact(url))
    classes = sorted(_folders(fs, url, bucket, prefix, budget))
    if not classes:
        raise FileNotFoundError(
            f"no class folders under {redact(url)}: from_folder expects the ImageFolder "
            "layout PREFIX/<class>/<image> (objects named PREFIX/ants/1.jpg, ...)"
        )

    def one_class(name: str) -> _Names:
        where = f"{prefix}{name}/"
        names = _Names()
        with budget.stops_all():
            for page in _entries(fs, base + where, bucket, where, budget):
                for k, size, tag in page:
                    rel = k[len(where) :]
                    if rel.lower().endswith(IMG_EXTENSIONS):
                        names.add(rel, size, tag)
        return names.ordered()

    pack = _Packer()
    counts = np.zeros(len(classes), dtype=np.int64)
    for label, names in enumerate(ordered_map(one_class, classes, LIST_THREADS, name=_NAME)):
        pack.add(f"{base}{prefix}{classes[label]}/", names)
        counts[label] = len(names)
    empty = [c for c, k in zip(classes, counts) if k == 0]
    if len(empty) == len(classes):
        raise FileNotFoundError(
            f"found no image under {redact(url)}: none of its {len(classes)} class folders holds "
            f"an object ending in {', '.join(IMG_EXTENSIONS)}; from_folder expects "
            "PREFIX/<class>/<image>"
        )
    if empty:
        log.warning(
            "gpucache: %d class folders of %s hold no image and keep their label with no "
            "sample: %s",
            len(empty),
            redact(url),
            ", ".join(empty[:10]),
        )
    listing = pack.listing(
        proto, Listed(redact(url), fs, lambda: list_folder(url, storage_options, fs)[0])
    )
    labels = np.repeat(np.arange(len(classes), dtype=np.int64), counts)
    return listing, labels, classes


def _named(
    fs: Any, folder: str, run: Sequence[str], budget: _Budget
) -> tuple[array[int], array[int]]:
    """Sizes and ETag hashes of the objects ``run`` names in ``folder`` (size -1: none), from
    pages that start at the next name sought: at most one request a name, and never more than
    the folder's listing between the first name and the last."""
    bucket, _, prefix = strip(folder).partition("/")
    cut, k = len(folder), len(run)
    sizes, tags = array("q", [-1]) * k, array("Q", [0]) * k
    order = sorted(range(k), key=run.__getitem__)  # the same folder: the names' order
    tokens, token, j, last = _Tokens(folder), None, 0, ""
    while j < k and not run[order[j]][cut:]:
        j += 1  # the folder itself: no object
    while j < k:
        after = prefix + run[order[j]][cut:][:-1]  # just before the next name sought
        if token is None or after > last:  # skip the objects up to it
            token, last = None, max(after, last)
        where = Prefix(folder, bucket, prefix)
        page, _, token = _page(fs, where, budget, after=last, token=token)
        for key, size, tag in page:
            name = key[len(prefix) :]
            while j < k and run[order[j]][cut:] < name:
                j += 1  # not there
            while j < k and run[order[j]][cut:] == name:
                sizes[order[j]], tags[order[j]] = size, tag
                j += 1
            last = key
        if token is None:
            break
        tokens.check(token)
    return sizes, tags


def list_urls(
    urls: Sequence[str], storage_options: dict[str, Any] | None, *, fs: Any = None
) -> Listing:
    """Size and ETag of each URL of a list (``from_files``, ``from_csv``), in the list's order.

    Consecutive URLs of one folder are looked up by name: in pages that start at each name
    sought when there are at least ``LIST_FOLDER_FROM`` of them (S3), else each with a HEAD
    request; ``LIST_THREADS`` requests at once. A URL with no object is kept as missing (a bad
    sample with that reason, never a hole)."""
    urls = [os.fspath(u) for u in urls]
    protos = {protocol_of(u) for u in urls}
    if len(protos) > 1:
        raise ValueError(
            f"the list mixes URL schemes ({', '.join(sorted(protos))}); build one store per "
            "storage service, or copy the data to one"
        )
    proto = protos.pop() if protos else "s3"
    fs = fs or filesystem(urls[0] if urls else "s3://", storage_options)
    where = f"{len(urls):,} URLs" + (f" ({bucket_of(urls[0])})" if urls else "")
    budget = _Budget(where)
    paged = _pages._paged(fs, strip(urls[0]).split("/", 1)[0] if urls else "")

    def tasks() -> Iterator[tuple[str, list[str]]]:
        for folder, run in _runs(urls):
            if paged and len(run) >= LIST_FOLDER_FROM:
                yield folder, run
            else:
                yield from ((folder, [u]) for u in run)

    def look_up(task: tuple[str, list[str]]) -> tuple[str, list[str], array[int], array[int]]:
        folder, run = task
        with budget.stops_all():
            if len(run) > 1:
                return folder, run, *_named(fs, folder, run, budget)
            try:
                info = call(run[0], lambda: fs.info(strip(run[0])), "read")
            except FileNotFoundError:
                info = None
        if info is None or info.get("type") != "file":
            return folder, run, array("q", [-1]), array("Q", [0])
        return folder, run, array("q", [int(info["size"])]), array("Q", [_tag_hash(tag_of(info))])

    pack = _Packer()
    for folder, run, sizes, tags in ordered_map(look_up, tasks(), LIST_THREADS, name=_NAME):
        pack.add(folder, _Names.of([u[len(folder) :] for u in run], sizes, tags))
    listing = pack.listing(
        proto, Listed(where, fs, lambda: list_urls(urls, storage_options, fs=fs))
    )
    missing = np.flatnonzero(listing.sizes < 0)
    listing.missing = {
        int(i): "no such object (check the URL; as listed when the build began)" for i in missing
    }
    return listing


def _runs(urls: Sequence[str]) -> Iterator[tuple[str, list[str]]]:
    """``(folder URL with its slash, consecutive URLs in it)``."""
    run: list[str] = []
    folder = None
    for u in urls:
        f = u.rpartition("/")[0] + "/"
        if f != folder and run:
            yield folder, run  # type: ignore[misc]
            run = []
        folder = f
        run.append(u)
    if run:
        yield folder, run  # type: ignore[misc]


def _glob(fs: Any, url: str, budget: _Budget) -> list[str]:
    """The keys (``bucket/key``) a glob pattern matches, from a bounded listing of the pattern's
    fixed part (fsspec's glob rules: ``*`` and ``?`` stay within a folder)."""
    from fsspec.utils import glob_translate  # type: ignore[import-untyped]

    bucket, _, pattern = strip(url).partition("/")
    fixed = re.split(r"[*?\[]", pattern, maxsplit=1)[0]
    match = re.compile(glob_translate(pattern)).match
    folder = fixed.rpartition("/")[0] + "/" if "/" in fixed else ""
    # S3's pages start at any key prefix; other clients are listed folder by folder (not by
    # fsspec's glob, whose walk leaves out a sub-folder whose listing fails)
    start = fixed if _pages._paged(fs, bucket) else folder
    keys = [
        f"{bucket}/{key}"
        for page in _entries(fs, f"{protocol_of(url)}://{bucket}/{folder}", bucket, start, budget)
        for key, _, _ in page
        if match(key)
    ]
    return sorted(keys)


def list_shards(shards: Iterable[str], storage_options: dict[str, Any] | None) -> Listing:
    """Size and ETag of each shard: brace patterns expanded (``{000..003}``, ``{a,b}``), glob
    patterns (``*``, ``?``) matched against the bucket's listing."""
    expanded: list[str] = []
    fs: Any = None
    for pattern in shards:
        for u in expand_braces(pattern):
            if any(c in strip(u) for c in "*?["):
                fs = fs or filesystem(u, storage_options)
                matched = _glob(fs, u, _Budget(redact(u)))
                if not matched:
                    raise FileNotFoundError(f"no object matches {redact(u)}")
                expanded += [f"{protocol_of(u)}://{m}" for m in matched]
            else:
                expanded.append(u)
    return list_urls(expanded, storage_options, fs=fs)
