"""The README pipeline on the cpu backend over worker counts, and what the loop's process costs.

    PYTHONPATH=. python benchmarks/worker_scaling.py [SRC] [--workers 1,2] [--rounds 3]
        [--epochs 3] [--base DIR --base-commit SHA] [--json out.json]

SRC is an ImageFolder tree (default: ../shared/data/hymenoptera). Each run is a fresh process
holding one checkout of gpucache (this one, or ``--base DIR``, e.g. the commit before a change)
that builds the store, then iterates a ``GpuCachedLoader`` (cpu backend, fork workers, batch 64,
seed 0) with the README's transform (RandomResizedCrop 224 + flip + Normalize: float32 out) for
one untimed epoch and ``--epochs`` timed ones. Per timed epoch it records images/s (wall) and the
CPU time of the loop's process (``time.process_time``: all its threads) and of its worker
processes (``/proc/PID/stat``, utime + stime) per image. The loop's CPU time a image, t, caps the
loader at 1/t images/s whatever the worker count: the ``loop_cap_img_s`` column.

Runs are interleaved: every round runs every (checkout, workers) pair, the order flipped every
round; each figure is the median over rounds of the run's median epoch; ``/proc/loadavg`` is
recorded at each run's start and end. More workers than the machine's cores are not run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data" / "hymenoptera"


def _cpu_of(pids: list[int]) -> dict[int, float]:
    """utime + stime of each process of ``pids`` still running, seconds."""
    out = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # gone (a helper that ended)
            continue
        out[pid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def _children() -> list[int]:
    pids: list[int] = []
    for task in Path("/proc/self/task").iterdir():
        try:
            pids += [int(p) for p in (task / "children").read_text().split()]
        except FileNotFoundError:  # a thread that ended
            continue
    return pids


def child(src: str, workers: int, epochs: int) -> None:
    """One run, in a process whose ``gpucache`` is the checkout's: prints its JSON line."""
    from gpucache import GpuCachedLoader, JpegCache
    from gpucache import transforms as T

    cache = JpegCache.from_folder(src, progress=False)
    loader = GpuCachedLoader(
        cache,
        batch_size=64,
        shuffle=True,
        seed=0,
        transform=[
            T.RandomResizedCrop(224),
            T.RandomHorizontalFlip(),
            T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
        ],
        device="cpu",
        backend="cpu",
        num_workers=workers,
        multiprocessing_context="fork",
    )
    epochs_out = []
    for e in range(epochs + 1):
        w0 = _cpu_of(_children())
        c0, t0, seen = time.process_time(), time.perf_counter(), 0
        for images, labels in loader:
            assert images.dtype.is_floating_point and images.shape[1:] == (3, 224, 224)
            seen += len(labels)
        wall, loop = time.perf_counter() - t0, time.process_time() - c0
        w1 = _cpu_of(_children())
        workers_s = sum(t - w0.get(pid, 0.0) for pid, t in w1.items())
        if e:  # the first epoch starts the workers: untimed
            epochs_out.append(
                {
                    "img_s": seen / wall,
                    "loop_ms_per_image": loop / seen * 1e3,
                    "workers_ms_per_image": workers_s / seen * 1e3,
                }
            )
    loader.close()
    print(json.dumps(epochs_out))


def _run(checkout: Path, args, workers: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(checkout))
    load0 = open("/proc/loadavg").read().split()[0]
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), args.src, "--child", str(workers)]
        + ["--epochs", str(args.epochs)],
        env=env,
        capture_output=True,
        text=True,
        cwd=checkout,
    )
    if done.returncode:
        raise SystemExit(f"{checkout}, {workers} workers failed:\n{done.stderr}")
    out = done.stdout
    epochs = json.loads(out.strip().splitlines()[-1])
    row = {
        k: statistics.median(e[k] for e in epochs)
        for k in ("img_s", "loop_ms_per_image", "workers_ms_per_image")
    }
    row["epochs"] = epochs
    row["load_average"] = [float(load0), float(open("/proc/loadavg").read().split()[0])]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src", nargs="?", default=str(SHARED))
    p.add_argument("--workers", default="1,2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--base", type=Path, help="another checkout to run beside this one")
    p.add_argument("--base-commit", help="the commit --base holds")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.child is not None:
        child(args.src, args.child, args.epochs)
        return
    sys.path.insert(0, str(ROOT))
    from benchmarks._record import run_info, run_line, write_json

    run = run_info()
    print(run_line(), flush=True)
    counts = [int(w) for w in args.workers.split(",")]
    if max(counts) > (os.cpu_count() or 1):
        raise SystemExit(f"more workers than the {os.cpu_count()} cores: not a scaling measurement")
    checkouts = {"this": ROOT} | ({"base": args.base.resolve()} if args.base else {})
    configs = [(who, w) for w in counts for who in checkouts]
    runs = []
    for r in range(args.rounds):
        for who, w in configs if r % 2 == 0 else configs[::-1]:
            row = _run(checkouts[who], args, w)
            row.update(round=r, checkout=who, workers=w)
            runs.append(row)
            print(
                f"round {r} {who:<4} {w} workers: {row['img_s']:5.0f} img/s, loop "
                f"{row['loop_ms_per_image']:.3f} ms/img, workers "
                f"{row['workers_ms_per_image']:.2f} ms/img; load {row['load_average']}",
                flush=True,
            )
    rows = []
    for who, w in configs:
        mine = [x for x in runs if (x["checkout"], x["workers"]) == (who, w)]
        loop = statistics.median(x["loop_ms_per_image"] for x in mine)
        rows.append(
            {
                "checkout": who,
                "commit": run["commit"] if who == "this" else args.base_commit,
                "workers": w,
                "img_s_median": round(statistics.median(x["img_s"] for x in mine), 1),
                "img_s": [round(x["img_s"], 1) for x in mine],
                "loop_ms_per_image_median": round(loop, 3),
                "loop_cap_img_s": round(1e3 / loop),
                "workers_ms_per_image_median": round(
                    statistics.median(x["workers_ms_per_image"] for x in mine), 3
                ),
                "load_average": [x["load_average"] for x in mine],
            }
        )
    print("\ncheckout workers  img/s  loop ms/img  cap img/s  workers ms/img")
    for row in rows:
        print(
            f"{row['checkout']:<8} {row['workers']:>7} {row['img_s_median']:6.0f} "
            f"{row['loop_ms_per_image_median']:12.3f} {row['loop_cap_img_s']:10d} "
            f"{row['workers_ms_per_image_median']:15.2f}  {row['img_s']}"
        )
    if args.json:
        write_json(
            args.json,
            {"src": args.src, "epochs": args.epochs, "rows": rows, "runs": runs},
            run=run,
        )


if __name__ == "__main__":
    main()
