"""Node shares (``shard="node"``), in one process: the partition function, each node's build
(the node layout taken from the launcher's variables, as torchrun sets them), and the loader's
epochs over the nodes' stores with every rank's ``num_replicas``/``rank`` given.

- the partition: ranks a permutation that ignores where the data is mounted and its listing order,
  shares equal within one sample, a class folder spread over every node, 2 -> 3 nodes moving
  as little as contiguous runs allow;
- builds: the shares of every node are disjoint and cover the data, each about 1/nodes of the
  bytes; a share that does not fit fails before reading, leaving no store; a new layout takes
  what the node's earlier store holds (``fetched``); every builder takes ``shard``;
- the loader: every sample once per epoch across the ranks (padding counted), the same number of
  batches on every rank, new orders each epoch, ``drop_last``; resumed at 3 nodes from a state
  of 2 (and back) the epoch ends with every sample once; a sample the build left out is padded;
  wrong stores and states are refused with the fix.

The same with torchrun agents as nodes (and the S3 server) is in test_node_shares_jobs.py.
"""

from __future__ import annotations

import contextlib
import csv
import io
import tarfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gpucache import GpuCachedLoader, JpegCache, ShareError
from gpucache.node._clean import entries
from gpucache.shares._partition import (
    PARTITIONS,
    Share,
    common_cut,
    global_ranks,
    identity_hashes,
    node_bounds,
    owners,
)
from gpucache.testing import make_jpeg_bytes

N = 23  # samples: one a class, so a label names its sample; odd, so shares are uneven


@contextlib.contextmanager
def as_node(nodes: int, node: int, per_node: int = 2) -> Iterator[None]:
    """This process is local rank 0 of ``node``, as torchrun describes it to its ranks."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in dict(
            WORLD_SIZE=nodes * per_node,
            LOCAL_WORLD_SIZE=per_node,
            GROUP_RANK=node,
            RANK=node * per_node,
            LOCAL_RANK=0,
        ).items():
            mp.setenv(k, str(v))
        yield


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("shares") / "train"
    for i in range(N):
        (root / f"c{i:02d}").mkdir(parents=True)
        (root / f"c{i:02d}" / "x.jpg").write_bytes(make_jpeg_bytes(24 + i % 5, 16, seed=i))
    return root


def build(root, nodes: int, node: int, where: Path, **kw) -> JpegCache:
    with as_node(nodes, node):
        return JpegCache.from_folder(
            root, shard="node", cache_dir=where / f"node{node}", progress=False, **kw
        )


def layout(root, nodes: int, where: Path, **kw) -> list[JpegCache]:
    return [build(root, nodes, k, where, **kw) for k in range(nodes)]


def loaders(stores, per_node: int = 2, **kw) -> list[GpuCachedLoader]:
    world = len(stores) * per_node
    opts = dict(batch_size=2, shuffle=True, seed=7, num_workers=0, return_metadata=True)
    return [
        GpuCachedLoader(stores[r // per_node], num_replicas=world, rank=r, **{**opts, **kw})
        for r in range(world)
    ]


def play(loader: GpuCachedLoader, batches: int | None = None) -> list[int]:
    """The labels (sample names) of a pass, or of its first ``batches``."""
    seen: list[int] = []
    for b, (_, labels, _) in enumerate(loader):
        seen += labels.tolist()
        if batches is not None and b + 1 == batches:
            break
    return seen


def epoch(ls: list[GpuCachedLoader]) -> tuple[list[list[int]], int]:
    """Every rank's pass, and the repeats the loaders say they played."""
    seen = [play(lo) for lo in ls]
    return seen, sum(lo.epoch_padding for lo in ls)


def once_apart_from_padding(seen: list[list[int]], padding: int, total: int = N) -> None:
    flat = [x for s in seen for x in s]
    count = Counter(flat)
    assert sorted(count) == list(range(total)), "every sample, and nothing else"
    assert len(flat) - total == padding, "the repeats are the padding the loaders count"


# ------------------------------------------------------------------ the partition function
def test_ranks_ignore_the_mount_point_and_the_listing_order():
    names = [f"c{i}/img{i}.jpg" for i in range(500)]
    a, fa = global_ranks([f"/mnt/a/train/{n}" for n in names])
    b, fb = global_ranks([f"s3://bucket/train/{n}" for n in reversed(names)])
    assert sorted(a.tolist()) == list(range(500))
    assert a.tolist() == b[::-1].tolist() and fa == fb
    c, fc = global_ranks([f"/mnt/a/train/{n}" for n in names[:-1]])
    assert fc != fa  # another listing, another fingerprint


@pytest.mark.parametrize("total", [0, 1, 7, 997, 10_000])
@pytest.mark.parametrize("nodes", [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 32, 64])
def test_node_shares_are_equal_within_one_sample(total, nodes):
    assert PARTITIONS % nodes == 0
    sizes = np.diff(node_bounds(total, nodes))
    assert sizes.sum() == total and sizes.max() - sizes.min() <= 1


def test_a_node_count_that_does_not_divide_the_partitions_stays_balanced():
    sizes = np.diff(node_bounds(1_000_003, 11))
    assert sizes.sum() == 1_000_003 and sizes.max() - sizes.min() <= 1_000_003 // PARTITIONS + 1


def test_a_class_folder_spreads_over_every_node():
    names = [f"/data/c{c:02d}/{i:04d}.jpg" for c in range(10) for i in range(100)]
    ranks, _ = global_ranks(names)
    node = owners(ranks, len(names), 4).reshape(10, 100)  # listing order: class by class
    per_class = np.stack([np.bincount(row, minlength=4) for row in node])
    assert per_class.min() >= 10 and per_class.max() <= 40  # 25 each, give or take chance
    contiguous = np.arange(1000) * 4 // 1000  # the run-of-files rule a hash avoids
    assert np.bincount(contiguous.reshape(10, 100)[0], minlength=4).tolist() == [100, 0, 0, 0]


def test_from_two_to_three_nodes_node_0_keeps_its_new_share_whole():
    total = 1000
    two, three = node_bounds(total, 2), node_bounds(total, 3)
    assert three[0] >= two[0] and three[1] <= two[1]  # node 0: inside its old share
    assert three[2] >= two[1]  # node 2: inside node 1's old share
    ranks = np.arange(total)
    was, now = owners(ranks, total, 2), owners(ranks, total, 3)
    # node 1 keeps half of its new share; node 2, new, fetches all of its own
    assert (was[now == 1] == 1).mean() == pytest.approx(0.5, abs=0.01)
    assert (was != now).mean() == pytest.approx(1 / 6 + 1 / 3, abs=0.01)


def test_the_scan_margin_holds_every_sample_of_the_share_and_little_more():
    """``Share.likely``, as a scan uses it before the listing is whole (WebDataset shards in
    storage): for 20 listings of 3,000 names and 2, 3, 8 and 64 nodes, every sample of each
    node's share is likely, the margin adds under 5 sqrt(N) samples a node, and a total
    estimated too high narrows it (the samples it then misses are read by ranged GETs:
    ``tests/test_node_shares_s3.py``)."""
    total, extra = 3000, 0
    for seed in range(20):
        names = [f"/data/c{seed}/{i:05d}.jpg" for i in range(total)]
        hashes = identity_hashes(names, common_cut(names))
        ranks, _ = global_ranks(names)
        for nodes in (2, 3, 8, 64):
            bounds = node_bounds(total, nodes)
            for k in range(nodes):
                mine = (ranks >= bounds[k]) & (ranks < bounds[k + 1])
                likely = Share(nodes, k).likely(hashes, total)
                assert likely[mine].all(), (seed, nodes, k)
                assert likely.sum() - mine.sum() < 5 * total**0.5, (seed, nodes, k)
                extra = max(extra, int(likely.sum() - mine.sum()))
                narrow = Share(nodes, k).likely(hashes, 100 * total)
                assert narrow.sum() <= likely.sum()
    assert extra > 0  # a margin there is


# ------------------------------------------------------------------ builds
def test_two_nodes_build_disjoint_halves_of_the_data(data, tmp_path):
    stores = layout(data, 2, tmp_path)
    whole = JpegCache.from_folder(data, progress=False)
    labels = [set(s.labels.tolist()) for s in stores]
    assert labels[0].isdisjoint(labels[1]) and labels[0] | labels[1] == set(range(N))
    for k, s in enumerate(stores):
        share = s.node_share
        assert share is not None and (share.nodes, share.node, share.total) == (2, k, N)
        assert abs(len(s) - N / 2) <= 1 and s.nbytes <= 0.55 * whole.nbytes
        assert share.fetched[0] == len(s) and share.fetched[2] == 0  # all read, none reused
        again = JpegCache.open(next((tmp_path / f"node{k}").glob("*.gpucache")))
        assert again.node_share is not None and again.node_share.ranks.tolist() == (
            share.ranks.tolist()
        )
    assert stores[0].node_share.listing == stores[1].node_share.listing


def test_one_process_builds_the_whole_data_set_as_one_share(data):
    cache = JpegCache.from_folder(data, shard="node", progress=False)
    assert len(cache) == N and cache.node_share is not None
    assert (cache.node_share.nodes, cache.node_share.node) == (1, 0)
    assert JpegCache.from_folder(data, progress=False).node_share is None


def test_a_share_that_does_not_fit_stops_before_reading_and_leaves_no_store(data, tmp_path):
    with pytest.raises(ShareError, match=r"node 1 of 2: its share .* cache_max_bytes") as err:
        build(data, 2, 1, tmp_path, cache_max_bytes=1000)
    assert "more nodes" in str(err.value) and "shard=None" in str(err.value)
    assert not list((tmp_path / "node1").glob("*.gpucache"))


def test_a_node_with_nothing_to_hold_says_so(tmp_path):
    root = tmp_path / "two"
    for i in range(2):
        (root / f"c{i}").mkdir(parents=True)
        (root / f"c{i}" / "x.jpg").write_bytes(make_jpeg_bytes(16, 16, seed=i))
    with pytest.raises(ShareError, match="node 2 of 3.* 2 samples.*empty"):
        build(root, 3, 2, tmp_path)


def test_a_new_layout_takes_what_the_earlier_store_holds(data, tmp_path):
    names = sorted(str(p) for p in data.rglob("*.jpg"))
    ranks, _ = global_ranks(names)
    layout(data, 2, tmp_path)
    three = layout(data, 3, tmp_path)
    two, now = node_bounds(N, 2), node_bounds(N, 3)
    for k, s in enumerate(three):
        share = s.node_share
        assert share is not None
        before = set(range(*two[k : k + 2])) if k < 2 else set()  # node 2 is new
        mine = set(range(*now[k : k + 2]))
        assert share.fetched[2] == len(mine & before)  # reused
        assert share.fetched[0] == len(mine - before)  # read from the source
        assert sorted(share.ranks.tolist()) == sorted(mine)
        assert sorted(ranks[s.labels].tolist()) == sorted(mine)  # the right images
    assert three[0].node_share.fetched[0] == 0  # node 0 read nothing
    listed = [e.source for e in entries(tmp_path / "node1")]
    assert sorted(s[len(str(data)) :] for s in listed) == [" (node 1 of 2)", " (node 1 of 3)"]


def test_a_build_that_re_encodes_reads_its_share_again(data, tmp_path):
    layout(data, 2, tmp_path, max_side=20)
    again = build(data, 3, 0, tmp_path, max_side=20)
    assert again.node_share is not None and again.node_share.fetched[2] == 0


def test_every_builder_takes_the_share(data, tmp_path):
    files = sorted(data.rglob("*.jpg"))
    labels = list(range(N))
    (tmp_path / "list.csv").write_text("".join(f"{p},{i}\n" for i, p in enumerate(files)))
    with tarfile.open(tmp_path / "shard-0.tar", "w") as tf:
        for i, p in enumerate(files):
            for ext, blob in (("jpg", p.read_bytes()), ("cls", str(i).encode())):
                info = tarfile.TarInfo(f"{i:04d}.{ext}")
                info.size = len(blob)
                tf.addfile(info, io.BytesIO(blob))
    makers = {
        "files": lambda **kw: JpegCache.from_files(files, labels, **kw),
        "csv": lambda **kw: JpegCache.from_csv(tmp_path / "list.csv", **kw),
        "webdataset": lambda **kw: JpegCache.from_webdataset(tmp_path / "shard-0.tar", **kw),
    }
    for name, make in makers.items():
        got = []
        for k in range(2):
            with as_node(2, k):
                got.append(make(shard="node", cache_dir=tmp_path / name / str(k), progress=False))
        held = [set(np.asarray(s.labels).tolist()) for s in got]
        assert held[0].isdisjoint(held[1]) and held[0] | held[1] == set(range(N)), name


def test_from_hf_takes_the_share(data):
    datasets = pytest.importorskip("datasets")
    files = sorted(data.rglob("*.jpg"))
    ds = datasets.Dataset.from_dict(
        {"image": [str(p) for p in files], "label": list(range(N))}
    ).cast_column("image", datasets.Image())
    held = []
    for k in range(2):
        with as_node(2, k):
            held.append(set(JpegCache.from_hf(ds, shard="node", progress=False).labels.tolist()))
    assert held[0].isdisjoint(held[1]) and held[0] | held[1] == set(range(N))


# ------------------------------------------------------------------ the loader
def test_every_sample_once_per_epoch_across_two_nodes_of_two_ranks(data, tmp_path):
    ls = loaders(layout(data, 2, tmp_path))
    assert len({len(lo) for lo in ls}) == 1  # the same number of batches on every rank
    first, pad = epoch(ls)
    once_apart_from_padding(first, pad)
    assert all(len(s) == len(ls[0]) * 2 for s in first)
    second, pad2 = epoch(ls)
    once_apart_from_padding(second, pad2)
    assert first != second  # a new order every epoch
    node0 = {x for r in (0, 1) for x in first[r]}
    assert node0 <= set(ls[0].cache.labels.tolist())  # a node plays its own share


def test_drop_last_leaves_samples_out_and_repeats_none(data, tmp_path):
    ls = loaders(layout(data, 2, tmp_path), drop_last=True)
    seen = [play(lo) for lo in ls]
    flat = [x for s in seen for x in s]
    assert len(flat) == len(set(flat)) and all(len(s) == len(seen[0]) for s in seen)
    assert len(flat) + sum(lo.epoch_dropped for lo in ls) == N


@pytest.mark.parametrize("shuffle", [True, False])
def test_resumed_at_three_nodes_and_back_the_epoch_ends_with_every_sample_once(
    data, tmp_path, shuffle
):
    two = layout(data, 2, tmp_path)
    three = layout(data, 3, tmp_path)
    first = loaders(two, shuffle=shuffle)
    before = [play(lo, 2) for lo in first]  # 2 batches of 2 on each of 4 ranks
    state = first[0].state_dict()
    assert all(lo.state_dict() == state for lo in first)  # the same on every rank
    assert state["segments"] == [[2, 2, 2, 2]] and state["position"] == 16
    middle = loaders(three, shuffle=shuffle)
    for lo in middle:
        lo.load_state_dict(state)
    during = [play(lo, 1) for lo in middle]
    state = middle[0].state_dict()
    assert state["segments"] == [[2, 2, 2, 2], [3, 2, 2, 1]]
    last = loaders(two, shuffle=shuffle)
    for lo in last:
        lo.load_state_dict(state)
    after, pad = epoch(last)
    assert len({len(s) for s in after}) == 1
    parts = [{x for s in part for x in s} for part in (before, during, after)]
    assert parts[0] | parts[1] | parts[2] == set(range(N))
    assert len([x for s in before for x in s]) == len(parts[0])  # a full layout: no padding yet
    # the last part plays exactly what the first two left, each once, plus its padding (a node
    # with nothing left pads with its own samples)
    left = set(range(N)) - parts[0] - parts[1]
    flat = [x for s in after for x in s]
    assert left <= parts[2] and len(flat) == len(left) + pad
    repeats = sum(len(s) for part in (before, during, after) for s in part) - N
    assert repeats <= sum(lo.epoch_padding for lo in middle) + pad
    assert play(last[0], 1) and last[0].epoch == 1  # the next pass is epoch 1


def test_resumed_at_three_nodes_the_remainders_are_rebalanced_and_repeat_less_than_the_ranks(
    tmp_path,
):
    """2 nodes -> 3 mid-epoch (a rank a node): the nodes' remainders differ (7 repeats of 120
    here before they were rebalanced); the longer ones hand their last samples to the shorter,
    which fetch those few from the source (``node_share.fetched``), so the repeats are fewer
    than the ranks, every sample comes, and the loaders count every repeat."""
    n, root = 120, tmp_path / "many"
    for i in range(n):
        (root / f"c{i:03d}").mkdir(parents=True)
        (root / f"c{i:03d}" / "x.jpg").write_bytes(make_jpeg_bytes(16, 16, seed=i))
    first = loaders(layout(root, 2, tmp_path), per_node=1, batch_size=4)
    before = [play(lo, 5) for lo in first]
    state = first[0].state_dict()
    three = layout(root, 3, tmp_path)
    after = loaders(three, per_node=1, batch_size=4)
    for k, lo in enumerate(after):
        with as_node(3, k, per_node=1):
            lo.load_state_dict(state)
    rest = [play(lo) for lo in after]
    flat = [x for s in before + rest for x in s]
    assert sorted(set(flat)) == list(range(n)), "every sample"
    repeats = len(flat) - n
    assert repeats == sum(lo.epoch_padding for lo in after) and repeats < len(after)
    assert len({len(s) for s in rest}) == 1  # as many samples on every rank
    handed = 0
    for lo, built in zip(after, three):
        share, own = lo.cache.node_share, built.node_share
        assert share is not None and own is not None
        more = len(lo.cache) - len(built)
        handed += more
        if more:  # built again: its own samples taken from its store, the handed ones read
            assert share.fetched[0] == more and share.fetched[2] == len(built)
            assert set(own.ranks.tolist()) < set(share.ranks.tolist())
        else:
            assert lo.cache is built
    assert handed > 0
    for lo in after:  # the next epoch plays the node's own share again
        assert sorted(set(play(lo))) == sorted(set(three[after.index(lo)].labels.tolist()))


def test_a_sample_the_build_left_out_is_padded_by_its_node(data, tmp_path):
    root = tmp_path / "data"
    for p in data.rglob("*.jpg"):
        (root / p.parent.name).mkdir(parents=True)
        (root / p.parent.name / p.name).write_bytes(p.read_bytes())
    (root / "c05" / "x.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    stores = layout(root, 2, tmp_path)
    assert sum(len(s) for s in stores) == N - 1
    assert sum(len(s.report.skipped) for s in stores) == 1
    ls = loaders(stores)
    seen, pad = epoch(ls)
    flat = [x for s in seen for x in s]
    # the broken sample's label is 5; every other sample comes, the hole is a repeat
    assert sorted(set(flat)) == [i for i in range(N) if i != 5]
    assert len(flat) - (N - 1) == pad


def test_wrong_stores_and_states_are_refused_with_the_fix(data, tmp_path):
    stores = layout(data, 2, tmp_path)
    with pytest.raises(ShareError, match="rank 2 is on node 1 .* holds node 0's share"):
        GpuCachedLoader(stores[0], batch_size=2, num_replicas=4, rank=2, num_workers=0)
    with pytest.raises(ShareError, match="cannot split"):
        GpuCachedLoader(stores[0], batch_size=2, num_replicas=3, rank=0, num_workers=0)
    with pytest.raises(ValueError, match="indices= and weights="):
        GpuCachedLoader(stores[0], batch_size=2, num_replicas=4, rank=0, indices=[0], num_workers=0)
    whole = JpegCache.from_folder(data, progress=False)
    plain = GpuCachedLoader(whole, batch_size=2, shuffle=True, seed=7, num_workers=0)
    sharded = loaders(stores)[0]
    with pytest.raises(ValueError, match="fingerprint"):
        sharded.load_state_dict(plain.state_dict())
    state = sharded.state_dict()
    for bad in ([[2, 2, 2]], [[0, 2, 2, 1]], "2,2,2,1"):
        with pytest.raises((ValueError, TypeError), match="segments"):
            sharded.load_state_dict({**state, "segments": bad})
    with pytest.raises(ValueError, match="node-sharded"):
        sharded.load_state_dict({k: v for k, v in state.items() if k != "segments"})


def _lying(store: JpegCache, path: Path, **sections: np.ndarray) -> Path:
    """``store`` saved with some share sections replaced (its checksums valid)."""
    from gpucache.store import _format

    arrays = store._stored()
    arrays = arrays.with_sections({**sections})
    with open(path, "wb") as f:
        _format.write(f, arrays)
    return path


def test_share_records_that_lie_are_refused_before_an_order_is_drawn(data, tmp_path):
    """Records altered after the build (checksums valid), as the fuzz harness over the input
    paths makes them: two samples claiming one rank, bounds whose math would overflow, and a
    listing claimed 2**31 samples long (the loader's order for that share would take 16 GB)."""
    from gpucache import CacheFormatError
    from gpucache.shares._record import LAYOUT, RANKS

    store = layout(data, 2, tmp_path)[0]
    share = store.node_share
    ranks = np.array(share.ranks)
    ranks[1] = ranks[0]
    with pytest.raises(CacheFormatError, match="holds a rank twice"):
        JpegCache.open(_lying(store, tmp_path / "twice.gpucache", **{RANKS: ranks}))
    layout_ = np.array([1, 2**40, 2**30, 2, 0], "<i8")
    with pytest.raises(CacheFormatError, match="beyond any listing"):
        JpegCache.open(_lying(store, tmp_path / "wide.gpucache", **{LAYOUT: layout_}))
    layout_ = np.array([1, share.partitions, 2**31, 2, 0], "<i8")
    lying = JpegCache.open(_lying(store, tmp_path / "long.gpucache", **{LAYOUT: layout_}))
    with pytest.raises(ShareError, match="record does not describe this store"):
        GpuCachedLoader(lying, batch_size=2, num_replicas=4, rank=0, num_workers=0)


def test_a_state_survives_json(data, tmp_path):
    import json

    ls = loaders(layout(data, 2, tmp_path))
    play(ls[1], 1)
    state = json.loads(json.dumps(ls[1].state_dict()))
    again = loaders(layout(data, 2, tmp_path))[1]
    again.load_state_dict(state)
    assert again.state_dict() == state


def test_csv_rows_hold_no_path_of_another_node(tmp_path, data):
    """A CSV with relative rows: nodes that see the CSV at different paths agree."""
    files = sorted(data.rglob("*.jpg"))
    for where in ("a", "b"):
        folder = tmp_path / where
        folder.mkdir()
        with open(folder / "list.csv", "w", newline="") as f:
            w = csv.writer(f)
            for i, p in enumerate(files):
                (folder / p.parent.name).mkdir(exist_ok=True)
                (folder / p.parent.name / p.name).write_bytes(p.read_bytes())
                w.writerow([f"{p.parent.name}/{p.name}", i])
    got = []
    for k, where in enumerate(("a", "b")):
        with as_node(2, k):
            got.append(
                JpegCache.from_csv(
                    tmp_path / where / "list.csv",
                    shard="node",
                    cache_dir=tmp_path / f"n{k}",
                    progress=False,
                )
            )
    held = [set(s.labels.tolist()) for s in got]
    assert held[0].isdisjoint(held[1]) and held[0] | held[1] == set(range(N))
    assert got[0].node_share.listing == got[1].node_share.listing


def test_the_command_line_builds_a_share_and_info_names_it(data, tmp_path, capsys):
    from gpucache.cli import main

    out = tmp_path / "node1.gpucache"
    with as_node(2, 1):
        assert main(["build", str(data), "-o", str(out), "--shard", "node"]) == 0
    capsys.readouterr()
    assert main(["info", str(out)]) == 0
    text = capsys.readouterr().out
    size = int(np.diff(node_bounds(N, 2))[1])
    assert f"share: node 1 of 2 ({size:,} of the listing's {N:,} samples" in text


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, (1, 0)),  # one process
        (  # torchrun
            {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1", "RANK": "5"},
            (2, 1),
        ),
        ({"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "2", "RANK": "5"}, (3, 2)),  # no GROUP_RANK
        (  # srun: one task a GPU, 2 nodes of 4
            {"SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_LOCALID": "3"},
            (2, 1),
        ),
        ({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"}, (4, 3)),  # no local size: a rank
    ],
)
def test_the_node_layout_comes_from_the_launcher(monkeypatch, env, expected):
    from gpucache.base import _dist

    for name in (
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "RANK",
        "LOCAL_RANK",
        "SLURM_NNODES",
        "SLURM_NODEID",
        "SLURM_LOCALID",
        "SLURM_NTASKS_PER_NODE",
    ):
        monkeypatch.delenv(name, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    if "LOCAL_WORLD_SIZE" in env:  # torchrun sets both
        monkeypatch.setenv("LOCAL_RANK", str(int(env["RANK"]) % int(env["LOCAL_WORLD_SIZE"])))
    assert _dist.nodes() == expected


_MISMATCH = """
import sys
import torch.distributed as dist
from gpucache import GpuCachedLoader, JpegCache, ShareError
dist.init_process_group("gloo")
cache = JpegCache.from_folder(sys.argv[1], shard="node", cache_dir=sys.argv[2], progress=False)
try:
    GpuCachedLoader(cache, batch_size=2, shuffle=True, num_workers=0)
except ShareError as err:
    print("REFUSED", err, flush=True)
else:
    print("ACCEPTED", flush=True)
finally:  # a group left to the interpreter's exit can abort it (gloo's threads still running)
    dist.destroy_process_group()
"""


def test_nodes_that_listed_different_data_are_refused_when_the_loader_starts(data, tmp_path):
    """Two processes of one gloo group, one a node: node 1 sees a file node 0 does not."""
    import os
    import subprocess
    import sys

    from tests.support.ports import free_port

    other = tmp_path / "other"
    for p in data.rglob("*.jpg"):
        (other / p.parent.name).mkdir(parents=True, exist_ok=True)
        (other / p.parent.name / p.name).write_bytes(p.read_bytes())
    (other / "c99").mkdir()
    (other / "c99" / "x.jpg").write_bytes(make_jpeg_bytes(20, 16, seed=99))
    port = free_port()
    procs = []
    for node, root in enumerate((data, other)):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": "2",
            "RANK": str(node),
            "LOCAL_WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
            "GROUP_RANK": str(node),
            "GLOO_SOCKET_IFNAME": "lo",
            "CUDA_VISIBLE_DEVICES": "",
            "OMP_NUM_THREADS": "1",
        }
        cmd = [sys.executable, "-c", _MISMATCH, str(root), str(tmp_path / f"cache{node}")]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    for p, out in zip(procs, outs):
        assert p.returncode == 0 and out.startswith("REFUSED"), out
        assert "ranks [" in out and "same source" in out


def test_the_earlier_store_is_dropped_under_cache_max_bytes_once_it_was_used(data, tmp_path):
    first = build(data, 2, 1, tmp_path)
    cap = first.nbytes + first.nbytes // 2  # room for one share, not two
    first = build(data, 2, 1, tmp_path, cache_max_bytes=cap)  # the same store, opened
    del first
    again = build(data, 3, 1, tmp_path, cache_max_bytes=cap)
    assert again.node_share is not None and again.node_share.fetched[2] > 0  # reused first
    stores = list((tmp_path / "node1").glob("*.gpucache"))
    assert stores == [again.path]  # then the earlier one went, least recently used


def test_the_consumed_count_of_one_layout_is_the_count_of_the_consumed_samples(data, tmp_path):
    from gpucache.shares._order import NodeOrder, Segment

    share = layout(data, 2, tmp_path)[0].node_share
    assert share is not None
    order = NodeOrder(share, num_replicas=4, rank=0)
    for seg in (Segment(2, 2, 2, 1), Segment(3, 2, 1, 2), Segment(2, 2, 4, 9)):
        done = order.consumed(7, 0, True, [seg])
        assert done is not None
        assert order.consumed_count(7, 0, True, [seg]) == int(done.sum())
    two = [Segment(2, 2, 2, 2), Segment(3, 2, 2, 1)]
    assert order.consumed_count(7, 0, True, two) == int(order.consumed(7, 0, True, two).sum())


def test_resumed_on_one_node_with_other_ranks_and_batch_size(data, tmp_path):
    first = loaders(layout(data, 2, tmp_path))
    before = [play(lo, 2) for lo in first]
    state = first[0].state_dict()
    one = layout(data, 1, tmp_path)  # one node of 3 ranks, batches of 3
    after_loaders = loaders(one, per_node=3, batch_size=3)
    for lo in after_loaders:
        lo.load_state_dict(state)
    after = [play(lo) for lo in after_loaders]
    played = {x for s in before for x in s}
    rest = [x for s in after for x in s]
    left = set(range(N)) - played
    assert len(played) == sum(len(s) for s in before) == 16  # no padding before the save
    assert left <= set(rest) and not played & (set(rest) - left)  # no consumed sample again
    assert len(rest) - len(left) == sum(lo.epoch_padding for lo in after_loaders)
    assert len({len(s) for s in after}) == 1
