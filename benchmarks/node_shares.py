#!/usr/bin/env python
"""Node shares (``shard="node"``) against a full copy on every node: store bytes, what is read
from the source, memory, loader throughput, and what a change of node count reads again.

Every photo of a folder (``--data``, default hymenoptera: ``train/`` and ``val/``, labels by
class folder) is copied to a temporary source folder; the nodes of a job are simulated in this
one process, one after another, by the launcher's variables (``WORLD_SIZE`` = nodes,
``LOCAL_WORLD_SIZE=1``, ``GROUP_RANK`` = ``RANK`` = the node), each node with its own node cache
(``cache_dir``):

1. build: on each of 2 nodes, ``JpegCache.from_files(paths, labels, shard="node")`` and the full
   copy (``shard=None``, in another folder): samples, ``cache.nbytes``, the store file's size,
   ``cache.node_share.fetched`` (objects and bytes read from the source), and the source files
   opened during the build by this process (the watch below);
2. elastic: the same build at 3 nodes, each node's cache folder the one it had at 2 nodes (node
   2 a new, empty one): per node, objects and bytes read from the source against reused from its
   store of 2 nodes, against its whole share;
3. throughput and memory on node 0 of 2: ``GpuCachedLoader(num_replicas=2, rank=0,
   backend="cpu")`` with RandomResizedCrop 224 + horizontal flip, batch 32, shuffled, over the
   node's share and over the full copy (each rank plays half the data set an epoch either way);
   one untimed epoch each, then ``--rounds`` rounds that interleave ``--epochs`` epochs of each;
   images/s is the median over rounds (and the median of the rounds' shard/full ratios); the
   shard loader's epoch counts its repeats (``loader.epoch_padding``). During these epochs every
   open and read of a source file is counted, by process: fanotify on every source folder (as
   root; it names each event's process, so the loader's process and workers are told apart from
   anything else on the machine), else inotify (any process); after them, the PSS of each store file's mappings summed over the loader's
   process and workers (the store's pages each loader holds), and the whole tree's PSS without
   shared libraries;
4. the source folder renamed away, one more epoch of each loader (then put back).

::

    python benchmarks/node_shares.py --rounds 15 --epochs 2 --json benchmarks/results/node-shares-hymenoptera.json
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # benchmarks._record, and gpucache from this checkout
from benchmarks._record import run_info, run_line, write_json  # noqa: E402

BATCH, SIZE = 32, 224
IN_ACCESS, IN_OPEN = 0x1, 0x20
OPEN, ACCESS = 0x20, 0x1  # the same bits in fanotify
FAN_CLOEXEC, FAN_NONBLOCK, FAN_MARK_ADD = 0x1, 0x2, 0x1
FAN_ACCESS, FAN_OPEN, FAN_EVENT_ON_CHILD, AT_FDCWD = 0x1, 0x20, 0x08000000, -100
LAUNCHER = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "RANK", "LOCAL_RANK")


class Watch:
    """Opens and reads of the files in every folder under ``root``, by any process: fanotify
    (root only), which names the process of each event, else inotify, which does not."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.libc = ctypes.CDLL(None, use_errno=True)
        folders = [root, *(p for p in root.rglob("*") if p.is_dir())]
        self.libc.fanotify_mark.argtypes = [
            ctypes.c_int,
            ctypes.c_uint,
            ctypes.c_uint64,
            ctypes.c_int,
            ctypes.c_char_p,
        ]
        self.fd = self.libc.fanotify_init(FAN_CLOEXEC | FAN_NONBLOCK, os.O_RDONLY)
        self.kind = "fanotify"
        if self.fd < 0:  # not root: inotify, without the process
            self.kind = "inotify"
            self.fd = self.libc.inotify_init1(os.O_NONBLOCK)
            if self.fd < 0:
                raise OSError(ctypes.get_errno(), "inotify_init1")
        self.folders: dict[int, str] = {}
        for d in folders:
            if self.kind == "fanotify":
                mask = FAN_OPEN | FAN_ACCESS | FAN_EVENT_ON_CHILD
                ok = self.libc.fanotify_mark(self.fd, FAN_MARK_ADD, mask, AT_FDCWD, os.fsencode(d))
            else:
                ok = self.libc.inotify_add_watch(self.fd, os.fsencode(d), IN_ACCESS | IN_OPEN)
                self.folders[ok] = str(d.relative_to(root))
            if ok < 0:
                raise OSError(ctypes.get_errno(), f"watching {d}")

    def _events(self) -> Iterator[tuple[int | None, str, int]]:
        """(process id or None, file, mask) of each event since the last call."""
        while True:
            try:
                buf = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return
            at = 0
            while at < len(buf):
                if self.kind == "fanotify":
                    size, _, _, _, mask, fd, pid = struct.unpack_from("=IBBHQii", buf, at)
                    at += size
                    if fd < 0:
                        continue
                    try:
                        where = os.readlink(f"/proc/self/fd/{fd}")
                    finally:
                        os.close(fd)
                    yield pid, os.path.relpath(where, self.root), mask
                else:
                    wd, mask, _, n = struct.unpack_from("iIII", buf, at)
                    name = buf[at + 16 : at + 16 + n].rstrip(b"\0").decode()
                    at += 16 + n
                    if name:  # not the folder itself (a listing)
                        yield None, f"{self.folders.get(wd, '?')}/{name}", mask

    def take(self) -> dict:
        """Events since the last call: files opened, open and read events, by this process and
        its children (with inotify: by any process) and by other processes."""
        import psutil

        ours = {os.getpid(), *(c.pid for c in psutil.Process().children(recursive=True))}
        out = {who: {"files_opened": set(), "opens": 0, "reads": 0} for who in ("ours", "others")}
        others: dict[int, str] = {}
        for pid, where, mask in self._events():
            who = "ours" if pid is None or pid in ours else "others"
            if who == "others" and pid not in others:
                try:
                    others[pid] = " ".join(psutil.Process(pid).cmdline())[:120]
                except psutil.Error:
                    others[pid] = "(gone)"
            if mask & OPEN:
                out[who]["files_opened"].add(where)
                out[who]["opens"] += 1
            if mask & ACCESS:
                out[who]["reads"] += 1
        result: dict = {"watch": self.kind}
        for who, c in out.items():
            result[who] = {**c, "files_opened": len(c["files_opened"])}
        result["other_processes"] = {str(k): v for k, v in others.items()}
        return result

    def close(self) -> None:
        os.close(self.fd)


@contextmanager
def node(nodes: int, k: int) -> Iterator[None]:
    """The launcher's variables of node ``k`` of ``nodes`` (one rank a node)."""
    before = {v: os.environ.get(v) for v in LAUNCHER}
    os.environ.update(
        WORLD_SIZE=str(nodes), LOCAL_WORLD_SIZE="1", GROUP_RANK=str(k), RANK=str(k), LOCAL_RANK="0"
    )
    try:
        yield
    finally:
        for v, x in before.items():
            if x is None:
                os.environ.pop(v, None)
            else:
                os.environ[v] = x


def copy_photos(data: Path, dest: Path) -> tuple[list[str], list[int], list[str]]:
    """``data/<split>/<class>/<file>`` copied to ``dest``; the files and labels in ImageFolder
    order, split after split (labels by class name across the splits)."""
    from gpucache.ingest._build import scan_folder

    names, by_class = [], []
    for split in sorted(p for p in data.iterdir() if p.is_dir()):
        paths, labels, classes = scan_folder(split)
        for p, lab in zip(paths, labels):
            to = dest / Path(p).relative_to(data)
            to.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, to)
            names.append(str(to))
            by_class.append(classes[lab])
    classes = sorted(set(by_class))
    return names, [classes.index(c) for c in by_class], classes


def build(paths, labels, classes, cache_dir: Path, shard: str | None, watch: Watch) -> tuple:
    from gpucache import JpegCache

    watch.take()
    t0 = time.perf_counter()
    cache = JpegCache.from_files(
        paths, labels, classes=classes, cache_dir=cache_dir, shard=shard, progress=False
    )
    seconds = time.perf_counter() - t0
    seen = watch.take()
    share = cache.node_share
    row = {
        "samples": len(cache),
        "nbytes": int(cache.nbytes),
        "file_bytes": cache.path.stat().st_size if cache.path else None,
        "build_s": round(seconds, 3),
        "source_files_opened": seen["ours"]["files_opened"],
        "source_by_others": seen["others"],
    }
    if share is not None:
        row["fetched"] = dict(
            zip(("objects", "bytes", "reused_objects", "reused_bytes"), share.fetched)
        )
        row["share"] = {"nodes": share.nodes, "node": share.node, "total": share.total}
    return cache, row


def mapped_pss(pids: list[int], files: dict[str, str]) -> dict[str, int]:
    """PSS of each file's mappings (``files``: name -> path), summed over ``pids``."""
    out = dict.fromkeys(files, 0)
    by_path = {os.path.realpath(p): k for k, p in files.items()}
    for pid in pids:
        try:
            text = Path(f"/proc/{pid}/smaps").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        current = None
        for line in text.splitlines():
            head = line.split(None, 5)
            if head and "-" in head[0] and ":" not in head[0] and len(head) >= 5:
                current = by_path.get(head[5]) if len(head) > 5 else None
            elif current is not None and line.startswith("Pss:"):
                out[current] += int(line.split()[1]) * 1024
    return out


def run_epoch(loader, epoch: int) -> int:
    loader.set_epoch(epoch)
    n = 0
    for images, _ in loader:
        assert images.shape[-2:] == (SIZE, SIZE)
        n += len(images)
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=Path("/work/shared/data/hymenoptera"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=2, help="epochs of each loader a round")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    run = run_info()
    print(run_line())
    import psutil

    from gpucache import GpuCachedLoader
    from gpucache import transforms as T
    from gpucache.testing._memory import tree_pss

    result: dict = {"data": str(args.data), "batch_size": BATCH, "workers": args.workers}
    with tempfile.TemporaryDirectory(prefix="gpucache-node-shares-") as tmp:
        base = Path(tmp)
        src = base / "source"
        paths, labels, classes = copy_photos(args.data, src)
        source_bytes = sum(os.path.getsize(p) for p in paths)
        result["source"] = {"files": len(paths), "bytes": source_bytes, "classes": classes}
        print(f"\nsource: {len(paths)} files, {source_bytes / 2**20:.1f} MiB ({args.data})")
        watch = Watch(src)

        # 1. build at 2 nodes, shares and full copies
        builds, stores = [], {}
        for k in range(2):
            with node(2, k):
                shard, srow = build(paths, labels, classes, base / f"node{k}", "node", watch)
                full, frow = build(paths, labels, classes, base / f"full{k}", None, watch)
            stores[k] = (shard, full)
            builds.append({"node": k, "shard": srow, "full": frow})
        result["build"] = builds
        print("\nbuild at 2 nodes (one rank a node), per node: node share against full copy")
        print(
            f"{'node':>4}  {'':<6} {'samples':>7} {'store MiB':>9} {'file MiB':>8} "
            f"{'ratio':>5} {'files opened':>12} {'read from source':>16} {'build s':>7}"
        )
        for b in builds:
            for kind in ("shard", "full"):
                r = b[kind]
                ratio = r["nbytes"] / b["full"]["nbytes"]
                read = (
                    f"{r['fetched']['objects']} / {r['fetched']['bytes'] / 2**20:.1f} MiB"
                    if "fetched" in r
                    else "-"
                )
                print(
                    f"{b['node']:>4}  {kind:<6} {r['samples']:>7} {r['nbytes'] / 2**20:9.2f} "
                    f"{r['file_bytes'] / 2**20:8.2f} {ratio:5.2f} "
                    f"{r['source_files_opened']:>12} {read:>16} {r['build_s']:7.2f}"
                )

        # 2. elastic: 2 -> 3 nodes
        elastic = []
        for k in range(3):
            with node(3, k):
                cache, row = build(paths, labels, classes, base / f"node{k}", "node", watch)
            row["node"] = k
            elastic.append(row)
            del cache
        result["elastic_2_to_3"] = elastic
        print(
            "\nnode count 2 -> 3: each node's build at 3 nodes in its cache folder of 2 nodes "
            "(node 2: a new, empty one)"
        )
        print(
            f"{'node':>4} {'share':>5} {'share MiB':>9}  {'read from source':>18}  "
            f"{'reused from its 2-node store':>28}  {'files opened':>12}"
        )
        for r in elastic:
            f = r["fetched"]
            size = (f["bytes"] + f["reused_bytes"]) / 2**20
            print(
                f"{r['node']:>4} {r['samples']:>5} {size:9.2f}  "
                f"{f['objects']:>5} / {f['bytes'] / 2**20:6.2f} MiB  "
                f"{f['reused_objects']:>11} / {f['reused_bytes'] / 2**20:6.2f} MiB  "
                f"{r['source_files_opened']:>12}"
            )

        # 3. throughput and memory on node 0
        shard, full = stores[0]
        tf = [T.RandomResizedCrop(SIZE), T.RandomHorizontalFlip()]
        loaders = {}
        with node(2, 0):
            for name, cache in (("shard", shard), ("full", full)):
                loaders[name] = GpuCachedLoader(
                    cache,
                    batch_size=BATCH,
                    shuffle=True,
                    seed=0,
                    num_replicas=2,
                    rank=0,
                    num_workers=args.workers,
                    device="cpu",
                    backend="cpu",
                    transform=tf,
                )
        images = {k: run_epoch(v, 0) for k, v in loaders.items()}  # workers started: untimed
        padding = {k: int(v.epoch_padding) for k, v in loaders.items()}
        watch.take()
        seconds: dict[str, list[float]] = {k: [] for k in loaders}
        epoch = 1
        for _ in range(args.rounds):
            for name, loader in loaders.items():
                t0 = time.perf_counter()
                for e in range(args.epochs):
                    assert run_epoch(loader, epoch + e) == images[name]
                seconds[name].append(time.perf_counter() - t0)
            epoch += args.epochs
        during = watch.take()
        procs = [psutil.Process(), *psutil.Process().children(recursive=True)]
        files = {k: str(c.path) for k, c in (("shard", shard), ("full", full))}
        pss = mapped_pss([p.pid for p in procs], files)
        tree = tree_pss(without_libraries=True)
        rate = {k: images[k] * args.epochs / statistics.median(v) for k, v in seconds.items()}
        paired = statistics.median(  # per round: shard images/s over full copy images/s
            (images["shard"] / s) / (images["full"] / f)
            for s, f in zip(seconds["shard"], seconds["full"])
        )

        # 4. the source folder gone
        moved = base / "source-moved"
        src.rename(moved)
        try:
            gone = {k: run_epoch(v, epoch) for k, v in loaders.items()}
        finally:
            moved.rename(src)
        for loader in loaders.values():
            loader.close()
        watch.close()
        result["loader"] = {
            "node": 0,
            "nodes": 2,
            "num_replicas": 2,
            "rank": 0,
            "images_per_epoch": images,
            "padding_per_epoch": padding,
            "rounds": args.rounds,
            "epochs_per_round": args.epochs,
            "seconds": seconds,
            "images_per_second": {k: round(v, 1) for k, v in rate.items()},
            "shard_over_full_median_of_rounds": round(paired, 3),
            "load_average_after": os.getloadavg(),
            "source_during_epochs": during,
            "store_pss": pss,
            "tree_pss_without_libraries": tree,
            "processes": len(procs),
            "epoch_with_source_renamed": gone,
        }
        print(
            f"\nloader on node 0 of 2 (rank 0 of 2), cpu backend, RandomResizedCrop {SIZE} + "
            f"flip, batch {BATCH}, {args.workers} workers; median of {args.rounds} "
            f"interleaved rounds of {args.epochs} epochs"
        )
        print(
            f"{'store':<6} {'images/epoch':>12} {'images/s':>9} {'min-max s/round':>16} "
            f"{'store PSS MiB':>13} {'store MiB':>9} {'repeats/epoch':>13}"
        )
        for k in loaders:
            c = shard if k == "shard" else full
            print(
                f"{k:<6} {images[k]:>12} {rate[k]:9.1f} "
                f"{min(seconds[k]):7.2f}-{max(seconds[k]):<7.2f} {pss[k] / 2**20:13.2f} "
                f"{c.nbytes / 2**20:9.2f} {padding[k]:>13}"
            )
        print(f"shard over full copy, images/s, median of the rounds' ratios: {paired:.2f}")
        mine, theirs = during["ours"], during["others"]
        by_others = (
            f" ({theirs['opens']} opens by other processes on the machine: "
            f"{', '.join(during['other_processes'].values())})"
            if theirs["opens"] or theirs["reads"]
            else ""
        )
        print(
            f"source during the {args.rounds * args.epochs * 2} timed epochs ({during['watch']}"
            f"): {mine['files_opened']} files opened, {mine['opens']} opens, {mine['reads']} "
            f"reads by the loaders' processes{by_others}; source folder renamed away: one "
            f"more epoch of each delivered {gone['shard']} and {gone['full']} images"
        )
        print(
            f"whole process tree ({len(procs)} processes, both loaders): "
            f"{tree / 2**20:.1f} MiB PSS without shared libraries"
        )
    if args.json:
        write_json(args.json, result, run=run)


if __name__ == "__main__":
    main()
