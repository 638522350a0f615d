#!/usr/bin/env python
"""Node shares of WebDataset shards in object storage: what each node's cache folder holds at
its peak while it builds its share, what it GETs, and how long the build takes, with the shards
fetched a window at a time against all at once.

The photos of a folder (``--data``, default hymenoptera: ``train/`` and ``val/``, labels by
class folder) are written into ``--shards`` tar shards (a JPEG and its ``.cls`` a sample, in a
shuffled order) and uploaded to an S3 server on 127.0.0.1 (moto's, in this process: its GET
counts per object). For each node count of ``--nodes``, every node (simulated one after another
by the launcher's variables, each with a new cache folder) builds
``JpegCache.from_webdataset(urls, shard="node")`` twice:

- ``window``: ``WINDOW_BYTES`` set to ``--window-shards`` shards' bytes, so the shards come a
  window at a time, as a data set larger than the default 1 GiB window does;
- ``all``: one window holding every shard (each node's cache then holds every shard at once,
  as the build did before windows).

Reported per build: the peak bytes allocated in the node's cache folder (``st_blocks`` of its
files, polled every 2 ms in a thread: the spool, the kept members, the store), that peak as a
fraction of the shards' bytes, the store's bytes, GETs (whole shards and ranged member reads),
the build's seconds, and whether the share's samples equal the partition's (every sample once
over the nodes).

::

    python benchmarks/node_shares_webdataset.py --json benchmarks/results/node-shares-webdataset.json
"""

from __future__ import annotations

import argparse
import io
import os
import random
import shutil
import statistics
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # benchmarks._record, tests.support, gpucache from this checkout
from benchmarks._record import run_line, write_json  # noqa: E402
from benchmarks.node_shares import node  # noqa: E402


def make_shards(data: Path, count: int) -> dict[str, bytes]:
    """The photos of ``data`` (``*/class/*.jpg``) in ``count`` tars, in a seeded shuffled order."""
    photos = sorted(p for p in data.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg"))
    classes = sorted({p.parent.name for p in photos})
    random.Random(0).shuffle(photos)
    objects = {}
    for s in range(count):
        tar = io.BytesIO()
        with tarfile.open(fileobj=tar, mode="w") as tf:
            for i, p in enumerate(photos[s::count]):
                key = f"{s:03d}{i:05d}"
                for ext, blob in (
                    ("jpg", p.read_bytes()),
                    ("cls", str(classes.index(p.parent.name)).encode()),
                ):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(blob)
                    tf.addfile(info, io.BytesIO(blob))
        objects[f"shards/part-{s:03d}.tar"] = tar.getvalue()
    return objects


class Peak:
    """The most bytes allocated under ``folder`` while it is open (polled)."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.peak = folder, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _size(self) -> int:
        total = 0
        for root, _, files in os.walk(self.folder):
            for f in files:
                try:
                    total += os.stat(os.path.join(root, f)).st_blocks * 512
                except FileNotFoundError:
                    pass
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._size())
            self._stop.wait(0.002)

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._size())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=Path("/work/shared/data/hymenoptera"))
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--window-shards", type=int, default=2)
    ap.add_argument("--nodes", default="2,4")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    print(run_line())

    from gpucache import JpegCache
    from gpucache.shares import _tar as _tar_share
    from gpucache.shares._partition import node_bounds
    from tests.support.s3server import serving

    objects = make_shards(args.data, args.shards)
    sizes = [len(b) for b in objects.values()]
    whole = sum(sizes)
    urls = [f"s3://wdsbench/{k}" for k in objects]
    print(f"\n{args.shards} shards of {args.data}: {whole / 2**20:.1f} MiB")
    rows = []
    base = Path(tempfile.mkdtemp(prefix="gpucache-wds-shares-"))
    try:
        with serving("wdsbench", objects) as (server, _):
            for nodes in [int(n) for n in args.nodes.split(",")]:
                total = None
                for mode, window in (
                    ("window", args.window_shards * max(sizes)),
                    ("all", 2 * whole),
                ):
                    _tar_share.WINDOW_BYTES = window
                    held = []
                    for k in range(nodes):
                        folder = base / f"{nodes}-{mode}-{k}"
                        folder.mkdir()
                        server.reset_counts()
                        t0 = time.perf_counter()
                        with Peak(folder) as peak, node(nodes, k):
                            cache = JpegCache.from_webdataset(
                                urls, shard="node", cache_dir=folder, progress=False
                            )
                        seconds = time.perf_counter() - t0
                        gets = server.gets("/wdsbench/")
                        total = cache.node_share.total
                        held += cache.node_share.ranks.tolist()
                        rows.append(
                            dict(
                                nodes=nodes,
                                node=k,
                                mode=mode,
                                samples=len(cache),
                                peak_bytes=peak.peak,
                                peak_of_shards=peak.peak / whole,
                                store_bytes=cache.nbytes,
                                gets=sum(gets.values()),
                                ranged_gets=sum(gets.values()) - len(objects),
                                seconds=seconds,
                            )
                        )
                    assert total is not None
                    bounds = node_bounds(total, nodes)
                    assert sorted(held) == list(range(total)), (nodes, mode)
                    assert bounds[-1] == total
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(
        f"\nper node, window = {args.window_shards} shards ({args.window_shards * max(sizes) / 2**20:.1f}"
        " MiB) against every shard at once; peak = the most bytes in the node's cache folder"
    )
    print(
        f"{'nodes':>5} {'node':>4} {'mode':<6} {'samples':>7} {'peak MiB':>8} {'of shards':>9} "
        f"{'store MiB':>9} {'GETs':>4} {'ranged':>6} {'build s':>7}"
    )
    for r in rows:
        print(
            f"{r['nodes']:>5} {r['node']:>4} {r['mode']:<6} {r['samples']:>7} "
            f"{r['peak_bytes'] / 2**20:>8.1f} {r['peak_of_shards']:>9.2f} "
            f"{r['store_bytes'] / 2**20:>9.1f} {r['gets']:>4} {r['ranged_gets']:>6} "
            f"{r['seconds']:>7.2f}"
        )
    for nodes in sorted({r["nodes"] for r in rows}):
        for mode in ("window", "all"):
            mine = [r for r in rows if r["nodes"] == nodes and r["mode"] == mode]
            print(
                f"{nodes} nodes, {mode}: median peak {statistics.median(r['peak_of_shards'] for r in mine):.2f}"
                f" of the shards, median build {statistics.median(r['seconds'] for r in mine):.2f} s"
            )
    if args.json:
        write_json(args.json, {"shards": args.shards, "shard_bytes": sizes, "rows": rows})


if __name__ == "__main__":
    main()
