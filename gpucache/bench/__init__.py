"""``gpucache bench``: GpuCachedLoader against the usual ways of feeding JPEGs, side by side.

Every contender (``_contenders``) gets the same data, workers, batch size and transform. Each is
made and run for one warm-up epoch (time to first batch recorded), then the measured epochs run
interleaved -- an epoch of A, of B, ... -- with every loader and its persistent workers alive, so
drift of a noisy machine hits all alike (``_timing``). Memory is *copies held*, from two fresh
processes per contender (``_memory``; ``--memory-probe`` is their hidden mode). Cases
(``--case``, ``_cases``): ``main`` (the table), ``batch100`` (a batch of 100 from disk with
DataLoader+PIL against the store), ``scaling-workers`` and ``scaling-size`` (store build, save and
open time against data size). ``_report`` prints the table and draws the charts.

Importing this package is cheap: torchvision and matplotlib are imported only when a run needs them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from .._errors import BenchError
from ._common import Config, say
from ._contenders import CONTENDERS, GPU_BACKENDS

__all__ = ["add_parser", "run", "main"]

CASES = ("main", "batch100", "scaling-workers", "scaling-size")
DESCRIPTION = (
    "Time GpuCachedLoader against torch DataLoader peers (PIL from files, a list-of-bytes "
    "RAM cache) on the same data, workers, batch size and transform: images/s, batch "
    "latency, time to first batch, copies of the data held and peak parent RSS."
)


T = TypeVar("T")


def _csv(kind: Callable[[str], T]) -> Callable[[str], list[T]]:
    """An argument type: a comma list, each item converted by ``kind``."""

    def parse(text: str) -> list[T]:
        return [kind(x) for x in text.split(",") if x.strip()]

    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", nargs="?", help="ImageFolder root or a saved store file")
    p.add_argument(
        "--synthetic",
        type=int,
        metavar="N",
        help="use N generated JPEGs instead of SRC (made once, kept in the temp dir)",
    )
    p.add_argument(
        "--pipeline",
        choices=("train", "val"),
        default="train",
        help="train: random-resized-crop 224 + flip; val: resize 256 + center crop 224",
    )
    p.add_argument(
        "--normalize",
        action="store_true",
        help="end the pipeline in Normalize (ImageNet mean and std; torchvision's ToDtype + "
        "Normalize in the DataLoader's workers), as the README's example: float32 batches",
    )
    p.add_argument(
        "--backend",
        action="append",
        type=_csv(str),
        default=[],
        help="gpucache backends to run (repeatable or comma list: cpu,nvjpeg,dali); "
        "default cpu, plus nvjpeg and dali when CUDA is present",
    )
    p.add_argument(
        "--contenders",
        type=_csv(str),
        default=None,
        help=f"comma list of contenders to run: {', '.join(CONTENDERS)}",
    )
    p.add_argument(
        "--decoded",
        type=int,
        metavar="S",
        default=None,
        help="also run cpu-decoded-fork: GpuCachedLoader over a decoded tier whose images have "
        "a short side of S (decoded=S; without --decoded it runs only when named, at 256)",
    )
    p.add_argument("--workers", type=int, default=None, help="workers (default: usable cores)")
    p.add_argument("--batch-size", type=int, default=64, help="default 64")
    p.add_argument(
        "--epochs", type=int, default=3, help="measured epochs after the warm-up (default 3)"
    )
    p.add_argument("--seed", type=int, default=0, help="loader and synthetic-data seed")
    p.add_argument(
        "--case",
        action="append",
        choices=CASES,
        default=[],
        help="what to run (repeatable; default main)",
    )
    p.add_argument("--no-memory", action="store_true", help="skip the copies-held probes")
    p.add_argument(
        "--probe-mb",
        type=_csv(float),
        default=(30.0, 90.0),
        help="the two data sizes of the copies-held probes, MB (default 30,90)",
    )
    p.add_argument(
        "--sizes-mb",
        type=_csv(float),
        default=[100.0, 1000.0],
        help="scaling-size: data sizes in MB (default 100,1000)",
    )
    p.add_argument(
        "--batches",
        type=int,
        default=10,
        help="batch100: batches timed per contender in the calling process",
    )
    p.add_argument(
        "--explain",
        action="store_true",
        help="instead of the comparison: run GpuCachedLoader alone on SRC with the pipeline "
        "(the first --backend, default auto) for --epochs epochs, at most 300 batches each, "
        "and print where its time goes and what bounds it (loader.stats)",
    )
    p.add_argument(
        "--step-ms",
        type=float,
        default=0.0,
        help="--explain: a training step of this many milliseconds a batch (a sleep; default 0)",
    )
    p.add_argument("--json", type=Path, help="write every raw number here")
    p.add_argument("--plot", type=Path, help="draw images/s and copies held to this PNG")


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Register ``gpucache bench`` on the ``gpucache`` command's subparsers."""
    p = subparsers.add_parser(
        "bench", help="compare GpuCachedLoader with DataLoader peers", description=DESCRIPTION
    )
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def select(args: argparse.Namespace, cuda: bool) -> list[str]:
    """The contenders to run: ``--contenders`` and ``--backend``, less what this machine lacks."""
    backends = {b for group in args.backend for b in group} or (
        {"cpu", *GPU_BACKENDS} if cuda else {"cpu"}
    )
    bad = backends - {"cpu", *GPU_BACKENDS}
    if bad:
        raise ValueError(f"unknown backend {sorted(bad)}; choose from cpu, nvjpeg, dali")
    names = args.contenders or list(CONTENDERS)
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown:
        raise ValueError(f"unknown contenders {unknown}; choose from {', '.join(CONTENDERS)}")
    if args.decoded is not None and "cpu-decoded-fork" not in names:
        names = [*names, "cpu-decoded-fork"]
    keep = []
    for n in names:
        c = CONTENDERS[n]
        if c.decoded and args.decoded is None and not args.contenders:
            continue  # the decoded tier runs when asked for
        if c.backend is not None and c.backend not in backends:
            continue
        if c.backend in GPU_BACKENDS and not cuda:
            if args.contenders or args.backend:
                say(f"{n}: skipped, CUDA is not available here")
            continue
        if c.backend == "dali":
            from ..decode import dali_available

            if not dali_available():
                say("dali: skipped, nvidia-dali is not installed (pip install nvidia-dali-cuda120)")
                continue
        if c.backing == "rst":
            from .._native import transcoder_available

            if not transcoder_available():
                say(
                    f"{n}: skipped, gpucache's restart-marker transcoder was not built "
                    "(needs a C compiler and libjpeg headers at install)"
                )
                continue
        keep.append(n)
    return keep


def _invalid(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments, or None."""
    if bool(args.src) == bool(args.synthetic):
        return "give SRC (an ImageFolder or a store file) or --synthetic N"
    for name, v, low in (
        ("--workers", args.workers, 0),
        ("--batch-size", args.batch_size, 1),
        ("--epochs", args.epochs, 1),
        ("--synthetic", args.synthetic, 1),
        ("--batches", args.batches, 1),
        ("--decoded", args.decoded, 1),
    ):
        if v is not None and v < low:
            return f"{name} should be >= {low}, got {v}"
    if len(args.probe_mb) != 2 or not 0 < args.probe_mb[0] < args.probe_mb[1]:
        return "--probe-mb takes two sizes, small then large (e.g. 30,90)"
    return None


def run(args: argparse.Namespace) -> int:
    """Entry point of ``gpucache bench`` (after argument parsing); returns the exit status."""
    import torch

    from ..base._cores import usable_cores

    problem = _invalid(args)
    if problem:
        say(f"gpucache bench: {problem}")
        return 2
    args.probe_mb = tuple(args.probe_mb)
    try:
        names = select(args, torch.cuda.is_available())
    except ValueError as err:
        say(f"gpucache bench: {err}")
        return 2
    cfg = Config(
        pipeline=args.pipeline,
        normalize=args.normalize,
        batch_size=args.batch_size,
        epochs=args.epochs,
        workers=usable_cores() if args.workers is None else args.workers,
        seed=args.seed,
        decoded=256 if args.decoded is None else args.decoded,
    )
    try:
        if args.explain:
            return explain(args, cfg)
        return _run(args, names, cfg)
    except BenchError as err:
        print(f"gpucache bench: {err}", file=sys.stderr)
        return 1


# Rough costs for the up-front estimate, from runs on a 2-core development machine: images a
# second a worker (train pipeline, ~500x375 to ImageNet-size photos), a loader's start (workers
# importing torch), and one copies-held probe process (imports torch, builds its data).
_IMG_S_A_WORKER, _START_S, _PROBE_S = 200.0, 5.0, 30.0


def plan(
    names: list[str], images: int, cfg: Config, args: argparse.Namespace, cases: list[str]
) -> str:
    """What the run will do and about how long it takes, printed before anything is timed."""
    epochs = cfg.epochs + 1  # the warm-up epoch, then the measured ones
    per = _START_S + epochs * images / (_IMG_S_A_WORKER * max(1, cfg.workers))
    probes = 0 if args.no_memory or "main" not in cases else 2
    seconds = len(names) * (per + probes * _PROBE_S) if "main" in cases else 0.0
    if "batch100" in cases:
        seconds += len(names) * per
    lines = [
        f"plan: {len(names)} contenders ({', '.join(names)}), each 1 warm-up + {cfg.epochs} "
        f"measured epochs of {images} images (batch {cfg.batch_size}, {cfg.workers} "
        f"workers); cases: {', '.join(cases)}"
    ]
    if probes:
        lines.append(
            f"      copies held: {probes} fresh probe processes a contender "
            f"({args.probe_mb[0]:g} and {args.probe_mb[1]:g} MB of data)"
        )
    rough = f"about {seconds / 60:.0f} min" if seconds >= 90 else f"about {seconds:.0f} s"
    extra = " plus the scaling cases" if {"scaling-workers", "scaling-size"} & set(cases) else ""
    lines.append(
        f"      estimated time: {rough}{extra} (rough; shorter: --contenders, --epochs, "
        "--no-memory)"
    )
    return "\n".join(lines)


#: --explain: batches an epoch at most (the stats settle long before; a big data set's epoch
#: would take hours)
EXPLAIN_BATCHES = 300


def explain(args: argparse.Namespace, cfg: Config) -> int:
    """``gpucache bench SRC --explain``: the loader alone on the user's data; its stats report."""
    from ..loader._loader import GpuCachedLoader
    from ..node._jpegcache import JpegCache
    from ._contenders import gc_transform
    from ._data import synthetic_folder

    if args.synthetic:
        cache = JpegCache.from_folder(synthetic_folder(args.synthetic, args.seed), progress=False)
    elif Path(args.src).is_file():
        cache = JpegCache.open(args.src)
    else:
        cache = JpegCache.from_folder(args.src)
    backend: Any = next((b for group in args.backend for b in group), "auto")  # checked
    step = args.step_ms / 1e3
    loader = GpuCachedLoader(
        cache,
        batch_size=cfg.batch_size,
        num_workers=cfg.workers,
        backend=backend,
        shuffle=cfg.pipeline == "train",
        seed=cfg.seed,
        transform=gc_transform(cfg.pipeline, cfg.normalize),
    )
    print(
        f"gpucache bench --explain: {len(cache)} images, {cfg.pipeline} pipeline"
        f"{' + Normalize (float32)' if cfg.normalize else ''}, "
        f"backend {loader.backend_name}, {loader.num_workers} workers, batch {cfg.batch_size}, "
        f"{cfg.epochs} epochs of at most {EXPLAIN_BATCHES} batches, step {args.step_ms:g} ms",
        flush=True,
    )
    with loader:
        for _ in range(cfg.epochs):
            for b, _batch in enumerate(loader):
                if step:
                    time.sleep(step)  # the training step a user stands in
                if b + 1 >= EXPLAIN_BATCHES:
                    break
    print(loader.stats)
    if args.json:
        args.json.write_text(json.dumps(loader.stats.as_dict(), indent=1))
        print(f"wrote {args.json}")
    return 0


def _run(args: argparse.Namespace, names: list[str], cfg: Config) -> int:
    from . import _cases, _report
    from ._data import prepare_source

    cases = args.case or ["main"]
    if args.case and "batch100" in cases and not args.contenders:
        names100 = [n for n in ("pil", "cpu-file-fork", *GPU_BACKENDS) if n in names]
    else:
        names100 = names
    t_start = time.perf_counter()
    machine = _report.machine_info()
    report: dict[str, Any] = {
        "machine": machine,
        "args": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"
        },
    }
    plots: list[tuple[str, Callable[[Path], None]]] = []
    with tempfile.TemporaryDirectory(prefix="gpucache-bench-") as tmp_name:
        tmp = Path(tmp_name)
        need_store = any(
            CONTENDERS[n].backing in ("file", "rst")
            for n in (names if set(cases) & {"main", "scaling-workers"} else [])
            + (names100 if "batch100" in cases else [])
        )
        source = prepare_source(args, tmp, need_store)
        report["data"] = source.info
        title = _report.header(source, cfg, machine)
        print(f"gpucache bench: {title}")
        print(plan(names, int(source.info["images"]), cfg, args, cases), flush=True)
        for case in cases:
            if case == "main":
                report["main"], results = _cases.case_main(names, source, cfg, args, tmp)
                print()
                print(_report.format_table(results))
                width = max(len(n) for n in names)
                print("\n".join(f"  {n:<{width}}  {CONTENDERS[n].what}" for n in names))
                print(
                    "ratio: images/s over the first row's; copies: extra PSS per data byte "
                    f"(probes of {args.probe_mb[0]:g} and {args.probe_mb[1]:g} MB)"
                )
                plots.append(
                    ("main", partial(_report.plot_main, results, title="gpucache bench: " + title))
                )
            elif case == "batch100":
                report["batch100"] = _cases.case_batch100(names100, source, cfg, args)
            elif case == "scaling-workers":
                report["scaling_workers"] = rep = _cases.case_scaling_workers(
                    names, source, cfg, args, tmp
                )
                workers_title = title.replace(f", {cfg.workers} workers", "")
                plots.append(
                    (
                        "scaling-workers",
                        partial(
                            _report.plot_scaling,
                            rep["table"],
                            title="scaling with workers: " + workers_title,
                        ),
                    )
                )
            elif case == "scaling-size":
                report["scaling_size"] = _cases.case_scaling_size(source, args, tmp)
    report["wall_s"] = time.perf_counter() - t_start
    report["load_average_end"] = [round(v, 2) for v in os.getloadavg()]
    print(f"\ntotal wall time {report['wall_s']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))
        print(f"wrote {args.json}")
    for k, (case, draw) in enumerate(plots if args.plot else []):
        path = (
            args.plot
            if k == 0
            else args.plot.with_name(f"{args.plot.stem}-{case}{args.plot.suffix}")
        )
        draw(path)
        print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m gpucache.bench`` / ``benchmarks/bench_loader.py``: parse, then run."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--memory-probe"]:
        from ._memory import probe_main

        return probe_main(argv[1])
    parser = argparse.ArgumentParser(prog="gpucache bench", description=DESCRIPTION)
    add_arguments(parser)
    args = parser.parse_args(argv)
    from .._errors import CacheFormatError

    try:
        return run(args)
    except (CacheFormatError, FileNotFoundError) as err:
        print(f"gpucache bench: {err}", file=sys.stderr)
        return 2
