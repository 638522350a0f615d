"""Listings of objects in storage against a hostile S3 server on 127.0.0.1 (moto's, behind the
fault layer of ``tests/support/s3server.py``, which also answers listings moto never would).

- a listing of one class or nested folder that keeps failing (403, 500, a server that never
  answers, a page that is not XML, a key the client cannot parse) stops the build with an
  ``ObjectStoreError`` naming the prefix, and publishes nothing; one 503 SlowDown is retried;
  the same for a sub-folder of a class on the clients listed folder by folder (GCS, Azure);
- a paginator that never ends, or one that repeats itself, is stopped with a clear error;
- a listing costs bytes an object, not kilobytes: no dict is kept an object, the pages' temporaries
  are freed;
- ``from_files`` looks objects up by name: 40 URLs in a folder of 200,000 objects cost 40
  requests, not the folder's 200 pages;
- keys with ``//`` or control characters are stored like any other, in ImageFolder's order.
"""

from __future__ import annotations

import gc
import time
import tracemalloc
from pathlib import Path

import pytest

pytest.importorskip("moto.server")
pytest.importorskip("s3fs")

from gpucache import JpegCache, ObjectStoreError  # noqa: E402
from gpucache.ingest.storage import _calls, _listing, _pages  # noqa: E402
from gpucache.ingest.storage._client import filesystem  # noqa: E402
from gpucache.testing import make_jpeg_bytes  # noqa: E402
from tests.support.s3server import VirtualFolder, serving  # noqa: E402

BUCKET = "lst"  # moto's buckets are per process: one of this module's own
FOLD = {  # prefix fold/: 3 classes, one with a nested folder
    f"fold/{c}/{sub}{i}.jpg": make_jpeg_bytes(24, 16, seed=10 * k + i)
    for k, (c, sub) in enumerate((("a", ""), ("b", ""), ("c", ""), ("c", "sub/")))
    for i in range(3)
}
NAMES = {  # keys a disk could not hold, listed out of ImageFolder's order
    f"names/{k}": make_jpeg_bytes(20, 20, seed=i)
    for i, k in enumerate(
        ["a/x.jpg", "a//y.jpg", "a/z\x01.jpg", "b/\x1bw.jpg", "b/sub/v.jpg", "b/sub-x/u.jpg"]
        + ["b/t\r.jpg"]
    )
}
GLOB = "s3://lst/fold/**/*.jpg"  # every image of FOLD, at any depth
IDS = {f"ids/{i:03d}.jpg": make_jpeg_bytes(16, 16, seed=100 + i) for i in range(40)}


@pytest.fixture(scope="module")
def s3():
    with serving("lst", {**FOLD, **NAMES, **IDS}) as (server, _):
        yield server


@pytest.fixture
def server(s3):
    with s3.faulty():
        s3.reset_counts()
        yield s3


@pytest.fixture
def fast_retries(monkeypatch):
    monkeypatch.setattr(_calls, "BACKOFF_S", 0.01)
    monkeypatch.setattr(_calls, "BACKOFF_CAP_S", 0.05)


def _nothing_published(folder: Path) -> None:
    assert not list(folder.glob("*.gpucache")), sorted(p.name for p in folder.iterdir())


def _stored(cache: JpegCache) -> dict[str, bytes]:
    return {cache.paths[i]: bytes(cache[i]) for i in range(len(cache))}


# ----------------------------------------------------------------- a listing that keeps failing
@pytest.mark.parametrize(
    "status,code",
    [
        (500, "InternalError"),
        (403, "AccessDenied"),
        # a transient error like 500 (retried, then the build stops): the 500 case runs that
        # path, and test_a_slowdown_on_a_listing_is_retried the 503 SlowDown answer itself
        pytest.param(503, "SlowDown", marks=pytest.mark.slow),
    ],
)
def test_a_class_listing_that_keeps_failing_stops_the_build(
    server, tmp_path, fast_retries, status, code
):
    server.fail_listing("status", "fold/b", times=None, status=status, code=code, bucket=BUCKET)
    with pytest.raises(ObjectStoreError, match="s3://lst/fold/b/") as err:
        JpegCache.from_folder("s3://lst/fold/", cache_dir=tmp_path, progress=False)
    assert f"HTTP {status}" in str(err.value) and "gpucache-test-secret" not in str(err.value)
    _nothing_published(tmp_path)


def test_a_nested_folder_is_in_its_class_listing(server, tmp_path, fast_retries):
    """A class folder is listed whole: a fault on its sub-folder's own listing (which a walk
    would ask for, and leave out) cannot take those objects out of the store."""
    server.fail_listing(
        "status", "fold/c/sub", times=None, status=500, code="InternalError", bucket=BUCKET
    )
    cache = JpegCache.from_folder("s3://lst/fold/", cache_dir=tmp_path, progress=False)
    assert _stored(cache) == {f"s3://lst/{k}": v for k, v in FOLD.items()}
    assert cache.labels.tolist() == [0] * 3 + [1] * 3 + [2] * 6


def test_a_slowdown_on_a_listing_is_retried(server, tmp_path, fast_retries):
    server.fail_listing("status", "fold/a", times=2, bucket=BUCKET)  # 503 SlowDown, twice
    cache = JpegCache.from_folder("s3://lst/fold/", cache_dir=tmp_path, progress=False)
    assert len(cache) == len(FOLD) and not server.faults.rules


def test_a_listing_that_never_answers_stops_the_build(server, tmp_path, monkeypatch):
    monkeypatch.setattr(_calls, "RETRIES", 1)
    server.fail_listing("delay", "fold/c", times=None, seconds=5, bucket=BUCKET)
    t0 = time.monotonic()
    with pytest.raises(ObjectStoreError, match=r"s3://lst/fold/c/.*(?i:timeout)"):
        JpegCache.from_folder(
            "s3://lst/fold/",
            cache_dir=tmp_path,
            progress=False,
            storage_options={"config_kwargs": {"read_timeout": 0.5, "connect_timeout": 1}},
        )
    assert time.monotonic() - t0 < 30
    _nothing_published(tmp_path)


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"<ListBucketResult><Contents><Key>fold/c/1.jpg", id="garbage"),  # not XML
        # the client's parser fails on it as on the cut-short page (the same error, retried
        # and then stopping the build): the garbage case covers that path
        pytest.param(
            b'<?xml version="1.0"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            b"<Name>lst</Name><IsTruncated>false</IsTruncated><Contents><Key>fold/c/\x01.jpg</Key>"
            b"<Size>9</Size></Contents></ListBucketResult>",  # a control character, not URL-encoded
            id="raw-control-character",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_a_page_the_client_cannot_parse_stops_the_build(server, tmp_path, fast_retries, body):
    server.answer(lambda env: (200, body), lambda q: "prefix=fold%2Fc" in q, bucket=BUCKET)
    with pytest.raises(ObjectStoreError, match="s3://lst/fold/c/"):
        JpegCache.from_folder("s3://lst/fold/", cache_dir=tmp_path, progress=False)
    _nothing_published(tmp_path)


def test_a_failing_listing_stops_the_build_through_fsspec_too(
    server, tmp_path, fast_retries, monkeypatch
):
    """Services gpucache does not page itself (GCS, Azure) are walked with errors raised."""
    monkeypatch.setattr(_pages, "_paged", lambda fs, bucket: False)
    server.fail_listing(
        "status", "fold/b", times=None, status=500, code="InternalError", bucket=BUCKET
    )
    with pytest.raises(ObjectStoreError, match="s3://lst/fold/b/"):
        JpegCache.from_folder("s3://lst/fold/", cache_dir=tmp_path, progress=False)
    _nothing_published(tmp_path)
    server.clear_faults()
    cache = JpegCache.from_folder("s3://lst/fold/", cache_dir=tmp_path, progress=False)
    assert _stored(cache) == {f"s3://lst/{k}": v for k, v in FOLD.items()}


@pytest.mark.parametrize("status,code", [(403, "AccessDenied"), (500, "InternalError")])
def test_a_sub_folder_whose_listing_keeps_failing_stops_the_build_through_fsspec(
    server, tmp_path, fast_retries, monkeypatch, status, code
):
    """Listed folder by folder (fsspec's walk would leave the sub-folder out without a word:
    it does not hand on_error on to its recursion), a denial that lasts names the sub-folder."""
    monkeypatch.setattr(_pages, "_paged", lambda fs, bucket: False)
    server.fail_listing("status", "fold/c/sub", times=99, status=status, code=code, bucket=BUCKET)
    with pytest.raises(ObjectStoreError, match="s3://lst/fold/c/sub/") as err:
        JpegCache.from_folder("s3://lst/fold/", cache_dir=tmp_path, progress=False)
    assert f"HTTP {status}" in str(err.value) and "gpucache-test-secret" not in str(err.value)
    _nothing_published(tmp_path)
    with pytest.raises(ObjectStoreError, match="s3://lst/fold/c/sub/"):  # a glob of shards too
        _listing._glob(filesystem("s3://lst/", None), GLOB, _pages._Budget("fold"))


def test_one_slowdown_on_a_sub_folder_is_retried_through_fsspec(
    server, tmp_path, fast_retries, monkeypatch
):
    monkeypatch.setattr(_pages, "_paged", lambda fs, bucket: False)
    server.fail_listing("status", "fold/c/sub", times=1, bucket=BUCKET)  # one 503 SlowDown
    cache = JpegCache.from_folder("s3://lst/fold/", cache_dir=tmp_path, progress=False)
    assert _stored(cache) == {f"s3://lst/{k}": v for k, v in FOLD.items()}
    assert not server.faults.rules  # the 503 was served, and retried
    keys = _listing._glob(filesystem("s3://lst/", None), GLOB, _pages._Budget("fold"))
    assert keys == sorted(f"lst/{k}" for k in FOLD)


# -------------------------------------------------------------------------- bounded listings
def test_a_paginator_that_never_ends_is_stopped(server, tmp_path, monkeypatch):
    monkeypatch.setattr(_pages, "MAX_OBJECTS", 5_000)
    endless = VirtualFolder("lst", "endless", None)
    server.answer(endless, endless.matches, bucket=BUCKET)
    with pytest.raises(ObjectStoreError, match=r"s3://lst/endless/.*5,000"):
        JpegCache.from_folder("s3://lst/endless/", cache_dir=tmp_path, progress=False)
    assert server.lists(BUCKET) <= 8  # the class folders, then 5 pages of 1,000 (and the 6th)


def test_a_paginator_that_repeats_itself_is_stopped_at_once(server, tmp_path):
    looping = VirtualFolder("lst", "loop", 50_000, repeat=True)
    server.answer(looping, looping.matches, bucket=BUCKET)
    with pytest.raises(ObjectStoreError, match=r"s3://lst/loop/c/.*repeat"):
        JpegCache.from_folder("s3://lst/loop/", cache_dir=tmp_path, progress=False)
    assert server.lists(BUCKET) <= 4


def test_a_listing_costs_bytes_an_object_and_frees_its_pages(server):
    """Folders of 2,000 and 6,000 objects: a listing keeps its packed arrays and names (28
    bytes an object plus the name; the label 8 more), the pages it was made of are gone, and
    each object more raises its peak by about what it keeps (old: 1.2 KB, a dict each)."""
    sizes = (2_000, 6_000)
    for n in (*sizes, 500):
        folder = VirtualFolder("lst", f"big{n}", n)
        server.answer(folder, folder.matches, bucket=BUCKET)
    fs = filesystem("s3://lst/", None)
    _listing.list_folder("s3://lst/big500/", None, fs)  # the client's own state, made once
    kept, peak = [], []
    for n in sizes:
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            listing, labels, classes = _listing.list_folder(f"s3://lst/big{n}/", None, fs)
            gc.collect()
            now, high = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert len(listing) == n and listing.urls[17] == f"s3://lst/big{n}/c/0000000017.jpg"
        kept.append(now - before)
        peak.append(high - before)
        del listing, labels
    name, more = len("0000000017.jpg"), sizes[1] - sizes[0]
    per_kept, per_peak = (kept[1] - kept[0]) / more, (peak[1] - peak[0]) / more
    print(f"kept {per_kept:.1f} B, peak {per_peak:.1f} B an object more")
    assert per_kept < 28 + 8 + name + 12
    assert per_peak < 2 * (28 + 8 + name) + 100


# ------------------------------------------------------------------------ named objects by name
def test_named_objects_are_looked_up_by_name_not_by_listing_their_folder(server):
    big = VirtualFolder("lst", "wide", 200_000, page=100)  # pages of 100 keys: cheap to make
    server.answer(big, big.matches, bucket=BUCKET)
    urls = [f"s3://lst/wide/c/{i:010d}.jpg" for i in range(0, 200_000, 5_000)]  # 40 names
    listing = _listing.list_urls(urls + ["s3://lst/wide/c/x.jpg"], None)
    assert list(listing.urls) == urls + ["s3://lst/wide/c/x.jpg"]
    assert listing.sizes.tolist() == [1000] * 40 + [-1] and list(listing.missing) == [40]
    assert server.lists(BUCKET) <= 41  # a page a name at most (the whole folder: 2,000 pages)


def test_from_files_by_name_across_pages(server, tmp_path, monkeypatch):
    """Pages of 4 keys: the lookup skips ahead, follows tokens and finds every name that
    exists, in the list's order, and reports the rest."""
    monkeypatch.setattr(_pages, "PAGE_KEYS", 4)
    names = sorted(IDS)
    chosen = names[30:] + names[:3] + names[10:25:2] + names[26:28] + names[27:28]
    chosen += ["ids/000.jp", "ids/100.jpg", "ids/015.jpgx"]  # no such objects
    urls = [f"s3://lst/{k}" for k in chosen]
    cache = JpegCache.from_files(urls, cache_dir=tmp_path, progress=False)
    kept = [k for k in chosen if k in IDS]  # 027 twice
    assert list(cache.paths) == [f"s3://lst/{k}" for k in kept]
    assert [bytes(cache[i]) for i in range(len(cache))] == [IDS[k] for k in kept]
    assert {s.path: s.reason[:14] for s in cache.report.skipped} == dict.fromkeys(
        urls[-3:], "no such object"
    )
    assert cache.report.total == len(urls)


# ------------------------------------------------------------------------------------- names
def test_keys_a_disk_could_not_hold_are_stored_in_imagefolder_order(server, tmp_path):
    cache = JpegCache.from_folder("s3://lst/names/", cache_dir=tmp_path, progress=False)
    order = ["a/x.jpg", "a/z\x01.jpg", "a//y.jpg"]  # the class folder's files, then '/'s
    order += ["b/\x1bw.jpg", "b/t\r.jpg", "b/sub/v.jpg", "b/sub-x/u.jpg"]
    assert list(_stored(cache).items()) == [
        (f"s3://lst/names/{k}", NAMES[f"names/{k}"]) for k in order
    ]
    assert cache.classes == ["a", "b"] and cache.labels.tolist() == [0] * 3 + [1] * 4


def test_glob_patterns_are_matched_against_a_bounded_listing(server, monkeypatch):
    monkeypatch.setattr(_pages, "PAGE_KEYS", 4)
    listing = _listing.list_shards(["s3://lst/ids/0[0-1]?.jpg", "s3://lst/ids/03*"], None)
    want = [k for k in sorted(IDS) if k[4:6] in ("00", "01")] + [
        f"ids/03{i}.jpg" for i in range(10)
    ]
    assert list(listing.urls) == [f"s3://lst/{k}" for k in want]
    assert listing.sizes.tolist() == [len(IDS[k]) for k in want]
    with pytest.raises(FileNotFoundError, match="no object matches s3://lst/ids/9"):
        _listing.list_shards(["s3://lst/ids/9*.jpg"], None)
