#!/usr/bin/env python
"""Repeats of an epoch resumed at another node count (``shard="node"``): the loader's order
functions alone (``gpucache.shares._order.NodeOrder``), over stores that hold what each node's
build would hold, so thousands of resumes take seconds and no image is decoded.

A job of ``--samples`` samples runs ``--before`` nodes (``--ranks`` ranks a node, batch
``--batch``) for ``--at`` batches of an epoch, saves its state and resumes at ``--after`` nodes
for the rest of the epoch. Each node's store at the new layout holds its share, plus the
samples of other shares the rebalanced remainders hand it (``NodeOrder.foreign``, what
``Store._holding`` fetches from the source), where the code has them. Over ``--seeds`` seeds
(and every save point from 1 batch to the epoch's last, a fraction ``--points`` of them), it
counts, across all ranks of both parts, the samples played, those never played and the
repeats (played - samples), and the foreign samples a node fetched.

    python benchmarks/elastic_repeats.py --json benchmarks/results/elastic-repeats.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from gpucache.shares._order import NodeOrder, Segment  # noqa: E402
from gpucache.shares._partition import PARTITIONS, node_bounds  # noqa: E402
from gpucache.shares._record import StoreShare  # noqa: E402


def share(total: int, nodes: int, node: int, extra: np.ndarray | None = None) -> StoreShare:
    lo, hi = node_bounds(total, nodes)[node : node + 2]
    ranks = np.arange(lo, hi, dtype=np.int64)
    if extra is not None and len(extra):
        ranks = np.union1d(ranks, extra)
    return StoreShare(PARTITIONS, total, nodes, node, ranks, "0" * 32, (0, 0, 0, 0))


def orders(total: int, nodes: int, ranks: int, fetch: bool, state) -> tuple[list, int]:
    """Every rank's order at ``nodes`` nodes, each node's store holding what its build would
    (its share, and with ``fetch`` the samples handed to it); and the samples fetched."""
    world, out, fetched = nodes * ranks, [], 0
    for k in range(nodes):
        first = NodeOrder(share(total, nodes, k), num_replicas=world, rank=k * ranks)
        extra = None
        if fetch and hasattr(first, "foreign") and state is not None:
            extra = first.foreign(*state)
            fetched += len(extra)
        held = share(total, nodes, k, extra)
        out += [NodeOrder(held, num_replicas=world, rank=k * ranks + r) for r in range(ranks)]
    return out, fetched


def played(order: NodeOrder, args, batches: int | None) -> np.ndarray:
    plan = order.plan(*args)
    ranks = np.asarray(order.share.ranks)[plan.indices]
    return ranks if batches is None else ranks[: batches * args[4]]


def resume(total, before, after, per_node, batch, seed, at, shuffle=True) -> dict:
    first, _ = orders(total, before, per_node, False, None)
    head = [played(o, (seed, 0, shuffle, [], batch, False), at) for o in first]
    prior = [Segment(before, per_node, batch, at)]
    second, fetched = orders(total, after, per_node, True, (seed, 0, shuffle, prior))
    tail = [played(o, (seed, 0, shuffle, prior, batch, False), None) for o in second]
    every = np.concatenate(head + tail)
    counts = np.bincount(every, minlength=total)
    return {
        "played": int(len(every)),
        "missed": int((counts == 0).sum()),
        "repeats": int(len(every) - total),
        "fetched": fetched,
        "batches_each": sorted({len(t) for t in tail}),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=1000)
    p.add_argument("--before", type=int, default=2)
    p.add_argument("--after", type=int, default=3)
    p.add_argument("--ranks", type=int, default=1, help="ranks a node")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seeds", type=int, default=50)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    t0 = time.perf_counter()
    per_rank = -(-a.samples // (a.before * a.ranks))
    batches = -(-per_rank // a.batch)
    rows = []
    for seed in range(a.seeds):
        for at in range(1, batches):
            r = resume(a.samples, a.before, a.after, a.ranks, a.batch, seed, at)
            rows.append({"seed": seed, "at": at, **r})
    reps = [r["repeats"] for r in rows]
    out = {
        "config": vars(a) | {"json": str(a.json) if a.json else None},
        "resumes": len(rows),
        "missed_any": sum(r["missed"] > 0 for r in rows),
        "repeats": {"min": min(reps), "median": statistics.median(reps), "max": max(reps)},
        "fetched_per_resume": {
            "median": statistics.median(r["fetched"] for r in rows),
            "max": max(r["fetched"] for r in rows),
        },
        "ranks": a.after * a.ranks,
        "seconds": time.perf_counter() - t0,
    }
    print(json.dumps({k: v for k, v in out.items() if k != "config"}))
    if a.json:
        a.json.write_text(json.dumps({**out, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
