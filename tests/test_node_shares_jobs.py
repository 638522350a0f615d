"""Node shares (``shard="node"``) in real multi-node jobs: torchrun agents on 127.0.0.1, one a
node (c10d rendezvous, gloo over the loopback, CPU ranks), each node with its own TMPDIR and so
its own node cache, running ``pipelines/ddp_example.py --shard``.

The data sets have one image per class folder, so a label names its sample: the ranks' recorded
labels show which samples each rank saw, and each node's recorded store which samples it holds.
Images are of one size and quality, so a share's bytes follow its sample count.

1. 2 nodes x 2 ranks from a local folder, 2 epochs (state saved after ``SAVE_AT`` batches of the
   second), and (``-m slow``) the same from an S3 server (moto's, 2 epochs): each node holds its
   share (about half of the data, the samples the partition math names), each object is fetched
   once in all (by the node that holds it), every sample comes once per epoch across the 4 ranks
   apart from the padding the loaders count, and the epochs' orders differ.
2. the local job resumed at 3 nodes (nodes 0 and 1 in the TMPDIRs of the 2-node job, node 2 in a
   new one) for the rest of the saved epoch: before and after the save, every sample once
   (padding aside, fewer repeats than ranks: the nodes' remainders rebalanced); node 0 takes
   its whole new share from its 2-node store, node 1 the part its 2-node share held, node 2
   reads all of its share.
3. a share larger than ``cache_max_bytes``, 2 nodes x 2 ranks forked from the test process with
   torchrun's variables: every rank stops at once with a ``ShareError`` naming the numbers, and
   the node cache holds the listing's scan only (no store, lock or temporary file).

Measured on the 2-core development machine (2026-12-07, shared with other work): 39-43 s for the
file, 48 s of CPU; the 2-node job 14-19 s, the 3-node job 23 s, the over-budget ranks 0.3 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from gpucache import JpegCache, ShareError
from gpucache.shares._order import NodeOrder
from gpucache.shares._partition import global_ranks, node_bounds, owners
from gpucache.testing import make_jpeg_bytes
from tests.support import forked
from tests.support.ports import free_port

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="torchrun agents on Linux"),
    pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed"),
    pytest.mark.timeout(900),  # torchrun launches; slow on a loaded 2-core machine
]
REPO = Path(__file__).resolve().parent.parent
N, BATCH, RANKS, SAVE_AT = 30, 2, 2, 2  # samples, batch size, ranks per node, batches saved


def _env(tmp: Path, extra: dict | None = None) -> dict:
    env = dict(os.environ, **(extra or {}))
    env.update(
        TMPDIR=str(tmp),
        OMP_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME="lo",  # the ranks talk over the loopback only
        CUDA_VISIBLE_DEVICES="",
    )
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def _start(tmps: list[Path], run: list[str], cwd: Path, extra: dict | None = None):
    """A job of ``len(tmps)`` nodes x RANKS ranks: one torchrun agent a node, node ``k`` with
    TMPDIR ``tmps[k]``, each rank running ``run`` (after ``-m`` or ``--no-python``). The
    rendezvous numbers the agents by process id (torch's c10d rendezvous sorts its participants
    by address, then pid), so agents started in order are nodes 0, 1, ...; the checks read each
    node's TMPDIR from its record."""
    port, procs = free_port(), []
    for tmp in tmps:
        tmp.mkdir(exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={len(tmps)}",
            f"--nproc_per_node={RANKS}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id=shares-{port}",
            "--local-addr=127.0.0.1",
            *run,
        ]
        procs.append(
            subprocess.Popen(
                cmd,
                env=_env(tmp, extra),
                cwd=cwd,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


def _example(data: str, record: Path, *args: str) -> list[str]:
    record.mkdir(parents=True, exist_ok=True)
    return [
        "-m",
        "pipelines.ddp_example",
        "--data",
        data,
        "--shard",
        "--batch-size",
        str(BATCH),
        "--workers",
        "0",
        "--record",
        str(record),
        *args,
    ]


def _finish(*jobs: list[subprocess.Popen], ok: bool = True) -> list[list[tuple[int, str]]]:
    """Every agent's (return code, stderr), job by job; every agent killed if one is not done."""
    try:
        done = [[(p.communicate(timeout=400)[1], p.returncode) for p in job] for job in jobs]
    finally:
        for p in (p for job in jobs for p in job):
            if p.poll() is None:
                p.kill()
                p.wait(timeout=60)
    out = [[(rc, err) for err, rc in job] for job in done]
    if ok:
        for job in out:
            for rc, err in job:
                assert rc == 0, err[-4000:]
    return out


def _seen(record: Path, nodes: int) -> list[list[list[int]]]:
    return [json.loads((record / f"seen-{r}.json").read_text()) for r in range(nodes * RANKS)]


def _padding(record: Path, nodes: int) -> list[list[int]]:
    return [json.loads((record / f"padding-{r}.json").read_text()) for r in range(nodes * RANKS)]


def _stores(record: Path, nodes: int) -> list[dict]:
    return [json.loads((record / f"node-{k}.json").read_text()) for k in range(nodes)]


def _batches(nodes: int) -> int:
    """Batches every rank plays in a whole epoch at ``nodes`` nodes."""
    return NodeOrder.batches(np.diff(node_bounds(N, nodes)).tolist(), RANKS, BATCH, False)


def _check_once(played: list[int], padding: int, slots: int) -> None:
    """``played``: the labels every rank saw in (part of) an epoch: each sample at least once, as
    many as the ranks' slots, and the repeats exactly the padding the loaders counted."""
    counts = np.bincount(played, minlength=N)
    assert len(counts) == N and counts.min() >= 1, counts.tolist()
    assert len(played) == slots
    assert int((counts - 1).sum()) == padding, (counts.tolist(), padding)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """N JPEGs of one size and quality, each in its own class folder; the labels' file sizes,
    and each sample's global rank (the partition math's, over the names the build lists)."""
    base = tmp_path_factory.mktemp("shares")
    root = base / "data"
    objects = {}
    for i in range(N):
        (root / f"c{i:03d}").mkdir(parents=True)
        blob = make_jpeg_bytes(48, 40, seed=100 + i, quality=85)
        (root / f"c{i:03d}" / "x.jpg").write_bytes(blob)
        objects[f"shares/c{i:03d}/x.jpg"] = blob
    sizes = np.array([len(objects[f"shares/c{i:03d}/x.jpg"]) for i in range(N)])
    ranks, _ = global_ranks([str(root / f"c{i:03d}" / "x.jpg") for i in range(N)])
    s3_ranks, _ = global_ranks([f"s3://bkt/shares/c{i:03d}/x.jpg" for i in range(N)])
    assert (ranks == s3_ranks).all()  # identities: the names without their common folder
    return {"base": base, "root": root, "objects": objects, "sizes": sizes, "ranks": ranks}


@pytest.fixture(scope="module")
def two_nodes(data):
    """The 2-node job from the local folder, 2 epochs, its state saved in the second."""
    base = data["base"]
    local = base / "run-local"
    t0 = time.monotonic()
    _finish(
        _start(
            [base / "node0", base / "node1"],
            _example(str(data["root"]), local, "--epochs", "2", "--save-at", str(SAVE_AT)),
            base,
        )
    )
    print(f"2-node job (local): {time.monotonic() - t0:.1f} s")
    return {"local": local}


@pytest.fixture(scope="module")
def two_nodes_s3(data):
    """The 2-node job from the S3 server, 2 epochs; the server's GET counts after it."""
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    from tests.support.s3server import serving

    base = data["base"]
    remote = base / "run-s3"
    t0 = time.monotonic()
    with serving("bkt", data["objects"]) as (server, _fs):
        server.reset_counts()
        _finish(
            _start(
                [base / "s3node0", base / "s3node1"],
                _example("s3://bkt/shares/", remote, "--epochs", "2"),
                base,
            )
        )
        gets = server.gets("/bkt/shares/")
    print(f"2-node job (S3): {time.monotonic() - t0:.1f} s")
    return {"s3": remote, "gets": gets}


def _check_shares(stores: list[dict], data: dict, nodes: int) -> None:
    """Each node's store holds exactly its share: the samples the partition math gives it."""
    owner = owners(data["ranks"], N, nodes)
    for k, store in enumerate(stores):
        mine = np.flatnonzero(owner == k)
        assert (store["nodes"], store["node"]) == (nodes, k)
        assert sorted(store["labels"]) == mine.tolist()
        assert store["len"] == len(mine) and store["nbytes"] == int(data["sizes"][mine].sum())


def test_two_nodes_hold_half_each_and_play_every_sample_once(two_nodes, data):
    record = two_nodes["local"]
    stores = _stores(record, 2)
    _check_shares(stores, data, 2)
    for k, store in enumerate(stores):
        assert store["tmpdir"] == str(data["base"] / f"node{k}")
        assert store["nbytes"] <= 0.55 * data["sizes"].sum()
        assert store["len"] == N // 2
        assert store["fetched"][0] == store["len"] and store["fetched"][2] == 0  # all read
    seen, padding = _seen(record, 2), _padding(record, 2)
    slots = _batches(2) * BATCH * 2 * RANKS
    assert slots > N  # 15 samples a node on 2 ranks of batches of 2: padded
    for epoch in range(2):
        played = [x for rank in seen for x in rank[epoch]]
        _check_once(played, sum(p[epoch] for p in padding), slots)
        assert {len(rank[epoch]) for rank in seen} == {_batches(2) * BATCH}  # lockstep
    assert [rank[0] for rank in seen] != [rank[1] for rank in seen]  # the epochs' orders differ


# Six more interpreters (two agents, four ranks) for what the default run covers in parts: each
# node fetching only its share from S3, GETs counted (test_node_shares_s3.py, in one process),
# the ranks of a node fetching from S3 once for the node (test_object_storage.py's 2-node job),
# and node shares in a real 2-node job (the local job above).
@pytest.mark.slow
def test_two_nodes_from_s3_fetch_only_their_shares(two_nodes_s3, data):
    two_nodes = two_nodes_s3
    record = two_nodes["s3"]
    stores = _stores(record, 2)
    _check_shares(stores, data, 2)
    for store in stores:
        assert store["fetched"][:3] == [store["len"], store["nbytes"], 0]
        assert store["nbytes"] <= 0.55 * data["sizes"].sum()
    # each object fetched once in all, over both epochs: by the node whose share holds it
    assert two_nodes["gets"] == {f"/bkt/{k}": 1 for k in data["objects"]}, two_nodes["gets"]
    seen, padding = _seen(record, 2), _padding(record, 2)
    for epoch in range(2):
        played = [x for rank in seen for x in rank[epoch]]
        _check_once(played, sum(p[epoch] for p in padding), _batches(2) * BATCH * 2 * RANKS)
    assert [rank[0] for rank in seen] != [rank[1] for rank in seen]  # the epochs' orders differ


def test_a_job_resumed_at_three_nodes_finishes_the_epoch_and_reuses_the_stores(two_nodes, data):
    base, before = data["base"], two_nodes["local"]
    record = base / "run-resume"
    t0 = time.monotonic()
    tmps = [base / "node0", base / "node1", base / "node2"]  # node 2: a new node, an empty cache
    job = _start(
        tmps,
        _example(str(data["root"]), record, "--resume", str(before / "state.pt")),
        base,
    )
    _finish(job)
    print(f"3-node resumed job: {time.monotonic() - t0:.1f} s")
    stores = _stores(record, 3)
    _check_shares(stores, data, 3)
    # what each node read: its new share less what its 2-node store (same TMPDIR) held
    old, new = owners(data["ranks"], N, 2), owners(data["ranks"], N, 3)
    for k, store in enumerate(stores):
        assert store["tmpdir"] == str(tmps[k])
        read = (new == k) & (old != k) if k < 2 else new == k
        took = (new == k) & ~read
        sizes = data["sizes"]
        assert store["fetched"] == [
            int(read.sum()),
            int(sizes[read].sum()),
            int(took.sum()),
            int(sizes[took].sum()),
        ], (k, store["fetched"])
    assert stores[0]["fetched"][0] == 0  # its whole share was in its 2-node store
    assert stores[1]["fetched"][0] == stores[1]["len"] // 2  # half of it was
    assert stores[2]["fetched"][0] == stores[2]["len"]  # all read from the source

    consumed = [x for rank in _seen(before, 2) for x in rank[1][: SAVE_AT * BATCH]]
    assert len(set(consumed)) == len(consumed) == SAVE_AT * BATCH * 2 * RANKS  # no padding yet
    seen = _seen(record, 3)
    assert len({len(rank[0]) for rank in seen}) == 1  # lockstep at 3 nodes too
    rest = [x for rank in seen for x in rank[0]]
    assert not set(rest) & set(consumed)  # nothing consumed before the save played again
    padding = sum(p[0] for p in _padding(record, 3))
    _check_once(consumed + rest, padding, len(consumed + rest))
    assert padding < 3 * RANKS  # the remainders rebalanced: fewer repeats than ranks


def _over_budget_rank(root: str, cap: int, env: dict, out: Path) -> None:
    """One rank of the over-budget job, in a child forked from this process: the environment
    torchrun gives a rank (the library reads nothing else when there is no process group), its
    node's TMPDIR, then the build; ``out``: the refusal (or ``STORE BUILT``)."""
    forked.as_launched(env)
    t0 = time.monotonic()
    try:
        JpegCache.from_folder(root, shard="node", cache_max_bytes=cap)
    except ShareError as err:
        out.write_text(f"rank {env['RANK']} ShareError after {time.monotonic() - t0:.1f} s: {err}")
        sys.exit(3)
    out.write_text("STORE BUILT")


def test_a_share_over_the_node_budget_stops_every_rank_at_once(data):
    """2 nodes x RANKS ranks, all started at once, each a process forked from this one with the
    variables torchrun sets for a rank and its node's TMPDIR (the check is the library's, before
    any process group: the torchrun jobs above run the launcher itself)."""
    base = data["base"]
    cap = int(data["sizes"].sum()) // 4  # about half of a node's share at 2 nodes
    tmps = [base / "over0", base / "over1"]
    refused = base / "over-refused"  # what each rank wrote
    refused.mkdir()
    ranks = []
    t0 = time.monotonic()
    for node, tmp in enumerate(tmps):
        tmp.mkdir()
        for local in range(RANKS):
            env = forked.rank_env(tmp, node, local, len(tmps), RANKS)
            out = refused / env["RANK"]
            proc = forked.start(_over_budget_rank, str(data["root"]), cap, env, out)
            ranks.append((node, int(env["RANK"]), proc, out))
    forked.join_all([proc for _, _, proc, _ in ranks])
    print(f"over-budget job: {time.monotonic() - t0:.1f} s")
    owner = owners(data["ranks"], N, 2)
    for node, rank, proc, out in ranks:
        line = out.read_text() if out.exists() else f"rank {rank}: no answer"
        assert proc.exitcode == 3, (proc.exitcode, line)
        assert line.startswith(f"rank {rank} ShareError"), line  # not STORE BUILT
        share = int(data["sizes"][owner == node].sum())
        took = float(line.split(" after ")[1].split(" s:")[0])
        assert took < 30, line  # no rank waits for another's build
        assert f"node {node} of 2" in line and "cache_max_bytes" in line
        assert f"{share:,}" in line and f"{cap:,}" in line, line
    for tmp in tmps:
        folder = tmp / f"gpucache-{os.getuid()}"
        left = [] if not folder.exists() else [f.name for f in folder.iterdir()]
        assert all(f.endswith(".scan") for f in left), left  # no store, lock or temporary file
