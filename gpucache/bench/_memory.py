"""Copies held: each contender over two data sizes, each in a fresh process (``--memory-probe``).

The two sets repeat one sample of the files 1 and k times, so they differ only in data bytes:
(PSS_large - PSS_small) / (bytes_large - bytes_small) cancels every fixed overhead. The small set
runs k epochs so both decode the same images; glibc is told to return freed buffers and every
process runs a full garbage collection and trims its heap before the reading; shared libraries'
PSS is left out (it moves whenever another process on the machine imports torch).
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from .._errors import BenchError
from ._common import Config, Source, progress, say
from ._contenders import CONTENDERS, Runner
from ._timing import Result, epoch

ACK_ENV = "GPUCACHE_PROBE_ACK"  # the folder where probed workers acknowledge SIGUSR1
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}


def probe_main(spec_path: str) -> int:
    """Hidden mode: one contender, one data size, a fresh process; prints a JSON line."""
    from ..testing._memory import tree_pss

    spec = json.loads(Path(spec_path).read_text())
    src = Source(
        spec["root"], [(p, int(y)) for p, y in spec["samples"]], spec["classes"], spec["store"]
    )
    r = Runner(CONTENDERS[spec["contender"]], src, Config(**spec["config"]))
    t0 = time.perf_counter()
    r.setup()
    os.environ[ACK_ENV] = tempfile.mkdtemp(prefix="gpucache-probe-")  # workers inherit it
    r.make_loader(worker_init_fn=_on_signal)
    for _ in range(spec["epochs"]):
        ep = epoch(r)
    children = psutil.Process().children(recursive=True)
    asked = [c.pid for c in children if _catches_sigusr1(c.pid)]  # not the resource tracker
    for pid in asked:  # workers collect and give back free heap
        os.kill(pid, signal.SIGUSR1)
    _collect_and_trim()
    _wait_for_acks(asked, Path(os.environ[ACK_ENV]))
    data = tree_pss(without_libraries=True)
    everything = tree_pss()
    out = {
        "pss": data,
        "pss_libs": everything - data,
        "pss_all": everything,
        "processes": 1 + len(children),
        "data_bytes": r.data_bytes,
        "images": ep["images"],
        "peak_rss": _peak_rss(),
        "seconds": time.perf_counter() - t0,
    }
    r.close()
    shutil.rmtree(os.environ.pop(ACK_ENV), ignore_errors=True)
    print(json.dumps(out))
    return 0


def malloc_trim(*_: object) -> None:
    """Give free heap pages back to the OS (glibc), so freed decode buffers do not count."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _collect_and_trim(*_: object) -> None:
    """A full garbage collection, then malloc_trim: the steady state a long run reaches.

    A forked worker's first full collection writes into the header of every object it inherited,
    which copies those pages from the parent (tens of MB). Whether a worker has done one by the
    reading depends on how many objects it has allocated, so without this one probe could
    carry the copies and the other not: the PIL contender once read -1.16 copies that way."""
    gc.collect()
    malloc_trim()


def _on_signal(worker_id: int) -> None:
    """worker_init_fn of the memory probes: SIGUSR1 makes the worker collect and trim."""
    signal.signal(signal.SIGUSR1, _collect_trim_and_ack)


def _collect_trim_and_ack(*_: object) -> None:
    """In a worker: collect and trim, then say so with a file named by its pid in ``ACK_ENV``."""
    _collect_and_trim()
    Path(os.environ[ACK_ENV], str(os.getpid())).touch()


def _wait_for_acks(pids: list[int], where: Path, deadline_s: float = 120.0) -> None:
    """Until each worker in ``pids`` has acknowledged its collection (or is gone)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if all((where / str(pid)).exists() or not psutil.pid_exists(pid) for pid in pids):
            return
        time.sleep(0.01)  # polling for the acknowledgements, under the deadline
    raise BenchError(f"workers {pids} did not acknowledge their collection within {deadline_s} s")


def _catches_sigusr1(pid: int) -> bool:
    """Whether the process has a SIGUSR1 handler (SIGUSR1 would end any other process)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signal.SIGUSR1 - 1) & 1)
    except OSError:
        pass
    return False


def _peak_rss() -> int:
    """This process's peak RSS (VmHWM: unlike ru_maxrss it does not carry over through exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _probe_sources(
    source: Source, sizes_mb: tuple[float, float], tmp: Path, need_store: bool, unit: int = 1
) -> list[Source]:
    """Two data sets of about sizes_mb: one sample of the files, repeated 1 and k times.

    The sample is a whole number of ``unit`` (batch size x workers) images, so every batch of
    either set is full: a worker holding on to its last batch then holds as much in both."""
    files = source.samples
    sizes = np.array([os.path.getsize(p) for p, _ in files], dtype=np.int64)
    small_target = sizes_mb[0] * 2**20
    stride = max(1, int(sizes.sum() // small_target))  # spread the sample over every class
    order = list(range(0, len(files), stride))
    order += [i for i in range(len(files)) if i % stride]
    picked, total, k = [], 0, 0
    while total < small_target or k % unit:
        i = order[k % len(order)]
        picked.append(files[i])
        total += int(sizes[i])
        k += 1
    repeat = max(2, round(sizes_mb[1] / sizes_mb[0]))
    out = []
    for name, samples in (("small", picked), ("large", picked * repeat)):
        s = Source(source.root, samples, source.classes)
        if need_store:
            from ..node._jpegcache import JpegCache

            cache = JpegCache.from_files(
                [p for p, _ in samples],
                [y for _, y in samples],
                classes=source.classes,
                progress=False,
            )
            s.store = str(cache.save(tmp / f"probe-{name}.gpucache"))
            del cache
        out.append(s)
    return out


def _run_probe(contender: str, src: Source, cfg: Config, tmp: Path, epochs: int) -> dict[str, Any]:
    spec = tmp / f"probe-{contender}-{len(src.samples)}.json"
    spec.write_text(
        json.dumps(
            {
                "contender": contender,
                "root": src.root,
                "samples": src.samples,
                "classes": src.classes,
                "store": src.store,
                "config": asdict(cfg),
                "epochs": epochs,
            }
        )
    )
    env = dict(os.environ, **MALLOC_ENV)
    repo = str(Path(__file__).resolve().parents[2])  # a source checkout works too
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "gpucache.bench", "--memory-probe", str(spec)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp,
        timeout=900,
    )
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise BenchError(f"memory probe of {contender} failed (exit {proc.returncode}): {tail}")
    reading: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return reading


def measure_memory(
    names: list[str],
    source: Source,
    cfg: Config,
    sizes_mb: tuple[float, float],
    tmp: Path,
    results: list[Result],
) -> None:
    """Copies held and peak parent RSS of each contender (two fresh processes each)."""
    if not sys.platform.startswith("linux"):
        say("memory probes skipped: PSS needs Linux (/proc/PID/smaps)")
        return
    need_store = any(CONTENDERS[n].backing in ("file", "rst") for n in names)
    small, large = _probe_sources(
        source, sizes_mb, tmp, need_store, cfg.batch_size * max(1, cfg.workers)
    )
    by_name = {r.name: r for r in results}
    bar = progress(len(names), "memory probes")
    for n in names:
        res = by_name[n]
        if res.error:
            continue
        try:
            # the small set runs as many epochs as the large set is repeats of it: both decode
            # the same images, so what decoding leaves on the heaps cancels too
            a = _run_probe(n, small, cfg, tmp, len(large.samples) // len(small.samples))
            b = _run_probe(n, large, cfg, tmp, 1)
            d_bytes = b["data_bytes"] - a["data_bytes"]
            res.memory = {
                "copies": (b["pss"] - a["pss"]) / d_bytes if d_bytes else None,
                "peak_rss_mb": b["peak_rss"] / 2**20,
                "small": a,
                "large": b,
            }
            msg = f"memory {n}: {res.memory['copies']:.2f} copies held"
        except Exception as err:  # noqa: BLE001
            res.memory = {"error": f"{type(err).__name__}: {err}"[:300]}
            msg = f"memory {n}: {res.memory['error']}"
        if bar is not None:
            bar.update(1)
        else:
            say(msg)
    if bar is not None:
        bar.close()
