"""What a CPU worker holds: its private memory over epochs, what it is made of, and the copies a
full garbage collection makes, in one process and on the ranks of a torchrun job.

    python benchmarks/worker_memory.py photos [--data DIR] [--epochs 10] [--json F]
    python benchmarks/worker_memory.py ranks [--data DIR] [--runs 3] [--json F]
    python benchmarks/worker_memory.py all --out benchmarks/results/worker-memory

*Private dirty* is the memory only that process holds (``Private_Dirty`` of
``/proc/PID/smaps_rollup``): pages it wrote, its own or copied from its parent on first write. It
is what ``loader.stats.worker_private`` reports.

``photos``: one fresh interpreter per configuration builds a store of DIR (an ImageFolder; 397
hymenoptera photos by default), runs ``--epochs`` epochs of GpuCachedLoader (backend="cpu", 2
fork workers, batch 64, RandomResizedCrop 224 + flip) and reads each worker's private dirty memory
at start (in ``worker_init_fn``), at rest after epochs 1, 2, 4 and 10 (once two readings 20 ms
apart agree: a worker that has just run out of tasks may still be handing memory back), and
after every batch of epochs 2-4 (busy). At rest after epochs 4 and 10 it is split by mapping
(``/proc/PID/smaps``). The configurations switch the worker pool's memory measures off and on
one at a time: the decoder's self-check in the parent before the fork
(``cpu._procs._check_decoder``), malloc_trim when a worker runs out of tasks
(``cpu._worker._malloc_trim``), ``gc.freeze()`` before the fork (``cpu._procs._freeze``), each
switched off by patching that function;
two more run a full ``gc.collect()`` in each worker's ``worker_init_fn`` with and without them.
Every batch is checked: uint8 (n, 3, 224, 224), n labels, every sample once an epoch.

``ranks``: ``torchrun --standalone --nproc_per_node=3`` (gloo on the loopback, CPU) runs this file
as each rank: a store of DIR built once for the node, GpuCachedLoader (2 fork workers, batch 16,
Resize 64 + CenterCrop 64), 2 epochs; then rank 0 reads, with every worker alive and at rest, the
private dirty memory and the PSS (shared libraries left out; see gpucache/testing/_memory.py) of
every process under torchrun's agent: 3 ranks and 6 workers. Scenarios: no collection forced; a
full collection in every worker (``worker_init_fn``); that and then a full collection in every
rank's main process after the epochs -- each with and without the pool's ``gc.freeze()`` before
the fork; and the last in a program that calls ``gc.freeze()`` itself before it makes the loader
(the pool's freeze on). ``--runs`` launches each, the median reported. The summed PSS is what the node holds; summed
private dirty counts more, since a page the parent still holds but both its workers copied is
private to the parent too.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # benchmarks._record
from benchmarks._record import run_info, write_json  # noqa: E402

SHARED = REPO.parent / "shared" / "data" / "hymenoptera"
MIB = 2**20

# name -> (decoder check before the fork, malloc_trim when idle, gc.freeze() at the fork,
# gc.collect() in worker_init_fn,
# glibc's mmap threshold pinned by mallopt in worker_init_fn: bytes, 0 to leave it dynamic)
CONFIGS = {
    "none": (False, False, False, False, 0),
    "check": (True, False, False, False, 0),
    "trim": (False, True, False, False, 0),
    "check+trim": (True, True, False, False, 0),
    "check+trim+freeze": (True, True, True, False, 0),
    "check+mmap threshold 128K": (True, False, False, False, 128 * 1024),
    "none, worker gc": (False, False, False, True, 0),
    "check+trim+freeze, worker gc": (True, True, True, True, 0),
}
# where a full collection is forced; "program froze" is workers+parent in a program that calls
# gc.freeze() itself before it makes the loader
SCENARIOS = ["none", "workers", "workers+parent", "program froze"]


# ------------------------------------------------------------------------------ measuring
def private_dirty(pid: int) -> int:
    """What ``loader.stats.worker_private`` reads (the library's reader), for a live process."""
    from gpucache.decode.cpu._procs import private_dirty as read

    size = read(pid)
    if size is None:
        raise ProcessLookupError(f"cannot read /proc/{pid}/smaps_rollup")
    return size


def at_rest(pids: list[int], deadline_s: float = 10.0) -> list[int]:
    """Private dirty of each pid, once two readings 20 ms apart agree (or at the deadline)."""
    end = time.monotonic() + deadline_s
    last = [private_dirty(p) for p in pids]
    while time.monotonic() < end:
        time.sleep(0.02)
        now = [private_dirty(p) for p in pids]
        if now == last:
            break
        last = now
    return last


def breakdown(pid: int) -> dict[str, int]:
    """Private dirty bytes of ``pid`` by kind of mapping (``/proc/PID/smaps``).

    heap: glibc's main arena (``[heap]``: C allocations of the main thread: decode buffers,
    tensors below the mmap threshold, the parent's heap pages written); anonymous: other
    anonymous mappings (Python's object arenas, large mallocs, the parent's anonymous pages
    written); thread arenas: glibc's arenas of other threads (64 MiB-aligned, followed by their
    reserve); thread stacks: a mapping right after a 4 KiB guard page; library data: written
    pages of mapped files (the data and relocations of libpython, torch and the extensions)."""
    maps: list[dict] = []
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(None, 5)
            if head and "-" in head[0] and ":" not in head[0] and len(head) >= 5:
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                path = head[5].strip() if len(head) > 5 else ""
                maps.append({"lo": lo, "hi": hi, "perms": head[1], "path": path, "pd": 0})
            elif line.startswith("Private_Dirty:"):
                maps[-1]["pd"] = int(line.split()[1]) * 1024
    out = dict.fromkeys(
        ["heap", "anonymous", "thread arenas", "thread stacks", "library data", "main stack"], 0
    )
    for i, m in enumerate(maps):
        prev = maps[i - 1] if i else None
        nxt = maps[i + 1] if i + 1 < len(maps) else None
        if m["path"] == "[heap]":
            kind = "heap"
        elif m["path"] == "[stack]":
            kind = "main stack"
        elif m["path"].startswith("/"):
            kind = "library data"
        elif m["path"]:
            kind = "anonymous"  # [vvar] and the like hold nothing private
        elif m["lo"] % (64 * MIB) == 0 and nxt and nxt["lo"] == m["hi"] and nxt["perms"][0] == "-":
            kind = "thread arenas"
        elif (
            prev
            and prev["hi"] == m["lo"]
            and prev["perms"][0] == "-"
            and prev["hi"] - prev["lo"] in (4096, 8192)
        ):
            kind = "thread stacks"
        else:
            kind = "anonymous"
        out[kind] += m["pd"]
    return out


# ------------------------------------------------------------------------------ photos
def _record_start(wid: int) -> None:
    """worker_init_fn: this worker's private dirty at start, and after a full collection."""
    base = Path(os.environ["WM_RECORD"])
    rec = {"start": private_dirty(os.getpid())}
    if int(os.environ.get("WM_MMAP", "0")):
        import ctypes

        ctypes.CDLL(None).mallopt(-3, int(os.environ["WM_MMAP"]))  # M_MMAP_THRESHOLD
    if os.environ.get("WM_GC") == "1":
        t0 = time.perf_counter()
        rec["collected"] = gc.collect()
        rec["gc_s"] = time.perf_counter() - t0
        rec["after_gc"] = private_dirty(os.getpid())
    (base / f"start-{wid}.json").write_text(json.dumps(rec))


def _off(*_: object) -> None:
    """A pool step switched off: it does nothing (and finds no malloc_trim)."""
    return None


def _no_thaw() -> bool:
    return False


def _switch(*, check: bool = True, trim: bool = True, freeze: bool = True) -> None:
    """Switch the worker pool's memory measures off by patching the functions that take them
    (in this benchmark's own process; fork workers inherit the patches)."""
    import gpucache.decode.cpu._procs as wk
    import gpucache.decode.cpu._worker as wm

    if not check:
        wk._check_decoder = _off
    if not trim:
        wm._malloc_trim = _off
    if not freeze:
        wk._freeze = _no_thaw


def _photos_child(config: str, data: str, epochs: int) -> dict:
    import torch

    from gpucache import GpuCachedLoader, JpegCache
    from gpucache import transforms as T

    check, trim, freeze, collect, mmap_threshold = CONFIGS[config]
    _switch(check=check, trim=trim, freeze=freeze)
    record = Path(tempfile.mkdtemp(prefix="wm-"))
    os.environ["WM_RECORD"], os.environ["WM_GC"] = str(record), "1" if collect else "0"
    os.environ["WM_MMAP"] = str(mmap_threshold)
    cache = JpegCache.from_folder(data, progress=False)
    loader = GpuCachedLoader(
        cache,
        batch_size=64,
        shuffle=True,
        seed=0,
        device="cpu",
        backend="cpu",
        num_workers=2,
        multiprocessing_context="fork",
        worker_init_fn=_record_start,
        transform=[T.RandomResizedCrop(224), T.RandomHorizontalFlip()],
    )
    n = len(cache)
    out: dict = {"config": config, "at_rest": {}, "breakdown": {}, "stats": {}}
    busy: list[int] = []
    cost = None
    for epoch in range(1, epochs + 1):
        if epoch == 5:  # the cost, over epochs 5 to the last (nothing read while they run)
            cost = _cost(loader.worker_pids), time.perf_counter()
        labels = []
        for images, y in loader:
            assert images.dtype == torch.uint8 and tuple(images.shape[1:]) == (3, 224, 224)
            assert len(y) == images.shape[0]
            labels += y.tolist()
            if 2 <= epoch <= 4:
                busy += [private_dirty(p) for p in loader.worker_pids]
        assert len(labels) == n, (len(labels), n)
        if epoch in (1, 2, 4, 10):
            pids = loader.worker_pids
            out["at_rest"][epoch] = at_rest(pids)
            stats = getattr(loader.stats, "worker_private", None)
            if stats:
                out["stats"][epoch] = [stats[w] for w in sorted(stats)]
            if epoch in (4, 10):
                out["breakdown"][epoch] = [breakdown(p) for p in pids]
    out["busy_max"] = max(busy) if busy else None
    if cost is not None:
        (cpu, faults), t0 = cost
        cpu1, faults1 = _cost(loader.worker_pids)
        images = n * (epochs - 4)
        out["worker_cpu_ms_per_image"] = (cpu1 - cpu) / images * 1e3
        out["minor_faults_per_image"] = (faults1 - faults) / images
        out["images_per_s"] = images / (time.perf_counter() - t0)
    out["start"] = [json.loads((record / f"start-{w}.json").read_text()) for w in range(2)]
    out["parent_at_rest"] = private_dirty(os.getpid())
    loader.close()
    return out


def _cost(pids: list[int]) -> tuple[float, int]:
    """CPU seconds (user + system) and minor page faults of ``pids``, summed."""
    cpu, faults = 0.0, 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        faults += int(fields[7])  # minflt
        cpu += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    return cpu, faults


def fault_us(mib: int = 256, repeat: int = 5) -> float:
    """CPU microseconds a minor page fault costs here: the median over ``repeat`` fresh anonymous
    mappings of ``mib`` MiB, one write a 4 KiB page (the cost of a page given back and touched
    again)."""
    import mmap

    import numpy as np

    got = []
    for _ in range(repeat):
        m = mmap.mmap(-1, mib * MIB)
        a = np.frombuffer(m, dtype=np.uint8)
        t0 = time.process_time()
        a[::4096] = 1
        got.append((time.process_time() - t0) / (mib * MIB // 4096) * 1e6)
        del a
        m.close()
    return statistics.median(got)


def photos(data: Path, epochs: int) -> list[dict]:
    rows = []
    for config in CONFIGS:
        with tempfile.TemporaryDirectory(prefix="gpucache-wm-") as tmp:
            proc = subprocess.run(
                [sys.executable, __file__, "_photos", config, str(data), str(epochs)],
                env=_env(tmp),
                capture_output=True,
                text=True,
                timeout=1800,
            )
        if proc.returncode:
            sys.exit(f"{config}: rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}")
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(_photo_line(row), flush=True)
    return rows


def _photo_line(row: dict) -> str:
    def mib(xs) -> str:
        return "/".join(f"{x / MIB:.1f}" for x in xs)

    rest = row["at_rest"]
    line = f"{row['config']:30s} start {mib(s['start'] for s in row['start'])}"
    for e in sorted(rest, key=int):
        line += f"  e{e} {mib(rest[e])}"
    line += f"  busy max {row['busy_max'] / MIB:.1f} MiB"
    if "worker_cpu_ms_per_image" in row:
        line += (
            f"  worker CPU {row['worker_cpu_ms_per_image']:.2f} ms/image, "
            f"{row['minor_faults_per_image']:.0f} faults/image"
        )
    if "after_gc" in row["start"][0]:
        took = "/".join(f"{s['gc_s'] * 1e3:.1f}" for s in row["start"])
        after = mib([s["after_gc"] for s in row["start"]])
        line += f"  (gc.collect in worker: {after} MiB after it, {took} ms)"
    return line


# ------------------------------------------------------------------------------ ranks
def _rank(data: str, record: str, freeze: bool, scenario: str, epochs: int) -> None:
    import psutil
    import torch.distributed as dist

    from gpucache import GpuCachedLoader, JpegCache
    from gpucache import transforms as T

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    _switch(freeze=freeze)
    cache = JpegCache.from_folder(data, progress=False)  # built once for the node
    if scenario == "program froze":
        gc.freeze()
    loader = GpuCachedLoader(
        cache,
        batch_size=16,
        shuffle=True,
        seed=0,
        device="cpu",
        backend="cpu",
        num_workers=2,
        multiprocessing_context="fork",
        worker_init_fn=None if scenario == "none" else _collect,
        transform=[T.Resize(64), T.CenterCrop(64)],
    )
    for _ in range(epochs):
        for images, labels in loader:
            assert tuple(images.shape[1:]) == (3, 64, 64) and len(labels) == images.shape[0]
    if scenario in ("workers+parent", "program froze"):
        gc.collect()
    dist.barrier()  # every rank done, workers alive
    if rank == 0:
        from gpucache.testing._memory import pss

        agent = psutil.Process(os.getppid())  # torchrun's agent: every rank and worker below it
        ranks = agent.children()
        workers = [w for r in ranks for w in r.children()]
        rest = dict(zip([p.pid for p in workers], at_rest([p.pid for p in workers])))
        rows = []
        for role, procs in (("rank", ranks), ("worker", workers)):
            for p in procs:
                pd = rest.get(p.pid) or private_dirty(p.pid)
                rows.append({"role": role, "pd": pd, "pss": pss(p.pid, without_libraries=True)})
        Path(record).write_text(json.dumps(rows))
    dist.barrier()
    loader.close()
    dist.destroy_process_group()


def _collect(wid: int) -> None:
    gc.collect()


def ranks(data: Path, runs: int, epochs: int = 2) -> list[dict]:
    out = []
    for scenario in SCENARIOS:
        for freeze in (True,) if scenario == "program froze" else (False, True):
            got = []
            for _ in range(runs):
                with tempfile.TemporaryDirectory(prefix="gpucache-wm-") as tmp:
                    rec = Path(tmp) / "rec.json"
                    cmd = [
                        sys.executable,
                        "-m",
                        "torch.distributed.run",
                        "--standalone",
                        "--nproc_per_node=3",
                        __file__,
                        "_rank",
                        str(data),
                        str(rec),
                        "1" if freeze else "0",
                        scenario,
                        str(epochs),
                    ]
                    env = _env(tmp)
                    proc = subprocess.run(
                        cmd, env=env, capture_output=True, text=True, timeout=1800
                    )
                    if proc.returncode:
                        sys.exit(f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}")
                    got.append(json.loads(rec.read_text()))
            row = {"scenario": scenario, "freeze": freeze, "runs": got}
            for key in ("pd", "pss"):
                row[f"{key}_sum"] = statistics.median(sum(p[key] for p in r) for r in got)
                for role in ("rank", "worker"):
                    row[f"{key}_{role}"] = statistics.median(
                        statistics.median(p[key] for p in r if p["role"] == role) for r in got
                    )
            out.append(row)
            print(_rank_line(row), flush=True)
    return out


_LABELS = {
    "none": "no collection forced",
    "workers": "gc in the workers",
    "workers+parent": "gc in workers, then ranks",
    "program froze": "the same, program froze",
}


def _rank_line(row: dict) -> str:
    return (
        f"{_LABELS[row['scenario']]:26s} pool's freeze {'on ' if row['freeze'] else 'off'}: "
        f"private dirty, 9 processes {row['pd_sum'] / MIB:6.1f} MiB "
        f"(a rank {row['pd_rank'] / MIB:5.1f}, a worker {row['pd_worker'] / MIB:5.1f}); "
        f"PSS {row['pss_sum'] / MIB:6.1f} MiB"
    )


# ------------------------------------------------------------------------------ main
def _env(tmp: str) -> dict:
    env = dict(os.environ, TMPDIR=tmp, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    for var in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX"):
        env.pop(var, None)  # glibc as users run it
    return env


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_photos":
        print(json.dumps(_photos_child(sys.argv[2], sys.argv[3], int(sys.argv[4]))))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "_rank":
        data, rec, freeze, scenario, epochs = sys.argv[2:7]
        _rank(data, rec, freeze == "1", scenario, int(epochs))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["photos", "ranks", "all"])
    p.add_argument("--data", type=Path, default=SHARED)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", type=Path)
    p.add_argument("--out", type=Path, help="all: writes OUT.json and OUT.txt")
    args = p.parse_args()
    run = run_info()
    result: dict = {"data": str(args.data)}
    if args.what in ("photos", "all"):
        result["photos"] = photos(args.data, args.epochs)
        result["fault_us"] = fault_us()
        print(f"a minor page fault: {result['fault_us']:.1f} us of CPU", flush=True)
    if args.what in ("ranks", "all"):
        result["ranks"] = ranks(args.data, args.runs)
    path = args.json or (args.out.with_suffix(".json") if args.out else None)
    if path:
        write_json(path, result, run=run)
    if args.out:
        lines = [
            run["command"],
            f"{run['date']}, commit {run['commit'] or 'unknown'}; {run['machine']}; data: "
            f"{args.data}; load average {os.getloadavg()[0]:.1f} at the end",
            "private dirty memory of each worker (MiB): at start, at rest after epoch N, busy max",
        ]
        lines += [_photo_line(r) for r in result.get("photos", [])]
        if "fault_us" in result:
            lines.append(f"a minor page fault: {result['fault_us']:.1f} us of CPU")
        lines += [_rank_line(r) for r in result.get("ranks", [])]
        args.out.with_suffix(".txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
