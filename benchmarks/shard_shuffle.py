#!/usr/bin/env python
"""Shuffle quality of node shares (``shard="node"``): label histograms of global batches.

A job of ``nodes`` nodes x ``ranks`` ranks a node, batch ``B`` a rank: the global batch of step
``b`` is every rank's batch ``b`` together (``W B`` samples, ``W = nodes x ranks``). Three ways
of feeding it, all over the same listing:

- ``global``: one permutation of every sample an epoch (``default_rng([seed, epoch])``), global
  batch ``b`` = its samples ``[b W B, (b + 1) W B)``: what a full copy on every node with a
  DistributedSampler gives;
- ``hash``: node shares as ``shard="node"`` makes them and the loader plays them: node ``k`` holds
  the global ranks ``node_bounds(N, nodes)[k:k+2]`` of the salted-hash order
  (``gpucache.shares._partition.global_ranks``), visits them in the order
  ``gpucache.shares._order.NodeOrder.stream`` (``default_rng([seed, epoch, nodes, k])``) and
  deals them to its ranks; the global batch holds ``B r`` samples of each node's share;
- ``contiguous``: the bad baseline, node shares of the same sizes cut from the listing in
  ImageFolder (class-major) order, so a node holds whole classes; played as ``hash``.

Every epoch runs with ``drop_last`` (``NodeOrder.batches``), so every global batch holds ``W B``
distinct samples in all three. Per configuration it reports the total-variation distance
``0.5 sum_c |p_batch(c) - p_data(c)|`` between each global batch's label histogram and the data
set's label distribution (mean, standard deviation and 95th percentile over every step of
``--epochs`` epochs), and the largest distance between a node's share's class proportions and the
data set's; and per rank, the TV of its batches (what a rank's BatchNorm sees), the largest TV of
a rank's whole epoch and the fewest classes a rank sees in an epoch.

Under node shares the global batch is a stratified sample of a global shuffle (strata: the node
shares), whose class proportions vary no more than a simple random sample's, whatever the shares:
with ``hash`` shares (each a random sample of the data) every column matches ``global``; with
``contiguous`` shares the global batch is even a little closer to the data set's distribution
(stratified by class), and the damage shows per rank and per node: a rank sees only its node's
classes, in every batch and the whole epoch.

Listings: the photos of an ImageFolder tree with ``train/`` and ``val/`` (``--data``, default
hymenoptera: the real file names, so the partition is the real one; labels are the class folders
across both splits), and, with ``--synthetic C:K``, ``C`` classes x ``K`` files of generated
ImageNet-style names (``train/n0xxxxxxx/n0xxxxxxx_NNNN.JPEG``; synthetic names, not a real
data set; nothing is downloaded). ::

    python benchmarks/shard_shuffle.py --synthetic 100:300 --json benchmarks/results/shard-shuffle.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # benchmarks._record, and gpucache from this checkout
from benchmarks._record import run_info, run_line, write_json  # noqa: E402
from gpucache.ingest._build import scan_folder  # noqa: E402
from gpucache.shares._order import NodeOrder  # noqa: E402
from gpucache.shares._partition import PARTITIONS, global_ranks, node_bounds  # noqa: E402
from gpucache.shares._record import StoreShare  # noqa: E402


def folder_listing(root: Path) -> tuple[list[str], np.ndarray, list[str]]:
    """Every file of ``root/<split>/<class>/`` in ImageFolder order, split after split; labels by
    class name across the splits."""
    names: list[str] = []
    labels: list[str] = []
    for split in sorted(p for p in root.iterdir() if p.is_dir()):
        paths, lab, classes = scan_folder(split)
        names += [str(p) for p in paths]
        labels += [classes[i] for i in lab]
    classes = sorted(set(labels))
    return names, np.array([classes.index(c) for c in labels]), classes


def synthetic_listing(classes: int, per_class: int, seed: int = 0) -> tuple[list[str], np.ndarray]:
    """ImageNet-style names: ``train/n0xxxxxxx/n0xxxxxxx_NNNN.JPEG``, class-major."""
    rng = np.random.default_rng(seed)
    wnids = sorted({f"n0{x:07d}" for x in rng.choice(10**7, size=classes, replace=False)})
    names, labels = [], []
    for c, w in enumerate(wnids):
        for i in sorted(rng.choice(20_000, size=per_class, replace=False)):
            names.append(f"/data/imagenet/train/{w}/{w}_{i}.JPEG")
            labels.append(c)
    return names, np.array(labels)


def stream(total: int, seed: int, epoch: int, nodes: int, k: int) -> np.ndarray:
    """Node ``k``'s global ranks in the epoch's order: the loader's own function."""
    share = StoreShare(PARTITIONS, total, nodes, 0, np.empty(0, np.int64), "", (0, 0, 0, 0))
    return NodeOrder(share, num_replicas=nodes, rank=0).stream(seed, epoch, nodes, k, True)


def global_batches(
    kind: str, labels_by_rank: np.ndarray, nodes: int, ranks: int, batch: int, epoch: int, seed: int
) -> np.ndarray:
    """(steps, W, B) labels: at each step of the epoch, the batch of each rank of the job (rank
    ``k r + l`` is local rank ``l`` of node ``k``). ``labels_by_rank[j]``: the label of the sample
    at place ``j`` of the partition order (hash order, or listing order)."""
    n = len(labels_by_rank)
    w = nodes * ranks
    if kind == "global":  # DistributedSampler: rank i takes places i, i + W, ... of the shuffle
        perm = np.random.default_rng([seed, epoch]).permutation(n)
        steps = n // (w * batch)
        per_rank = labels_by_rank[perm[: steps * w * batch]].reshape(steps * batch, w)
        return per_rank.T.reshape(w, steps, batch).transpose(1, 0, 2)
    lengths = np.diff(node_bounds(n, nodes)).tolist()
    steps = NodeOrder.batches(lengths, ranks, batch, drop_last=True)
    out = np.empty((steps, w, batch), dtype=labels_by_rank.dtype)
    for k in range(nodes):
        s = stream(n, seed, epoch, nodes, k)[: steps * batch * ranks]
        slots = labels_by_rank[s].reshape(steps, batch, ranks)  # slot i to local rank i % r
        out[:, k * ranks : (k + 1) * ranks, :] = slots.transpose(0, 2, 1)
    return out


def tv(hist: np.ndarray, p: np.ndarray) -> np.ndarray:
    """Total-variation distance of each histogram (last axis) from the distribution ``p``."""
    return 0.5 * np.abs(hist / hist.sum(axis=-1, keepdims=True) - p).sum(axis=-1)


def histograms(labels: np.ndarray, c: int) -> np.ndarray:
    """Label counts over the last axis."""
    flat = labels.reshape(-1, labels.shape[-1])
    offset = np.arange(len(flat))[:, None] * c
    counts = np.bincount((flat + offset).ravel(), minlength=len(flat) * c)
    return counts.reshape(*labels.shape[:-1], c)


def _stats(x: np.ndarray) -> dict:
    if not len(x):
        return {"mean": None, "std": None, "p95": None}
    return {"mean": float(x.mean()), "std": float(x.std()), "p95": float(np.percentile(x, 95))}


def measure(
    labels: np.ndarray,
    names: list[str],
    configs: list[tuple[int, int, int]],
    epochs: int,
    seed: int,
) -> list[dict]:
    c = int(labels.max()) + 1
    p = np.bincount(labels, minlength=c) / len(labels)
    ranks_of, _ = global_ranks(names)  # listing position -> global rank
    hash_order = np.empty(len(names), np.int64)
    hash_order[ranks_of] = np.arange(len(names))
    by_kind = {
        "global": labels,
        "hash": labels[hash_order],  # place j of the hash order: listing position hash_order[j]
        "contiguous": labels[np.argsort(labels, kind="stable")],  # ImageFolder: class-major
    }
    rows = []
    for nodes, ranks, batch in configs:
        for kind, ordered in by_kind.items():
            g_tv, r_tv, e_tv, seen = [], [], [], []
            for e in range(epochs):
                g = global_batches(kind, ordered, nodes, ranks, batch, e, seed)
                if not len(g):
                    continue
                g_tv.append(tv(histograms(g.reshape(len(g), -1), c), p))
                r_tv.append(tv(histograms(g, c), p).ravel())
                epoch_hist = histograms(g.transpose(1, 0, 2).reshape(g.shape[1], -1), c)
                e_tv.append(tv(epoch_hist, p).max())
                seen.append((epoch_hist > 0).sum(axis=1).min())
            if kind == "global":
                node_tv = 0.0
            else:
                b = node_bounds(len(ordered), nodes)
                node_tv = max(
                    float(tv(np.bincount(ordered[b[k] : b[k + 1]], minlength=c), p))
                    for k in range(nodes)
                )
            steps = int(sum(len(x) for x in g_tv))
            rows.append(
                {
                    "nodes": nodes,
                    "ranks_per_node": ranks,
                    "batch": batch,
                    "global_batch": nodes * ranks * batch,
                    "kind": kind,
                    "steps": steps,
                    "global_batch_tv": _stats(np.concatenate(g_tv) if g_tv else np.empty(0)),
                    "rank_batch_tv": _stats(np.concatenate(r_tv) if r_tv else np.empty(0)),
                    "rank_epoch_tv_max": float(max(e_tv)) if e_tv else None,
                    "rank_epoch_classes_min": int(min(seen)) if seen else None,
                    "node_share_tv_max": node_tv,
                }
            )
    return rows


def show(title: str, rows: list[dict], classes: int) -> None:
    print(f"\n{title}")
    print(
        f"{'nodes':>5} {'r':>2} {'B':>3} {'W*B':>5}  {'kind':<10} {'steps':>5}  "
        f"{'global batch TV mean/std/p95':>28}  {'rank batch TV':>13}  "
        f"{'rank epoch TV max':>17}  {'classes/rank':>12}  {'node TV max':>11}"
    )
    for r in rows:
        g = r["global_batch_tv"]
        if r["steps"] == 0:
            stats = f"{'-':>28}  {'-':>13}  {'-':>17}  {'-':>12}"
        else:
            stats = (
                f"{g['mean']:8.4f} {g['std']:9.4f} {g['p95']:9.4f}  "
                f"{r['rank_batch_tv']['mean']:13.4f}  {r['rank_epoch_tv_max']:17.4f}  "
                f"{r['rank_epoch_classes_min']:>5} of {classes:<4}"
            )
        print(
            f"{r['nodes']:>5} {r['ranks_per_node']:>2} {r['batch']:>3} {r['global_batch']:>5}  "
            f"{r['kind']:<10} {r['steps']:>5}  {stats}  {r['node_share_tv_max']:11.4f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=Path("/work/shared/data/hymenoptera"))
    ap.add_argument("--synthetic", default=None, help="C:K, classes x files of generated names")
    ap.add_argument("--nodes", default="2,4,8")
    ap.add_argument("--ranks", type=int, default=2, help="ranks per node")
    ap.add_argument("--batches", default="8,16,32", help="batch sizes a rank")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    run = run_info()
    print(run_line())
    configs = [
        (n, args.ranks, b)
        for n in map(int, args.nodes.split(","))
        for b in map(int, args.batches.split(","))
    ]
    result: dict = {"epochs": args.epochs, "seed": args.seed}
    names, labels, classes = folder_listing(args.data)
    rows = measure(labels, names, configs, args.epochs, args.seed)
    result["photos"] = {
        "data": str(args.data),
        "files": len(names),
        "classes": classes,
        "class_counts": np.bincount(labels).tolist(),
        "rows": rows,
    }
    counts = ", ".join(f"{c} {k}" for c, k in zip(classes, np.bincount(labels)))
    show(f"{args.data}: {len(names)} files ({counts}), real names and labels", rows, len(classes))
    if args.synthetic:
        c, k = map(int, args.synthetic.split(":"))
        names, labels = synthetic_listing(c, k)
        rows = measure(labels, names, configs, args.epochs, args.seed)
        result["synthetic"] = {"classes": c, "per_class": k, "example": names[0], "rows": rows}
        show(
            f"synthetic ImageNet-style names ({c} classes x {k}, e.g. {names[0]}): generated "
            "names and labels, not a real data set",
            rows,
            c,
        )
    print(
        "\nTV: total-variation distance of a label histogram from the data set's label "
        "distribution (0: the same; 1: disjoint). global batch: the W*B samples of a step, "
        f"every step of {args.epochs} epochs (drop_last); rank batch: one rank's B samples "
        "(what a rank's BatchNorm sees); rank epoch TV max / classes/rank: the farthest rank's "
        "whole epoch, and the fewest classes a rank sees in an epoch; node TV max: the farthest "
        "node share. Under node shares the global batch is a stratified sample of a global "
        "shuffle (strata: the node shares), whose class proportions vary no more than a simple "
        "random sample's whatever the shares: contiguous "
        "shares show in the ranks' and the nodes' columns, not in the global batch's."
    )
    if args.json:
        write_json(args.json, result, run=run)


if __name__ == "__main__":
    main()
