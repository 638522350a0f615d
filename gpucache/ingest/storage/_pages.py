"""The pages of one S3 listing, asked for by gpucache itself (``ListObjectsV2``), checked and
bounded (see ``_listing``): each page retried like a GET; keys under the prefix, in S3's
ascending order; a continuation token never twice; at most ``MAX_OBJECTS`` objects in
``MAX_PAGES`` pages a listing. Clients gpucache does not page itself (GCS, Azure, S3 Express
directory buckets) are listed a folder at a time through fsspec's ``ls``, each folder's listing
retried and its failure raised (never fsspec's ``walk``, which leaves out a sub-folder whose
listing fails), within the same bounds.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any, NamedTuple

from ..._errors import ObjectStoreError
from ._calls import call
from ._client import _tag_hash, redact, tag_of

PAGE_KEYS = 1000  # keys asked for a page (S3's most)
#: Bounds of one listing (all its prefixes together): beyond them the build stops.
MAX_OBJECTS = 50_000_000
MAX_PAGES = 200_000

Entry = tuple[str, int, int]  # key (in its bucket), size, ETag hash


class _Budget:
    """The objects and pages one listing may take, shared by its threads; the first failure
    stops the others at their next page, with its reason."""

    def __init__(self, where: str) -> None:
        self.where, self.objects, self.pages = where, 0, 0
        self.lock = threading.Lock()
        self.error: BaseException | None = None

    def check(self, url: str) -> None:
        """Raise the listing's first failure, if another thread met one."""
        first = self.error
        if first is not None:
            raise ObjectStoreError(str(first), getattr(first, "url", url))

    def take(self, url: str, objects: int) -> None:
        with self.lock:
            self.pages += 1
            self.objects += objects
            over = self.objects > MAX_OBJECTS or self.pages > MAX_PAGES
        self.check(url)
        if over:
            raise _refuse(
                url,
                f"the listing of {self.where} passed {MAX_OBJECTS:,} objects or {MAX_PAGES:,} "
                f"pages ({self.objects:,} objects in {self.pages:,} pages) and was stopped, a "
                "bound that keeps a server whose pages never end from filling memory; build a "
                "data set this large from several prefixes (a store each) or from shards",
            )

    @contextmanager
    def stops_all(self) -> Iterator[None]:
        """A failure inside stops the listing's other threads at their next page."""
        try:
            yield
        except BaseException as err:
            with self.lock:
                self.error = self.error or err
            raise


def _refuse(url: str, why: str) -> ObjectStoreError:
    return ObjectStoreError(f"cannot list {redact(url)}: {why}; no store was published", url)


def _paged(fs: Any, bucket: str) -> bool:
    """Whether gpucache pages this client's listings itself: s3fs, but for S3 Express directory
    buckets (``*--x-s3``), whose listings come in no order and take no ``StartAfter``."""
    return callable(getattr(fs, "call_s3", None)) and not bucket.endswith("--x-s3")


class Prefix(NamedTuple):
    """What a listing request lists: ``url`` (named in errors), the ``bucket`` and the keys'
    ``prefix`` in it."""

    url: str
    bucket: str
    prefix: str


def _page(
    fs: Any,
    where: Prefix,
    budget: _Budget,
    *,
    after: str = "",
    token: str | None = None,
    delimiter: str = "",
) -> tuple[list[Entry], list[str], str | None]:
    """One ``ListObjectsV2`` page: its objects, its common prefixes and the next page's token
    (None: the last page). Keys must lie under ``prefix``, after ``after``, in order."""
    url, bucket, prefix = where
    kw: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix, "MaxKeys": PAGE_KEYS}
    if delimiter:
        kw["Delimiter"] = delimiter
    if token is not None:
        kw["ContinuationToken"] = token
    elif after:
        kw["StartAfter"] = after
    budget.check(url)
    page = call(url, lambda: fs.call_s3("list_objects_v2", **kw))
    contents = page.get("Contents") or []
    common = [p.get("Prefix", "") for p in page.get("CommonPrefixes") or []]
    budget.take(url, len(contents) + len(common))
    entries: list[Entry] = []
    last = after
    for c in contents:
        key = c.get("Key", "")
        if not key.startswith(prefix) or key <= last:
            raise _refuse(
                url,
                f"the server listed {key!r} after {last!r}, out of S3's order or outside the "
                "prefix (a server that repeats or reorders its pages); check the endpoint",
            )
        last = key
        entries.append((key, int(c.get("Size", 0)), _tag_hash(tag_of(c))))
    nxt = page.get("NextContinuationToken") if page.get("IsTruncated") else None
    if page.get("IsTruncated") and not nxt:
        raise _refuse(url, "the server marked a page truncated without a continuation token")
    return entries, common, nxt


class _Tokens:
    """The continuation tokens of one listing: a token that comes again is a loop."""

    def __init__(self, url: str) -> None:
        self.url, self.seen = url, set[int]()

    def check(self, token: str) -> str:
        h = _tag_hash(token)
        if h in self.seen:
            raise _refuse(
                self.url,
                f"the server repeated a continuation token after {len(self.seen):,} pages "
                "(a listing that would never end); check the endpoint",
            )
        self.seen.add(h)
        return token


def _entries(fs: Any, url: str, bucket: str, prefix: str, budget: _Budget) -> Iterator[list[Entry]]:
    """Every object under ``prefix``, a page at a time."""
    if not _paged(fs, bucket):
        yield from _walked(fs, url, bucket, prefix, budget)
        return
    tokens, token, last = _Tokens(url), None, ""
    while True:
        page, _, token = _page(fs, Prefix(url, bucket, prefix), budget, after=last, token=token)
        if page:
            last = page[-1][0]
        yield page
        if token is None:
            return
        tokens.check(token)


def _walked(fs: Any, url: str, bucket: str, prefix: str, budget: _Budget) -> Iterator[list[Entry]]:
    """Every object under the folder ``prefix`` through fsspec's ``ls``, one folder a page, for
    the clients gpucache does not page itself. Each folder's listing is retried like a GET and
    a failure that lasts (a denial, a 5xx after its retries) stops the listing with an
    :class:`ObjectStoreError` naming that folder: fsspec's own ``walk`` does not hand
    ``on_error`` on to its sub-folders, so there a sub-folder whose listing fails is left out
    of the listing without a word."""
    proto = url.split("://", 1)[0] if "://" in url else "s3"
    top = f"{bucket}/{prefix}".rstrip("/")
    folders = [top]
    while folders:
        path = folders.pop()
        where = f"{proto}://{path}/"
        budget.check(where)
        try:
            infos = call(where, partial(fs.ls, path, detail=True))
        except FileNotFoundError:
            if path == top:
                raise
            raise _refuse(
                where,
                "it was listed as a folder, and then its own listing said it does not exist "
                "(the prefix changed while it was listed); build again once it is stable",
            ) from None
        page: list[Entry] = []
        inner: list[str] = []
        for info in infos:
            name = str(info.get("name", "")).rstrip("/")
            if name == path:
                continue  # the folder itself
            if not name.startswith(path + "/"):
                raise _refuse(
                    where,
                    f"the server listed {name!r} in it, which is not under it (a server "
                    "that answers for another prefix); check the endpoint",
                )
            if info.get("type") == "directory":
                inner.append(name)
            elif info.get("type") == "file":
                page.append(
                    (name.split("/", 1)[1], int(info.get("size", 0)), _tag_hash(tag_of(info)))
                )
        budget.take(where, len(infos))
        folders.extend(sorted(inner, reverse=True))  # depth first, in name order
        yield page


def _folders(fs: Any, url: str, bucket: str, prefix: str, budget: _Budget) -> list[str]:
    """The names of the folders right under ``prefix``."""
    if not _paged(fs, bucket):
        try:
            top = call(url, lambda: fs.ls(f"{bucket}/{prefix}".rstrip("/"), detail=True))
        except FileNotFoundError:
            return []
        budget.take(url, len(top))
        return [
            e["name"].rstrip("/").rsplit("/", 1)[-1] for e in top if e.get("type") == "directory"
        ]
    names: list[str] = []
    tokens, token = _Tokens(url), None
    while True:
        where = Prefix(url, bucket, prefix)
        _, common, token = _page(fs, where, budget, token=token, delimiter="/")
        for p in common:
            name = p[len(prefix) : -1]
            if not p.startswith(prefix) or not p.endswith("/") or (names and name <= names[-1]):
                raise _refuse(url, f"the server listed the folder {p!r} out of order")
            names.append(name)
        if token is None:
            return names
        tokens.check(token)
