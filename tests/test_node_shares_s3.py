"""Node shares from object storage, in one process, against a real S3 server on 127.0.0.1
(moto's): each node fetches only its share (GET requests counted per object), images with their
masks and WebDataset shards too (read a window at a time, under a file-size limit that a spool of
every shard exceeds, only the share kept); a new node layout fetches only what the node's earlier
store lacks; a share that does not fit fetches nothing."""

from __future__ import annotations

import io
import resource
import tarfile
from collections import Counter

import numpy as np
import pytest

pytest.importorskip("moto.server")
pytest.importorskip("s3fs")

from gpucache import JpegCache, ShareError  # noqa: E402
from gpucache.shares._partition import node_bounds  # noqa: E402
from gpucache.testing import make_jpeg_bytes, make_mask_png  # noqa: E402
from tests.support.s3server import serving  # noqa: E402
from tests.test_node_shares import as_node  # noqa: E402

N = 17


def _png(seed: int) -> bytes:
    return make_mask_png(np.random.default_rng(seed).integers(0, 5, (16, 24), dtype=np.uint8))


@pytest.fixture(scope="module")
def s3():
    objects = {}
    tar = io.BytesIO()
    with tarfile.open(fileobj=tar, mode="w") as tf:
        for i in range(N):
            image = make_jpeg_bytes(24, 16, seed=100 + i)
            objects[f"train/c{i:02d}/x.jpg"] = image
            objects[f"seg/images/s{i:02d}.jpg"] = image
            objects[f"seg/masks/s{i:02d}.png"] = _png(i)
            for ext, blob in (("jpg", image), ("cls", str(i).encode())):
                info = tarfile.TarInfo(f"{i:04d}.{ext}")
                info.size = len(blob)
                tf.addfile(info, io.BytesIO(blob))
    objects["shards/train-0.tar"] = tar.getvalue()
    with serving("sharebkt", objects) as (server, _):
        yield server


SHARDS, PER_SHARD = 6, 10  # the windowed WebDataset set: a label a sample


def _wds_objects() -> tuple[dict[str, bytes], dict[int, tuple[bytes, bytes]]]:
    """SHARDS tars of PER_SHARD samples (a JPEG, its class, a PNG mask each), and each
    label's image and mask."""
    objects, samples = {}, {}
    for s in range(SHARDS):
        tar = io.BytesIO()
        with tarfile.open(fileobj=tar, mode="w") as tf:
            for i in range(PER_SHARD):
                label = s * PER_SHARD + i
                image = make_jpeg_bytes(96, 64, seed=500 + label)  # most of a tar's bytes
                mask = make_mask_png(
                    np.random.default_rng(label).integers(0, 5, (64, 96), dtype=np.uint8)
                )
                samples[label] = (image, mask)
                for ext, blob in (("jpg", image), ("cls", str(label).encode()), ("png", mask)):
                    info = tarfile.TarInfo(f"{label:04d}.{ext}")
                    info.size = len(blob)
                    tf.addfile(info, io.BytesIO(blob))
        objects[f"wds/part-{s}.tar"] = tar.getvalue()
    return objects, samples


def _build(server, nodes: int, node: int, tmp_path, url: str, **kw) -> tuple[JpegCache, Counter]:
    server.reset_counts()
    with as_node(nodes, node):
        cache = JpegCache.from_folder(
            url, shard="node", cache_dir=tmp_path / f"node{node}", progress=False, **kw
        )
    return cache, server.gets("/sharebkt/")


def test_each_node_fetches_its_share_and_a_new_layout_only_what_it_lacks(s3, tmp_path):
    two = [_build(s3, 2, k, tmp_path, "s3://sharebkt/train/") for k in range(2)]
    fetched = [set(gets) for _, gets in two]
    assert fetched[0].isdisjoint(fetched[1]) and len(fetched[0] | fetched[1]) == N
    for (cache, gets), k in zip(two, range(2)):
        assert set(gets.values()) == {1}  # each object of the share once
        assert len(cache) == len(gets) == np.diff(node_bounds(N, 2))[k]
        assert cache.node_share.fetched[0] == len(gets)
        assert cache.node_share.fetched[1] == sum(len(cache[i]) for i in range(len(cache)))
    labels = [set(c.labels.tolist()) for c, _ in two]
    assert labels[0].isdisjoint(labels[1])
    three = [_build(s3, 3, k, tmp_path, "s3://sharebkt/train/") for k in range(3)]
    old, new = node_bounds(N, 2), node_bounds(N, 3)
    for k, (cache, gets) in enumerate(three):
        mine = set(range(*new[k : k + 2]))
        before = set(range(*old[k : k + 2])) if k < 2 else set()
        objects = [p for p in gets if not p.endswith("/")]
        assert len(objects) == len(mine - before) == cache.node_share.fetched[0], k
        assert cache.node_share.fetched[2] == len(mine & before)
        assert sorted(cache.node_share.ranks.tolist()) == sorted(mine)
    assert not [p for p in three[0][1] if not p.endswith("/")]  # node 0 fetched no object
    whole = JpegCache.from_folder(
        "s3://sharebkt/train/", cache_dir=tmp_path / "whole", progress=False
    )
    by_label = {int(whole.labels[i]): bytes(whole[i]) for i in range(len(whole))}
    for cache, _ in three:  # what was taken from earlier stores is the source's bytes
        assert all(bytes(cache[i]) == by_label[int(cache.labels[i])] for i in range(len(cache)))


def test_images_and_their_masks_are_fetched_and_reused_together(s3, tmp_path):
    url, masks = "s3://sharebkt/seg/images/", "s3://sharebkt/seg/masks/"
    for k in range(2):
        _build(s3, 2, k, tmp_path, url, masks=masks)
    cache, gets = _build(s3, 3, 1, tmp_path, url, masks=masks)
    images = [p for p in gets if p.endswith(".jpg")]
    pngs = [p for p in gets if p.endswith(".png")]
    assert len(images) == len(pngs) == cache.node_share.fetched[0] > 0
    assert cache.node_share.fetched[2] > 0
    for i in range(len(cache)):
        stem = cache.paths[i].rsplit("/", 1)[1].removesuffix(".jpg")
        assert bytes(cache.masks[i]) == _png(int(stem[1:]))  # reused or fetched, its own mask


def test_webdataset_shards_in_storage_are_split_by_sample(s3, tmp_path):
    held = []
    for k in range(2):
        with as_node(2, k):
            cache = JpegCache.from_webdataset(
                "s3://sharebkt/shards/train-0.tar",
                shard="node",
                cache_dir=tmp_path / f"n{k}",
                progress=False,
            )
        held.append(set(cache.labels.tolist()))
    assert held[0].isdisjoint(held[1]) and held[0] | held[1] == set(range(N))


def test_webdataset_shards_are_read_a_window_at_a_time_and_only_the_share_is_kept(
    tmp_path, monkeypatch
):
    """Shards fetched two at a time (``WINDOW_BYTES``), under a file-size limit that a spool of
    every shard exceeds (a whole copy fails under it): at 2 and then 3 nodes, each node keeps
    exactly its share (images and masks, the source's bytes), GETs each shard once plus a
    ranged GET for a sample of its share outside the margin (if any), takes what its 2-node
    store holds at 3 nodes, and leaves no spool; under a limit below the share, the build
    stops with the fix and leaves nothing."""
    from gpucache.shares import _tar as _tar_share

    objects, samples = _wds_objects()
    sizes = [len(b) for b in objects.values()]
    monkeypatch.setattr(_tar_share, "WINDOW_BYTES", 2 * max(sizes))
    urls, total = "s3://wdsbkt/wds/part-{0..5}.tar", SHARDS * PER_SHARD
    limit = int(0.8 * sum(sizes))  # the largest file a build may write (a share: about 0.5)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)

    def build(folder, **kw) -> JpegCache:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
        try:
            return JpegCache.from_webdataset(
                urls, mask_ext="png", cache_dir=folder, progress=False, **kw
            )
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))

    with serving("wdsbkt", objects) as (server, _):
        with pytest.raises(OSError, match="File too large|file-size limit"):
            build(tmp_path / "whole")
        for nodes in (2, 3):
            held: list[int] = []
            fetched = []
            for k in range(nodes):
                server.reset_counts()
                with as_node(nodes, k):
                    cache = build(tmp_path / f"node{k}", shard="node")
                gets = server.gets("/wdsbkt/")
                assert set(gets) == {f"/wdsbkt/{name}" for name in objects}, gets
                assert sum(gets.values()) - SHARDS <= 2, gets  # ranged GETs past the margin
                labels = cache.labels.tolist()
                assert len(labels) == np.diff(node_bounds(total, nodes))[k]
                for i, label in enumerate(labels):
                    assert (bytes(cache[i]), bytes(cache.masks[i])) == samples[label]
                held += labels
                fetched.append(list(cache.node_share.fetched))
                left = {p.suffix for p in (tmp_path / f"node{k}").iterdir()}
                assert left <= {".gpucache", ".info", ".scan"}, left
            assert sorted(held) == list(range(total)), nodes
            if nodes == 3:  # node 0's new share is in its old one: all taken from its store
                assert fetched[0][0] == 0 < fetched[0][2] and fetched[1][2] > 0, fetched
                assert fetched[2][2] == 0, fetched  # node 2 had no store
        # a shard a window, under a limit below the share: the kept members cannot be written
        monkeypatch.setattr(_tar_share, "WINDOW_BYTES", 1)
        limit = int(0.25 * sum(sizes))  # a shard fits, the share's members do not
        with as_node(2, 0), pytest.raises(OSError, match="share") as err:
            build(tmp_path / "small", shard="node")
        assert "run on more nodes" in str(err.value)
        left = [p.suffix for p in (tmp_path / "small").iterdir()]
        assert left == [".scan"], left  # the listing's scan only: no spool, members or store


def test_a_damaged_shard_is_reported_once_and_the_shares_add_up_to_the_whole_build(
    tmp_path, monkeypatch
):
    """A tar cut in the middle and a shard that is no tar, read a shard a window: the two
    nodes' stores hold together what the whole build holds, and their reports together name
    what it names (the shard that is no tar, the member the cut tar ends in), each by one
    node."""
    from gpucache.shares import _tar as _tar_share

    objects, _ = _wds_objects()
    cut = objects["wds/part-2.tar"]
    objects["wds/part-2.tar"] = cut[: len(cut) // 2]
    objects["wds/part-4.tar"] = b"not a tar " * 200
    monkeypatch.setattr(_tar_share, "WINDOW_BYTES", 1)  # a shard a window
    urls = "s3://wdsbad/wds/part-{0..5}.tar"
    with serving("wdsbad", objects):
        whole = JpegCache.from_webdataset(urls, cache_dir=tmp_path / "whole", progress=False)
        shares = []
        for k in range(2):
            with as_node(2, k):
                shares.append(
                    JpegCache.from_webdataset(
                        urls, shard="node", cache_dir=tmp_path / f"n{k}", progress=False
                    )
                )
    held = sorted(label for c in shares for label in c.labels.tolist())
    assert held == sorted(whole.labels.tolist()) and len(held) < SHARDS * PER_SHARD
    reported = sorted((s.path, s.reason) for c in shares for s in c.report.skipped)
    assert reported == sorted((s.path, s.reason) for s in whole.report.skipped)
    shards = {p.split(".tar")[0] + ".tar" for p, _ in reported}  # a shard's, or a member's
    assert shards == {"s3://wdsbad/wds/part-2.tar", "s3://wdsbad/wds/part-4.tar"}, reported


@pytest.mark.parametrize("source", ["s3://sharebkt/train/", "s3://sharebkt/shards/train-0.tar"])
def test_a_share_that_does_not_fit_fetches_nothing(s3, tmp_path, source):
    s3.reset_counts()
    make = JpegCache.from_webdataset if source.endswith(".tar") else JpegCache.from_folder
    with as_node(2, 0), pytest.raises(ShareError, match="nothing fetched"):
        make(source, shard="node", cache_dir=tmp_path, cache_max_bytes=100, progress=False)
    assert not [p for p in s3.gets("/sharebkt/") if not p.endswith("/")]
    assert not list(tmp_path.glob("*.gpucache")) and not list(tmp_path.glob("*.fetch"))


def test_an_object_a_list_names_that_does_not_exist_is_reported_by_its_node(s3, tmp_path):
    urls = [f"s3://sharebkt/train/c{i:02d}/x.jpg" for i in range(N)]
    urls[5] = "s3://sharebkt/train/c05/gone.jpg"
    reports, kept = [], 0
    for k in range(2):
        with as_node(2, k):
            cache = JpegCache.from_files(
                urls, list(range(N)), shard="node", cache_dir=tmp_path / f"n{k}", progress=False
            )
        kept += len(cache)
        reports += [(s.path, s.reason) for s in cache.report.skipped]
    assert kept == N - 1
    [(path, reason)] = reports
    assert path == urls[5] and "gone.jpg" in path and reason
