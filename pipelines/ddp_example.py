"""The first code block of docs/guides/multi-gpu.md as a script, one process a GPU (or CPU rank).

    torchrun --standalone --nproc_per_node=4 -m pipelines.ddp_example --data imagenet/train

Every rank runs the same lines: ``init_process_group``, ``JpegCache.from_folder`` (built once per
node and mapped by every rank), ``GpuCachedLoader(..., shuffle=True)`` with no seed or rank (the
process group's world size and rank, rank 0's seed). ``--shard`` builds each node's share of the
data set only (``shard="node"``). The other flags are for checks and measurements
(tests/test_distributed.py, tests/test_node_shares_jobs.py, benchmarks/ddp_copies.py): record the
labels each rank sees, its padding, and each node's store; save after some batches the loader's
state, resume from it at another world size or node count, fail a rank.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from gpucache import GpuCachedLoader, JpegCache
from gpucache import transforms as T


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="ImageFolder root")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--context", default=None, help="fork | spawn | forkserver (default: Python's)")
    p.add_argument(
        "--shard", action="store_true", help='each node builds its share only (shard="node")'
    )
    p.add_argument(
        "--record", type=Path, help="folder for per-rank labels, padding, pids, memory and stores"
    )
    p.add_argument(
        "--save-at",
        type=int,
        help="save the loader state after N batches of the last epoch (and go on)",
    )
    p.add_argument("--resume", type=Path, help="a state saved by --save-at")
    p.add_argument("--fail-rank", type=int, help="this rank raises after its first batch")
    p.add_argument("--hang", action="store_true", help="wait after the first batch (for SIGTERM)")
    args = p.parse_args(argv)
    if "LOCAL_RANK" not in os.environ:
        sys.exit(
            "pipelines.ddp_example: start it with torchrun, one process a rank, e.g. "
            "torchrun --standalone --nproc_per_node=2 -m pipelines.ddp_example --data ROOT "
            "(LOCAL_RANK is not set: this process was not started by a launcher)"
        )

    # ---- the code of docs/guides/multi-gpu.md
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    # built once per node, mapped by every rank
    cache = JpegCache.from_folder(args.data, shard="node" if args.shard else None)
    loader = GpuCachedLoader(
        cache,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        multiprocessing_context=args.context,
        transform=T.Compose([T.RandomResizedCrop(32), T.RandomHorizontalFlip()]),
    )
    # ----
    if args.resume is not None:
        loader.load_state_dict(torch.load(args.resume))
    rank, seen, padding = dist.get_rank(), [], []
    for epoch in range(args.epochs):
        labels_seen, t0 = [], time.perf_counter()
        for b, (_images, labels) in enumerate(loader):
            labels_seen += labels.tolist()  # the checks' data sets have one image per class
            if b == 0:
                _first_batch(args, loader, rank)
            if args.save_at == b + 1 and epoch == args.epochs - 1 and rank == 0:
                torch.save(loader.state_dict(), args.record / "state.pt")  # a checkpoint
        seen.append(labels_seen)
        padding.append(loader.epoch_padding)  # node shares: this rank's repeats in the pass
        if rank == 0:  # this rank's share; every rank sees about as many
            print(
                f"epoch {epoch + 1}/{args.epochs}: rank 0 of {dist.get_world_size()}, "
                f"{len(loader)} batches, {len(labels_seen) / (time.perf_counter() - t0):.0f} "
                "img/s",
                flush=True,
            )
    if args.record is not None:
        (args.record / f"seen-{rank}.json").write_text(json.dumps(seen))
        (args.record / f"padding-{rank}.json").write_text(json.dumps(padding))
        if int(os.environ["LOCAL_RANK"]) == 0:
            _record_store(args.record, cache)
        dist.barrier()  # every rank has finished its epochs, workers alive
        if rank == 0:
            import psutil

            from gpucache.testing._memory import pss, tree_pss

            agent = os.getppid()  # torchrun's agent: every rank and worker of this node below it
            each = {
                p.pid: pss(p.pid, without_libraries=True)
                for p in psutil.Process(agent).children(recursive=True)
            }
            (args.record / "pss.json").write_text(
                json.dumps(
                    {
                        "pss": tree_pss(agent, without_libraries=True),
                        "data": cache.nbytes,
                        "each": each,
                    }
                )
            )
        dist.barrier()
    loader.close()
    dist.destroy_process_group()


def _record_store(record: Path, cache: JpegCache) -> None:
    """``node-{node}.json``: what this node's store holds (its share with ``--shard``)."""
    share = cache.node_share
    if share is None:
        nodes = dist.get_world_size() // int(os.environ["LOCAL_WORLD_SIZE"])
        node = int(os.environ.get("GROUP_RANK", "0"))
    else:
        nodes, node = share.nodes, share.node
    store = {
        "nodes": nodes,
        "node": node,
        "nbytes": cache.nbytes,
        "len": len(cache),
        "labels": cache.labels.tolist(),
        "fetched": None if share is None else list(share.fetched),
        "tmpdir": os.environ.get("TMPDIR"),
    }
    (record / f"node-{node}.json").write_text(json.dumps(store))


def _first_batch(args, loader: GpuCachedLoader, rank: int) -> None:
    if args.record is not None:
        pids = [os.getpid(), *loader.worker_pids]
        (args.record / f"pids-{rank}.json").write_text(json.dumps(pids))
    if args.fail_rank == rank:
        raise RuntimeError(f"rank {rank} fails on purpose (--fail-rank)")
    if args.hang:
        dist.barrier()
        (args.record / f"hanging-{rank}").touch()
        import time

        time.sleep(600)


if __name__ == "__main__":
    main()
