"""``gpucache bench``: GpuCachedLoader against the usual ways of feeding JPEGs, side by side.

Contenders (same worker count, batch size and transform; uint8 (B, 3, 224, 224) out):

======================  ===============================================================
``pil``                 torch DataLoader + torchvision ImageFolder + PIL + v2 transforms, files
``bytes-fork``          DataLoader over a list-of-bytes RAM cache + decode_jpeg, fork workers
``bytes-spawn``         the same under spawn (every worker unpickles its own copy)
``cpu-mem-fork``        GpuCachedLoader, cpu backend, store built in memory, fork workers
``cpu-mem-spawn``       the same under spawn (the store is moved to shared memory once)
``cpu-file-fork``       GpuCachedLoader, cpu backend, store opened from a saved file, fork
``cpu-file-spawn``      the same under spawn
``nvjpeg``, ``dali``    GpuCachedLoader GPU backends, store from file (when CUDA is present)
======================  ===============================================================

Every contender's loader is made and run for one warm-up epoch (time to first batch recorded),
then the measured epochs run interleaved -- an epoch of A, of B, ... -- with every loader and its
persistent workers alive, so drift of a noisy machine hits all alike. Each batch is checked
(shape, dtype, labels) and each epoch's label counts must equal the data set's.

Memory is *copies held*: the summed PSS of the parent and its workers after an epoch, in a fresh
process per contender and data size (``--memory-probe``, a hidden mode of this module), with
glibc's malloc told to return freed buffers. Two sizes made by repeating the same files differ only
in data, so (PSS_large - PSS_small) / (bytes_large - bytes_small) cancels every fixed overhead.

Cases (``--case``): ``main`` (the table above), ``batch100`` (the wall time of a batch of 100 from
disk with DataLoader+PIL against the store), ``scaling-workers`` (images/s and copies held against
1, 2, 4, ... workers) and ``scaling-size`` (store build, save and open time against data size).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

CROP = 224
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}
CASES = ("main", "batch100", "scaling-workers", "scaling-size")
GPU_BACKENDS = ("nvjpeg", "dali")
DESCRIPTION = ("Time GpuCachedLoader against torch DataLoader peers (PIL from files, a list-of-bytes "
               "RAM cache) on the same data, workers, batch size and transform: images/s, batch "
               "latency, time to first batch, copies of the data held and peak parent RSS.")


class BenchError(RuntimeError):
    """A benchmark check failed: what was timed is not what it should be."""


# ---------------------------------------------------------------------------------- contenders
@dataclass(frozen=True)
class Contender:
    name: str
    kind: str  # "pil" | "bytes" | "gpucache"
    what: str
    context: str | None = None  # multiprocessing start method; None: the platform's default
    backing: str | None = None  # gpucache: "memory" | "file"
    backend: str | None = None  # gpucache: "cpu" | "nvjpeg" | "dali"


CONTENDERS = {c.name: c for c in (
    Contender("pil", "pil", "DataLoader + ImageFolder + PIL + torchvision v2, from files"),
    Contender("bytes-fork", "bytes", "DataLoader over a list of bytes + decode_jpeg, fork", "fork"),
    Contender("bytes-spawn", "bytes", "DataLoader over a list of bytes + decode_jpeg, spawn",
              "spawn"),
    Contender("cpu-mem-fork", "gpucache", "GpuCachedLoader cpu, in-memory store, fork", "fork",
              "memory", "cpu"),
    Contender("cpu-mem-spawn", "gpucache", "GpuCachedLoader cpu, in-memory store, spawn", "spawn",
              "memory", "cpu"),
    Contender("cpu-file-fork", "gpucache", "GpuCachedLoader cpu, store opened from file, fork",
              "fork", "file", "cpu"),
    Contender("cpu-file-spawn", "gpucache", "GpuCachedLoader cpu, store opened from file, spawn",
              "spawn", "file", "cpu"),
    Contender("nvjpeg", "gpucache", "GpuCachedLoader nvjpeg (GPU), store from file", None, "file",
              "nvjpeg"),
    Contender("dali", "gpucache", "GpuCachedLoader dali (GPU), store from file", None, "file",
              "dali"),
)}


@dataclass
class Source:
    """The images every contender reads: ImageFolder order (path, label) pairs and their store."""

    root: str
    samples: list[tuple[str, int]]
    classes: list[str]
    store: str | None = None  # a saved store of exactly these samples (file-backed contenders)
    info: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(os.path.getsize(p) for p, _ in self.samples)


@dataclass
class Config:
    pipeline: str = "train"
    workers: int = 2
    batch_size: int = 64
    epochs: int = 3
    seed: int = 0


def tv_transform(pipeline: str, *, pil: bool):
    """The torchvision v2 transforms of the DataLoader contenders (uint8 out)."""
    from torchvision.transforms import v2

    if pipeline == "train":
        ops = [v2.RandomResizedCrop(CROP, antialias=True), v2.RandomHorizontalFlip()]
    else:
        ops = [v2.Resize(256, antialias=True), v2.CenterCrop(CROP)]
    return v2.Compose(ops + ([v2.PILToTensor()] if pil else []))


def gc_transform(pipeline: str) -> list:
    """The same pipeline in gpucache's transforms (uint8 out, no Normalize)."""
    from . import transforms as T

    if pipeline == "train":
        return [T.RandomResizedCrop(CROP), T.RandomHorizontalFlip()]
    return [T.Resize(256), T.CenterCrop(CROP)]


try:  # a Dataset subclass, when torch is there (it always is with gpucache)
    from torch.utils.data import Dataset as _Dataset
except ImportError:  # pragma: no cover
    _Dataset = object  # type: ignore[assignment,misc]


class ListOfBytes(_Dataset):
    """The usual home-made RAM cache: a Python list of each file's bytes, decoded on access.

    Decodes with the same libjpeg-turbo call as gpucache's cpu backend (PIL for non-JPEG), so the
    comparison is about how the bytes are held and moved, not about the decoder."""

    def __init__(self, samples: list[tuple[str, int]], transform):
        self.items = [Path(p).read_bytes() for p, _ in samples]
        self.targets = [int(label) for _, label in samples]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        import torch

        from .decode.cpu import decode_jpeg

        data = self.items[i]
        try:
            with warnings.catch_warnings():  # "the given buffer is not writable"
                warnings.simplefilter("ignore")
                img = decode_jpeg(torch.frombuffer(data, dtype=torch.uint8))
        except RuntimeError:  # PNG/GIF/WebP named as an image: what PIL reads
            import io

            from PIL import Image

            with Image.open(io.BytesIO(data)) as im:
                img = torch.from_numpy(np.asarray(im.convert("RGB")).copy()).permute(2, 0, 1)
        return self.transform(img), self.targets[i]


class Runner:
    """One contender's data, loader and measurements."""

    def __init__(self, contender: Contender, source: Source, cfg: Config):
        self.c, self.source, self.cfg = contender, source, cfg
        self.loader = self.data = self.cache = None
        self.expected: np.ndarray | None = None
        self.data_bytes = 0
        self.device = "cpu"
        self._it = None

    # ---------------------------------------------------------------- setting up
    def setup(self) -> float:
        """Make the data set or store (timed); no workers yet."""
        t0 = time.perf_counter()
        c, src, ncls = self.c, self.source, len(self.source.classes)
        if c.kind == "pil":
            from torchvision.datasets import ImageFolder

            ds = ImageFolder(src.root, transform=tv_transform(self.cfg.pipeline, pil=True))
            if [s[0] for s in ds.samples] != [s[0] for s in src.samples]:  # a probe's repeats
                ds.samples = ds.imgs = [(p, int(y)) for p, y in src.samples]
                ds.targets = [int(y) for _, y in src.samples]
            self.data, self.data_bytes = ds, src.nbytes
            self.expected = np.bincount(ds.targets, minlength=ncls)
        elif c.kind == "bytes":
            ds = ListOfBytes(src.samples, tv_transform(self.cfg.pipeline, pil=False))
            self.data, self.data_bytes = ds, sum(len(b) for b in ds.items)
            self.expected = np.bincount(ds.targets, minlength=ncls)
        else:
            from ._store import JpegCache

            if c.backing == "memory":
                self.cache = JpegCache.from_files([p for p, _ in src.samples],
                                                  [y for _, y in src.samples],
                                                  classes=src.classes, progress=False)
            else:
                if src.store is None:
                    raise BenchError("no saved store for a file-backed contender")
                self.cache = JpegCache.open(src.store)
            self.data_bytes = self.cache.nbytes
            self.expected = np.bincount(self.cache.labels, minlength=ncls)
            if c.backend != "cpu":
                self.device = "cuda"
        return time.perf_counter() - t0

    def make_loader(self, *, batch_size: int | None = None, workers: int | None = None,
                    worker_init_fn=None) -> None:
        import torch

        bs = batch_size or self.cfg.batch_size
        w = self.cfg.workers if workers is None else workers
        shuffle = self.cfg.pipeline == "train"
        if self.c.kind in ("pil", "bytes"):
            from torch.utils.data import DataLoader

            self.loader = DataLoader(
                self.data, batch_size=bs, shuffle=shuffle, num_workers=w,
                persistent_workers=w > 0, pin_memory=False,
                multiprocessing_context=self.c.context if w > 0 else None,
                generator=torch.Generator().manual_seed(self.cfg.seed),
                worker_init_fn=worker_init_fn)
        else:
            from ._loader import GpuCachedLoader

            self.loader = GpuCachedLoader(
                self.cache, batch_size=bs, shuffle=shuffle, seed=self.cfg.seed,
                transform=gc_transform(self.cfg.pipeline), device=self.device,
                backend=self.c.backend, num_workers=w, multiprocessing_context=self.c.context,
                worker_init_fn=worker_init_fn)
        self._bs = bs

    # ---------------------------------------------------------------- running
    def _check(self, images, labels) -> int:
        import torch

        n = len(labels)
        if not isinstance(images, torch.Tensor) or images.dtype != torch.uint8 \
                or tuple(images.shape) != (n, 3, CROP, CROP) or not 0 < n <= self._bs \
                or images.device.type != self.device:
            got = (f"{type(images).__name__} {getattr(images, 'dtype', '')} "
                   f"{tuple(getattr(images, 'shape', ()))} on {getattr(images, 'device', '?')}")
            raise BenchError(f"{self.c.name}: a batch of {n} labels came with images {got}; "
                             f"expected uint8 ({n}, 3, {CROP}, {CROP}) on {self.device}")
        return n

    def epoch(self) -> dict:
        """One full pass; every batch checked, label counts compared with the data set's."""
        import torch

        sync = self.device == "cuda"
        skipped0 = len(self.loader.stats.skipped_samples) if self.cache is not None else 0
        counts = np.zeros(len(self.expected), dtype=np.int64)
        lat, small = [], 0
        t0 = last = time.perf_counter()
        for images, labels in self.loader:
            if sync:
                torch.cuda.synchronize()
            now = time.perf_counter()
            lat.append(now - last)
            n = self._check(images, labels)
            small += n < self._bs
            counts += np.bincount(labels.cpu().numpy(), minlength=len(counts))
            last = time.perf_counter()  # the checks are not the loader's time
            t0 += last - now
        seconds = last - t0
        expected = self.expected.copy()
        if self.cache is not None:  # samples that failed to decode were reported, not lost
            for index, _ in self.loader.stats.skipped_samples[skipped0:]:
                expected[self.cache.labels[index]] -= 1
        if not np.array_equal(counts, expected) or (small > 1 and self.cache is None):
            raise BenchError(f"{self.c.name}: an epoch gave label counts {counts.tolist()}, the "
                             f"data set has {expected.tolist()} ({small} short batches)")
        n = int(counts.sum())
        return {"seconds": seconds, "images": n, "img_s": n / seconds,
                "batch_ms": [round(x * 1e3, 3) for x in lat]}

    def step(self) -> tuple[float, int]:
        """One batch (a new epoch when one ends): its wall time and size, checked."""
        import torch

        t0 = time.perf_counter()
        if self._it is None:
            self._it = iter(self.loader)
        try:
            images, labels = next(self._it)
        except StopIteration:
            self._it = iter(self.loader)
            images, labels = next(self._it)
        if self.device == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        return dt, self._check(images, labels)

    def close(self) -> None:
        self._it = None
        loader, self.loader = self.loader, None
        if loader is not None and hasattr(loader, "close"):
            loader.close()
        elif loader is not None and getattr(loader, "_iterator", None) is not None:
            loader._iterator._shutdown_workers()  # DataLoader's persistent workers
        if self.cache is not None:
            self.cache.close()
        self.cache = self.data = None
        gc.collect()


# ---------------------------------------------------------------------------------- results
@dataclass
class Result:
    name: str
    what: str
    setup_s: float | None = None
    first_batch_s: float | None = None
    warmup_s: float | None = None
    epochs: list[dict] = field(default_factory=list)
    memory: dict | None = None
    error: str | None = None

    def summary(self) -> dict:
        out: dict = {}
        if self.epochs:
            rates = [e["img_s"] for e in self.epochs]
            lat = np.concatenate([e["batch_ms"] for e in self.epochs])
            out.update(img_s=float(np.median(rates)), img_s_min=min(rates), img_s_max=max(rates),
                       p50_ms=float(np.percentile(lat, 50)), p99_ms=float(np.percentile(lat, 99)))
        if self.memory:
            out.update(copies=self.memory.get("copies"),
                       peak_rss_mb=self.memory.get("peak_rss_mb"))
        return out


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _progress(total: int, desc: str):
    """A tqdm bar on a terminal; None (plain status lines instead) otherwise."""
    if not sys.stderr.isatty():
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="epoch", leave=False, file=sys.stderr)


def run_interleaved(names: list[str], source: Source, cfg: Config) -> list[Result]:
    """Warm each contender up (first batch timed), then interleave its measured epochs."""
    results = {n: Result(n, CONTENDERS[n].what) for n in names}
    runners: dict[str, Runner] = {}
    bar = _progress(len(names) * (cfg.epochs + 1), f"bench ({cfg.workers} workers)")
    try:
        for n in names:
            r, res = Runner(CONTENDERS[n], source, cfg), results[n]
            try:
                res.setup_s = r.setup()
                t0 = time.perf_counter()
                r.make_loader()
                it = iter(r.loader)
                first = next(it)
                res.first_batch_s = time.perf_counter() - t0
                r._check(*first)
                del first
                for _ in it:
                    pass
                res.warmup_s = time.perf_counter() - t0
                runners[n] = r
                msg = (f"warm-up {n}: {res.warmup_s:.1f} s, first batch {res.first_batch_s:.2f} s"
                       f" (setup {res.setup_s:.1f} s)")
            except Exception as err:  # noqa: BLE001 - one contender failing leaves the others
                res.error = f"{type(err).__name__}: {err}".splitlines()[0][:200]
                r.close()
                msg = f"{n}: failed: {res.error}"
            if bar is not None:
                bar.set_postfix_str(n)
                bar.update(1)
            else:
                _say(msg)
        for e in range(cfg.epochs):
            order = list(runners)
            order = order[e % len(order):] + order[:e % len(order)] if order else order
            line = []
            for n in order:
                try:
                    ep = runners[n].epoch()
                    results[n].epochs.append(ep)
                    line.append(f"{n} {ep['img_s']:.0f}")
                except Exception as err:  # noqa: BLE001
                    results[n].error = f"{type(err).__name__}: {err}".splitlines()[0][:200]
                    runners.pop(n).close()
                    line.append(f"{n} failed")
                if bar is not None:
                    bar.update(1)
            if bar is None:
                _say(f"epoch {e + 1}/{cfg.epochs} img/s: " + ", ".join(line))
    finally:
        for r in runners.values():
            r.close()
        if bar is not None:
            bar.close()
    return [results[n] for n in names]


# ---------------------------------------------------------------------------------- memory
def _probe_main(spec_path: str) -> int:
    """Hidden mode: one contender, one data size, a fresh process; prints a JSON line."""
    import psutil

    from ._memory import tree_pss

    spec = json.loads(Path(spec_path).read_text())
    src = Source(spec["root"], [(p, int(y)) for p, y in spec["samples"]], spec["classes"],
                 spec["store"])
    cfg = Config(**spec["config"])
    r = Runner(CONTENDERS[spec["contender"]], src, cfg)
    t0 = time.perf_counter()
    r.setup()
    r.make_loader(worker_init_fn=_trim_on_signal)
    for _ in range(spec["epochs"]):
        ep = r.epoch()
    gc.collect()
    for child in psutil.Process().children(recursive=True):  # workers give back free heap
        os.kill(child.pid, signal.SIGUSR1)
    _malloc_trim()
    time.sleep(0.5)
    split = data_pss()
    out = {"pss": split["data"], "pss_libs": split["libs"], "pss_all": tree_pss(),
           "processes": split["processes"], "data_bytes": r.data_bytes, "images": ep["images"],
           "peak_rss": _peak_rss(), "seconds": time.perf_counter() - t0}
    r.close()
    print(json.dumps(out))
    return 0


def data_pss(pid: int | None = None) -> dict:
    """PSS of a process tree, split into shared libraries and everything else (bytes).

    PSS divides a page among *every* process on the machine that maps it, so the PSS of
    libtorch's pages moves whenever some unrelated process imports torch or exits. A file mapped
    executable anywhere in a process (a library, the interpreter) is counted apart as "libs";
    "data" is the rest: anonymous memory, shared memory and mapped data files such as a store.
    """
    import psutil

    root = psutil.Process(pid or os.getpid())
    total = {"data": 0, "libs": 0, "processes": 0}
    for proc in [root, *root.children(recursive=True)]:
        try:
            text = Path(f"/proc/{proc.pid}/smaps").read_text()
        except (OSError, ValueError):
            continue
        maps, cur = [], None
        for line in text.splitlines():
            head = line.split(None, 5)
            if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                cur = [head[5] if len(head) > 5 else "", head[1], 0]
                maps.append(cur)
            elif line.startswith("Pss:") and cur is not None:
                cur[2] = int(line.split()[1]) * 1024
        code = {path for path, perms, _ in maps if "x" in perms and path.startswith("/")}
        for path, _, pss in maps:
            total["libs" if path in code else "data"] += pss
        total["processes"] += 1
    return total


def _malloc_trim(*_) -> None:
    """Give free heap pages back to the OS (glibc), so freed decode buffers do not count."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _trim_on_signal(worker_id: int) -> None:
    """worker_init_fn of the memory probes: SIGUSR1 makes the worker trim its heap."""
    signal.signal(signal.SIGUSR1, _malloc_trim)


def _peak_rss() -> int:
    """This process's peak RSS (VmHWM: unlike ru_maxrss it does not carry over through exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _probe_sources(source: Source, sizes_mb: tuple[float, float], tmp: Path,
                   need_store: bool, unit: int = 1) -> list[Source]:
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
            from ._store import JpegCache

            cache = JpegCache.from_files([p for p, _ in samples], [y for _, y in samples],
                                         classes=source.classes, progress=False)
            s.store = str(cache.save(tmp / f"probe-{name}.gpucache"))
            del cache
        out.append(s)
    return out


def _run_probe(contender: str, src: Source, cfg: Config, tmp: Path, epochs: int) -> dict:
    spec = tmp / f"probe-{contender}-{len(src.samples)}.json"
    spec.write_text(json.dumps({"contender": contender, "root": src.root,
                                "samples": src.samples, "classes": src.classes,
                                "store": src.store, "config": asdict(cfg), "epochs": epochs}))
    env = dict(os.environ, **MALLOC_ENV)
    pkg_parent = str(Path(__file__).resolve().parent.parent)  # a source checkout works too
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [pkg_parent, env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "gpucache.bench", "--memory-probe", str(spec)],
                          capture_output=True, text=True, env=env, cwd=tmp, timeout=900)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise BenchError(f"memory probe of {contender} failed (exit {proc.returncode}): {tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure_memory(names: list[str], source: Source, cfg: Config, sizes_mb: tuple[float, float],
                   tmp: Path, results: list[Result]) -> None:
    """Copies held and peak parent RSS of each contender (two fresh processes each)."""
    if not sys.platform.startswith("linux"):
        _say("memory probes skipped: PSS needs Linux (/proc/PID/smaps_rollup)")
        return
    need_store = any(CONTENDERS[n].backing == "file" for n in names)
    small, large = _probe_sources(source, sizes_mb, tmp, need_store,
                                  cfg.batch_size * max(1, cfg.workers))
    by_name = {r.name: r for r in results}
    bar = _progress(len(names), "memory probes")
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
            res.memory = {"copies": (b["pss"] - a["pss"]) / d_bytes if d_bytes else None,
                          "peak_rss_mb": b["peak_rss"] / 2**20, "small": a, "large": b}
            msg = f"memory {n}: {res.memory['copies']:.2f} copies held"
        except Exception as err:  # noqa: BLE001
            res.memory = {"error": f"{type(err).__name__}: {err}"[:300]}
            msg = f"memory {n}: {res.memory['error']}"
        if bar is not None:
            bar.update(1)
        else:
            _say(msg)
    if bar is not None:
        bar.close()


# ---------------------------------------------------------------------------------- data
def synthetic_folder(n: int, seed: int) -> Path:
    """``make_jpeg_folder(n, seed)``, generated once and kept in the temp dir for later runs."""
    from .testing import make_jpeg_folder

    root = Path(tempfile.gettempdir()) / f"gpucache-bench-synthetic-{n}-seed{seed}"
    if (root / ".complete").exists():
        return root
    _say(f"generating {n} synthetic JPEGs into {root} (once; about {n * 0.015:.0f} s)")
    part = root.with_name(f"{root.name}.part-{os.getpid()}")
    shutil.rmtree(part, ignore_errors=True)
    make_jpeg_folder(part, n, seed=seed)
    (part / ".complete").write_text("")
    try:
        os.rename(part, root)
    except OSError:  # another run finished first, or a stale incomplete copy is there
        if not (root / ".complete").exists():
            shutil.rmtree(root, ignore_errors=True)
            os.rename(part, root)
        else:
            shutil.rmtree(part, ignore_errors=True)
    return root


def _export_store(store: Path, tmp: Path) -> Path:
    """Write a saved store's images back out as an ImageFolder (for the file-reading peers)."""
    from ._store import JpegCache

    cache = JpegCache.open(store)
    root = tmp / "exported"
    names = cache.classes or ["unlabeled"]
    for i in range(len(cache)):
        label = int(cache.labels[i])
        folder = root / (names[label] if label >= 0 else "unlabeled")
        folder.mkdir(parents=True, exist_ok=True)
        ext = Path(cache.paths[i]).suffix.lower() or ".jpg"
        (folder / f"{i:07d}{ext}").write_bytes(cache[i].tobytes())
    return root


def prepare_source(args, tmp: Path, need_store: bool) -> Source:
    from ._build import scan_folder

    t0 = time.perf_counter()
    info: dict = {}
    store = None
    if args.synthetic:
        root = synthetic_folder(args.synthetic, args.seed)
        info["src"] = f"synthetic {args.synthetic} (seed {args.seed}): {root}"
    elif Path(args.src).is_file():
        store = Path(args.src)
        root = _export_store(store, tmp)
        info["src"] = f"store {store} (images exported to {root} for the file readers)"
    elif Path(args.src).is_dir():
        root = Path(args.src)
        info["src"] = str(root)
    else:
        raise FileNotFoundError(f"{args.src} is neither an ImageFolder tree nor a store file")
    info["prepare_s"] = time.perf_counter() - t0
    paths, labels, classes = scan_folder(root)
    samples = [(p, int(y)) for p, y in zip(paths, labels.tolist())]
    src = Source(str(root), samples, classes, info=info)
    info.update(images=len(samples), classes=len(classes), bytes=src.nbytes)
    if need_store and store is None:
        from ._store import JpegCache

        t0 = time.perf_counter()
        cache = JpegCache.from_files(paths, labels, classes=classes, progress=False)
        info["build_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        store = cache.save(tmp / "bench.gpucache")
        info["save_s"] = time.perf_counter() - t0
        info["store_kept"] = len(cache)
        del cache
    src.store = None if store is None else str(store)
    return src


def machine_info() -> dict:
    import psutil
    import torch

    from ._workers import usable_cores
    from .decode.cpu import jpeg_decoder_name

    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = {}
    for mod in ("torch", "torchvision", "torchcodec", "numpy", "PIL"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            versions[mod] = None
    from . import __version__

    import multiprocessing as mp

    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpu": model, "cores": os.cpu_count(), "usable_cores": usable_cores(),
            "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
            "python": platform.python_version(), "platform": platform.platform(),
            "gpucache": __version__, "versions": versions, "jpeg_decoder": jpeg_decoder_name(),
            "default_start_method": mp.get_start_method(allow_none=True) or "default",
            "cuda": torch.cuda.is_available()}
    if info["cuda"]:
        info["gpu"] = torch.cuda.get_device_name(0)
    if os.path.isdir("/dev/shm"):
        st = os.statvfs("/dev/shm")
        info["shm_free_mb"] = round(st.f_bavail * st.f_frsize / 2**20)
    return info


# ---------------------------------------------------------------------------------- printing
def _fmt(x, spec: str, dash: str = "-") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return dash
    return format(x, spec).replace("-0.00", "0.00")  # no "negative zero" copies


def format_table(results: list[Result]) -> str:
    base = next((r.summary().get("img_s") for r in results), None)
    head = (f"{'contender':<15} {'img/s (min-max)':>17} {'ratio':>6} {'p50 ms':>7} {'p99 ms':>7} "
            f"{'1st batch s':>11} {'copies':>6} {'peak RSS MB':>11}")
    lines = [head, "-" * len(head)]
    for r in results:
        s = r.summary()
        if "img_s" in s:
            rate = f"{s['img_s']:.0f} ({s['img_s_min']:.0f}-{s['img_s_max']:.0f})"
            ratio = f"{s['img_s'] / base:.2f}" if base else "-"
        else:
            rate, ratio = "-", "-"
        copies = _fmt(s.get("copies"), ".2f")
        if s.get("copies") is not None and s["copies"] < -0.05:
            copies += "?"
        lines.append(f"{r.name:<15} {rate:>17} {ratio:>6} {_fmt(s.get('p50_ms'), '.0f'):>7} "
                     f"{_fmt(s.get('p99_ms'), '.0f'):>7} {_fmt(r.first_batch_s, '.2f'):>11} "
                     f"{copies:>6} {_fmt(s.get('peak_rss_mb'), '.0f'):>11}")
        if s.get("copies") is not None and s["copies"] < -0.05:
            lines.append(f"  {r.name}: negative copies held: the two probes' worker heaps differed "
                         "by more than the data; try other --probe-mb sizes")
        if r.error:
            lines.append(f"  {r.name} failed: {r.error}")
        elif r.memory and "error" in r.memory:
            lines.append(f"  {r.name} memory probe failed: {r.memory['error']}")
    return "\n".join(lines)


def _header(source: Source, cfg: Config, machine: dict) -> str:
    i = source.info
    return (f"{i['images']} images ({i['bytes'] / 2**20:,.1f} MiB, {i['classes']} classes) from "
            f"{i['src']}\npipeline {cfg.pipeline}, batch {cfg.batch_size}, {cfg.workers} workers, "
            f"{cfg.epochs} epochs after a warm-up; {machine['cpu']}, {machine['usable_cores']} "
            f"cores, torch {machine['versions']['torch']}, decoder {machine['jpeg_decoder']}")


def plot_main(results: list[Result], path: Path, title: str) -> None:
    plt = _pyplot()
    rows = [r for r in results if r.epochs]
    names = [r.name for r in rows][::-1]
    s = [r.summary() for r in rows][::-1]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 0.45 * len(rows) + 1.8), sharey=True)
    rate = [x["img_s"] for x in s]
    err = [[x["img_s"] - x["img_s_min"] for x in s], [x["img_s_max"] - x["img_s"] for x in s]]
    colors = ["#999999" if CONTENDERS[n].kind != "gpucache" else "#2a7ab0" for n in names]
    a1.barh(names, rate, xerr=err, color=colors, capsize=3, ecolor="#444444")
    top = max(x["img_s_max"] for x in s)
    for y, x in enumerate(s):
        a1.text(x["img_s_max"] + top * 0.01, y, f"{x['img_s']:.0f}", va="center", ha="left",
                fontsize=8)
    a1.set_xlabel("images/s (median over epochs; whiskers min-max)")
    a1.set_xlim(0, top * 1.15)
    copies = [max(0.0, x.get("copies") or 0.0) for x in s]
    a2.barh(names, copies, color=colors)
    for y, (v, x) in enumerate(zip(copies, s)):
        a2.text(v, y, f" {v:.2f}" if x.get("copies") is not None else " n/a", va="center",
                ha="left", fontsize=8)
    from matplotlib.patches import Patch

    a2.legend(handles=[Patch(color="#2a7ab0", label="gpucache"),
                       Patch(color="#999999", label="DataLoader peers")],
              fontsize=8, loc="lower right")
    a2.axvline(1.0, color="k", lw=0.8, ls="--")
    a2.set_xlabel("copies of the data held (parent + workers, PSS)")
    a2.set_xlim(0, max(max(copies), 1.0) * 1.25)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_scaling(table: dict, path: Path, title: str) -> None:
    plt = _pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in table.items():
        ws = [r["workers"] for r in rows]
        style = "-o" if CONTENDERS[name].kind == "gpucache" else "--s"
        a1.plot(ws, [r.get("img_s") or np.nan for r in rows], style, label=name)
        a2.plot(ws, [r.get("copies") if r.get("copies") is not None else np.nan for r in rows],
                style, label=name)
    a1.set_xlabel("workers")
    a1.set_ylabel("images/s (median)")
    a1.set_ylim(bottom=0)
    a2.set_xlabel("workers")
    a2.set_ylabel("copies held")
    a2.axhline(1.0, color="k", lw=0.8, ls=":")
    for a in (a1, a2):
        a.set_xticks(sorted({r["workers"] for rows in table.values() for r in rows}))
        a.grid(alpha=0.3)
    a1.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _pyplot():
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError("--plot needs matplotlib: pip install 'gpucache[bench]'") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ---------------------------------------------------------------------------------- cases
def case_main(names, source, cfg, args, tmp) -> tuple[dict, list[Result]]:
    results = run_interleaved(names, source, cfg)
    if not args.no_memory:
        measure_memory(names, source, cfg, args.probe_mb, tmp, results)
    return {"config": asdict(cfg), "contenders": [
        {**asdict(r), "summary": r.summary(), **asdict(CONTENDERS[r.name])} for r in results]}, \
        results


def case_batch100(names, source, cfg, args, tmp) -> dict:
    """A batch of 100: steady stream with workers, and in-process (no workers) latency."""
    cfg100 = Config(**{**asdict(cfg), "batch_size": 100})
    streamed = run_interleaved(names, source, cfg100)
    out = {"streamed": {}, "in_process": {}}
    print(f"\nbatch of 100, {cfg.workers} workers (interval between batches, full batches only):")
    base = None
    for r in streamed:
        full = [ms for e in r.epochs for ms, k in zip(e["batch_ms"], _sizes(e, 100)) if k == 100]
        if not full:
            print(f"  {r.name:<15} failed: {r.error}")
            continue
        med, p99 = float(np.median(full)), float(np.percentile(full, 99))
        base = base or med
        out["streamed"][r.name] = {"median_ms": med, "p99_ms": p99, "batches": len(full),
                                   "first_batch_s": r.first_batch_s, "raw_ms": full}
        print(f"  {r.name:<15} median {med:7.0f} ms  p99 {p99:7.0f} ms  ({base / med:.2f}x as "
              f"fast as {streamed[0].name})")
    runners = {}
    times: dict[str, list[float]] = {}
    try:
        for n in names:
            r = Runner(CONTENDERS[n], source, cfg100)
            try:
                r.setup()
                r.make_loader(workers=0)
                r.step()  # warm-up
                runners[n], times[n] = r, []
            except Exception as err:  # noqa: BLE001
                r.close()
                out["in_process"][n] = {"error": f"{type(err).__name__}: {err}"[:300]}
        for _ in range(args.batches):  # one batch of each in turn: nothing runs in background
            for n, r in runners.items():
                dt, k = r.step()
                if k == 100:
                    times[n].append(dt * 1e3)
    finally:
        for r in runners.values():
            r.close()
    print("batch of 100 in the calling process (num_workers=0), wall time per batch:")
    base = None
    for n, t in times.items():
        med, p99 = float(np.median(t)), float(np.percentile(t, 99))
        base = base or med
        out["in_process"][n] = {"median_ms": med, "p99_ms": p99, "batches": len(t), "raw_ms": t}
        print(f"  {n:<15} median {med:7.0f} ms  p99 {p99:7.0f} ms  ({base / med:.2f}x as "
              f"fast as {names[0]})")
    return out


def _sizes(epoch: dict, bs: int) -> list[int]:
    n, k = epoch["images"], len(epoch["batch_ms"])
    return [bs] * (k - 1) + [n - bs * (k - 1)]


def worker_counts(cores: int) -> list[int]:
    counts, w = [], 1
    while w < cores:
        counts.append(w)
        w *= 2
    return counts + [cores]


def case_scaling_workers(names, source, cfg, args, tmp) -> dict:
    table: dict[str, list[dict]] = {n: [] for n in names}
    for w in worker_counts(cfg.workers):
        cw = Config(**{**asdict(cfg), "workers": w})
        _say(f"scaling: {w} workers")
        results = run_interleaved(names, source, cw)
        if not args.no_memory:
            measure_memory(names, source, cw, args.probe_mb, tmp, results)
        for r in results:
            table[r.name].append({"workers": w, **r.summary(), "error": r.error,
                                  "first_batch_s": r.first_batch_s})
    ws = worker_counts(cfg.workers)
    print("\nimages/s (copies held) against workers:")
    print(f"{'contender':<15}" + "".join(f"{f'{w} workers':>18}" for w in ws))
    for n, rows in table.items():
        cells = [f"{_fmt(r.get('img_s'), '.0f')} ({_fmt(r.get('copies'), '.2f')})" for r in rows]
        print(f"{n:<15}" + "".join(f"{c:>18}" for c in cells))
    return {"table": table}


def case_scaling_size(source, cfg, args, tmp) -> dict:
    """Store build, save and open time for data sets of about each size, on disk."""
    from ._store import JpegCache

    rows = []
    files = source.samples
    for mb in args.sizes_mb:
        target = int(mb * 2**20)
        room = shutil.disk_usage(tmp).free
        if room < 2.2 * target:
            raise BenchError(f"scaling-size needs about {2.2 * target / 2**30:.1f} GiB free in "
                             f"{tmp} for {mb:g} MB of images plus the store; it has "
                             f"{room / 2**30:.1f} GiB. Use smaller --sizes-mb or set TMPDIR.")
        folder = tmp / f"size-{mb:g}"
        total, k = 0, 0
        written = []
        while total < target:  # repeat the source files under new names, class kept
            p, y = files[k % len(files)]
            dst = folder / source.classes[y] / f"{k:07d}{Path(p).suffix.lower()}"
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(p, dst)
            total += dst.stat().st_size
            written.append(dst)
            k += 1
        os.sync()
        evicted = hasattr(os, "posix_fadvise")
        for f in written if evicted else ():  # read from disk, not from the page cache
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        t0 = time.perf_counter()
        cache = JpegCache.from_folder(folder, progress=False)
        build = time.perf_counter() - t0
        t0 = time.perf_counter()
        path = cache.save(tmp / f"size-{mb:g}.gpucache")
        save = time.perf_counter() - t0
        nbytes, n = cache.nbytes, len(cache)
        del cache
        gc.collect()
        t0 = time.perf_counter()
        cache = JpegCache.open(path)
        opened = time.perf_counter() - t0
        if len(cache) != n or cache.nbytes != nbytes:
            raise BenchError(f"reopened store differs: {len(cache)} vs {n} samples")
        row = {"target_mb": mb, "images": n, "bytes": nbytes, "file_bytes": path.stat().st_size,
               "build_s": build, "save_s": save, "open_s": opened,
               "build_mb_s": nbytes / 2**20 / build, "page_cache_evicted": evicted}
        rows.append(row)
        del cache
        shutil.rmtree(folder)
        path.unlink()
        _say(f"size {mb:g} MB: {n} images, build {build:.2f} s, save {save:.2f} s, "
             f"open {opened * 1e3:.1f} ms")
    print("\nstore build / save / open against data size (files written to disk, page cache "
          "evicted before the build):")
    print(f"{'size MB':>8} {'images':>7} {'build s':>8} {'MB/s':>7} {'save s':>7} {'open ms':>8}")
    for r in rows:
        print(f"{r['bytes'] / 2**20:>8.0f} {r['images']:>7} {r['build_s']:>8.2f} "
              f"{r['build_mb_s']:>7.0f} {r['save_s']:>7.2f} {r['open_s'] * 1e3:>8.1f}")
    return {"rows": rows}


# ---------------------------------------------------------------------------------- CLI
def _csv(kind):
    def parse(text: str):
        return [kind(x) for x in text.split(",") if x.strip()]
    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", nargs="?", help="ImageFolder root or a saved store file")
    p.add_argument("--synthetic", type=int, metavar="N",
                   help="use N generated JPEGs instead of SRC (made once, kept in the temp dir)")
    p.add_argument("--pipeline", choices=("train", "val"), default="train",
                   help="train: random-resized-crop 224 + flip; val: resize 256 + center crop 224")
    p.add_argument("--backend", action="append", type=_csv(str), default=[],
                   help="gpucache backends to run (repeatable or comma list: cpu,nvjpeg,dali); "
                        "default cpu, plus nvjpeg and dali when CUDA is present")
    p.add_argument("--contenders", type=_csv(str), default=None,
                   help=f"comma list of contenders to run: {', '.join(CONTENDERS)}")
    p.add_argument("--workers", type=int, default=None, help="workers (default: usable cores)")
    p.add_argument("--batch-size", type=int, default=64, help="default 64")
    p.add_argument("--epochs", type=int, default=3, help="measured epochs after the warm-up (default 3)")
    p.add_argument("--seed", type=int, default=0, help="loader and synthetic-data seed")
    p.add_argument("--case", action="append", choices=CASES, default=[],
                   help="what to run (repeatable; default main)")
    p.add_argument("--no-memory", action="store_true", help="skip the copies-held probes")
    p.add_argument("--probe-mb", type=_csv(float), default=(30.0, 90.0),
                   help="the two data sizes of the copies-held probes, MB (default 30,90)")
    p.add_argument("--sizes-mb", type=_csv(float), default=[100.0, 1000.0],
                   help="scaling-size: data sizes in MB (default 100,1000)")
    p.add_argument("--batches", type=int, default=10,
                   help="batch100: batches timed per contender in the calling process")
    p.add_argument("--json", type=Path, help="write every raw number here")
    p.add_argument("--plot", type=Path, help="draw images/s and copies held to this PNG")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``gpucache bench`` on the ``gpucache`` command's subparsers."""
    p = subparsers.add_parser("bench", help="compare GpuCachedLoader with DataLoader peers",
                              description=DESCRIPTION)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def select(args, cuda: bool) -> list[str]:
    backends = {b for group in args.backend for b in group} or \
        ({"cpu", *GPU_BACKENDS} if cuda else {"cpu"})
    bad = backends - {"cpu", *GPU_BACKENDS}
    if bad:
        raise ValueError(f"unknown backend {sorted(bad)}; choose from cpu, nvjpeg, dali")
    names = args.contenders or list(CONTENDERS)
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown:
        raise ValueError(f"unknown contenders {unknown}; choose from {', '.join(CONTENDERS)}")
    keep = []
    for n in names:
        c = CONTENDERS[n]
        if c.backend is not None and c.backend not in backends:
            continue
        if c.backend in GPU_BACKENDS and not cuda:
            if args.contenders or args.backend:
                _say(f"{n}: skipped, CUDA is not available here")
            continue
        if c.backend == "dali":
            from .decode import dali_available

            if not dali_available():
                _say("dali: skipped, nvidia-dali is not installed (pip install 'gpucache[dali]')")
                continue
        keep.append(n)
    return keep


def run(args) -> int:
    """Entry point of ``gpucache bench`` (after argument parsing); returns the exit status."""
    try:
        return _run(args)
    except BenchError as err:
        print(f"gpucache bench: {err}", file=sys.stderr)
        return 1


def _run(args) -> int:
    import torch

    from ._workers import usable_cores

    if bool(args.src) == bool(args.synthetic):
        _say("gpucache bench: give SRC (an ImageFolder or a store file) or --synthetic N")
        return 2
    for name, v, low in (("--workers", args.workers, 0), ("--batch-size", args.batch_size, 1),
                         ("--epochs", args.epochs, 1), ("--synthetic", args.synthetic, 1),
                         ("--batches", args.batches, 1)):
        if v is not None and v < low:
            _say(f"gpucache bench: {name} should be >= {low}, got {v}")
            return 2
    if len(args.probe_mb) != 2 or not 0 < args.probe_mb[0] < args.probe_mb[1]:
        _say("gpucache bench: --probe-mb takes two sizes, small then large (e.g. 30,90)")
        return 2
    args.probe_mb = tuple(args.probe_mb)
    cases = args.case or ["main"]
    try:
        names = select(args, torch.cuda.is_available())
    except ValueError as err:
        _say(f"gpucache bench: {err}")
        return 2
    if args.case and "batch100" in cases and not args.contenders:
        names100 = [n for n in ("pil", "cpu-file-fork", *GPU_BACKENDS) if n in names]
    else:
        names100 = names
    cfg = Config(pipeline=args.pipeline, batch_size=args.batch_size, epochs=args.epochs,
                 workers=usable_cores() if args.workers is None else args.workers, seed=args.seed)
    t_start = time.perf_counter()
    machine = machine_info()
    report: dict = {"machine": machine, "args": {k: (str(v) if isinstance(v, Path) else v)
                                                 for k, v in vars(args).items() if k != "func"}}
    plots = []
    with tempfile.TemporaryDirectory(prefix="gpucache-bench-") as tmp_name:
        tmp = Path(tmp_name)
        need_store = any(CONTENDERS[n].backing == "file"
                         for n in (names if set(cases) & {"main", "scaling-workers"} else [])
                         + (names100 if "batch100" in cases else []))
        source = prepare_source(args, tmp, need_store)
        report["data"] = source.info
        print(f"gpucache bench: {_header(source, cfg, machine)}")
        for case in cases:
            if case == "main":
                report["main"], results = case_main(names, source, cfg, args, tmp)
                print()
                print(format_table(results))
                width = max(len(n) for n in names)
                print("\n".join(f"  {n:<{width}}  {CONTENDERS[n].what}" for n in names))
                print("ratio: images/s over the first row's; copies: extra PSS per data byte "
                      f"(probes of {args.probe_mb[0]:g} and {args.probe_mb[1]:g} MB)")
                plots.append(("main", lambda p, r=results: plot_main(
                    r, p, "gpucache bench: " + _header(source, cfg, machine))))
            elif case == "batch100":
                report["batch100"] = case_batch100(names100, source, cfg, args, tmp)
            elif case == "scaling-workers":
                report["scaling_workers"] = rep = case_scaling_workers(names, source, cfg, args,
                                                                       tmp)
                plots.append(("scaling-workers", lambda p, t=rep["table"]: plot_scaling(
                    t, p, "scaling with workers: " + _header(source, cfg, machine).replace(
                        f", {cfg.workers} workers", ""))))
            elif case == "scaling-size":
                report["scaling_size"] = case_scaling_size(source, cfg, args, tmp)
    report["wall_s"] = time.perf_counter() - t_start
    print(f"\ntotal wall time {report['wall_s']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))
        print(f"wrote {args.json}")
    if args.plot:
        for k, (case, draw) in enumerate(plots):
            path = args.plot if k == 0 else args.plot.with_name(
                f"{args.plot.stem}-{case}{args.plot.suffix}")
            draw(path)
            print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--memory-probe"]:
        return _probe_main(argv[1])
    parser = argparse.ArgumentParser(prog="gpucache bench", description=DESCRIPTION)
    add_arguments(parser)
    args = parser.parse_args(argv)
    from ._format import CacheFormatError

    try:
        return run(args)
    except (CacheFormatError, FileNotFoundError) as err:
        print(f"gpucache bench: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
