#!/usr/bin/env python
"""gpucache against every peer, each a long-lived process in its own environment.

    bash benchmarks/peers/install.sh /work/peer-venvs        # once: apt packages + one venv a peer
    python benchmarks/peers/data.py SRC /tmp/gpucache-peers   # once: the photos and the mosaics
    python benchmarks/peers/run.py /tmp/gpucache-peers/photos --venvs /work/peer-venvs \\
        --out benchmarks/results/peers-photos --rounds 5

For each pipeline (train: RandomResizedCrop 224 + flip; eval: Resize 256 + CenterCrop 224) every
contender is started (its format written once, kept in ``--work``), then ``--rounds`` rounds run:
in each, every contender in turn (the order rotates) runs one untimed warm-up epoch and then one
timed epoch, so a peer that decodes ahead while idle gains nothing, and the machine's drift hits
all alike. img/s is the median of the timed epochs. Every epoch must deliver every sample exactly
once. Writes OUT.json (every raw number, machine, load), OUT.md (the tables) and OUT.png.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from contenders import contenders  # noqa: E402
from report import write_report  # noqa: E402

JPEG_EXT = (".jpg", ".jpeg")


class Proc:
    """One contender's serve.py process."""

    def __init__(self, c, cfg: dict, venvs: Path, log: Path):
        self.c, self.log = c, open(log, "w")
        env = {**os.environ, "PYTHONPATH": c.src or cfg["gpucache_src"]}
        self.p = subprocess.Popen(
            [c.python(venvs), str(HERE / "serve.py"), c.driver, cfg["cfg_path"]],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
            cwd=str(ROOT),
        )

    def read(self, timeout: float) -> tuple[str, dict]:
        deadline = time.monotonic() + timeout
        for line in self.p.stdout:
            if line.startswith("@@"):
                kind, _, payload = line[2:].partition(" ")
                return kind, json.loads(payload)
            if time.monotonic() > deadline:
                break
        return "error", {"error": f"process ended (exit {self.p.poll()}); see {self.log.name}"}

    def epoch(self, timeout: float) -> tuple[str, dict]:
        self.p.stdin.write("epoch\n")
        self.p.stdin.flush()
        return self.read(timeout)

    def close(self) -> None:
        if self.p.poll() is None:
            try:
                self.p.stdin.write("quit\n")
                self.p.stdin.close()
                self.p.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                self.p.kill()
                self.p.wait()
        self.log.close()


def files_of(root: Path) -> list[str]:
    return [str(p) for p in sorted(root.rglob("*")) if p.suffix.lower() in JPEG_EXT and p.is_file()]


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def missing_peer(c, venvs: Path) -> str | None:
    """Why contender ``c``'s environment cannot run it (its distributions not installed), or None.

    Asked by distribution metadata from ``/``: a module name alone can import as an empty
    namespace package from a folder of the same name (a venv called ``ffcv`` in the cwd)."""
    if c.venv is None:
        return None
    py = c.python(venvs)
    if not os.access(py, os.X_OK):
        return f"no environment at {venvs / c.venv}; run bash benchmarks/peers/install.sh {venvs}"
    code = (
        "import sys, importlib.metadata as m\n"
        "for d in sys.argv[1:]:\n"
        "    try: m.version(d)\n"
        "    except m.PackageNotFoundError: print(d)\n"
    )
    out = subprocess.run(
        [py, "-c", code, *c.dists], capture_output=True, text=True, cwd="/", timeout=120
    )
    lacking = out.stdout.split() if out.returncode == 0 else [out.stderr.strip()[-300:]]
    if lacking:
        return (
            f"{venvs / c.venv} lacks {', '.join(lacking)}; run bash "
            f"benchmarks/peers/install.sh {venvs}"
        )
    return None


def run_pipeline(pipeline: str, chosen, files, args, work: Path) -> dict:
    procs, out = {}, {}
    for c in chosen:
        cw = work / c.name
        cw.mkdir(parents=True, exist_ok=True)
        cfg = {
            "files": files,
            "root": str(args.src),
            "pipeline": pipeline,
            "batch_size": args.batch_size,
            "workers": args.workers,
            "seed": args.seed,
            "work": str(cw),
            "options": c.options,
            "dists": list(c.dists),
            "cfg_path": str(cw / f"{pipeline}.json"),
            "gpucache_src": str(args.gpucache_src),
        }
        Path(cfg["cfg_path"]).write_text(json.dumps(cfg))
        res = out[c.name] = {"what": c.what, "warmup": [], "epochs": [], "load": []}
        lacking = missing_peer(c, args.venvs)
        if lacking is not None:  # never report a peer that is not there
            res["error"] = lacking
            print(f"  {c.name}: {lacking}", file=sys.stderr, flush=True)
            continue
        print(f"[{pipeline}] starting {c.name}", file=sys.stderr, flush=True)
        p = Proc(c, cfg, args.venvs, work / f"{c.name}-{pipeline}.log")
        kind, msg = p.read(args.timeout)
        if kind != "ready":
            res["error"] = msg.get("error")
            p.close()
            print(f"  {c.name}: {res['error']}", file=sys.stderr, flush=True)
            continue
        res.update(msg)
        procs[c.name] = p
    try:
        for r in range(args.rounds):
            names = list(procs)
            names = names[r % len(names) :] + names[: r % len(names)] if names else names
            line = []
            for n in names:
                res, p = out[n], procs[n]
                got = [p.epoch(args.timeout) for _ in range(2)]  # warm-up, then timed
                bad = next((m for k, m in got if k != "epoch"), None) or next(
                    (m for _, m in got if not m["exactly_once"]), None
                )
                if bad is not None:
                    res["error"] = bad.get("error") or (
                        f"not exactly once: {bad['missing']} samples missing, "
                        f"{bad['repeated']} repeated in an epoch of {bad['images']}"
                    )
                    procs.pop(n).close()
                    line.append(f"{n} failed")
                    continue
                res["warmup"].append(got[0][1])
                res["epochs"].append(got[1][1])
                res["load"].append(load())
                line.append(f"{n} {got[1][1]['img_s']:.0f}")
            print(
                f"[{pipeline}] round {r + 1}/{args.rounds} (load {load()[0]}): " + ", ".join(line),
                file=sys.stderr,
                flush=True,
            )
    finally:
        for p in procs.values():
            p.close()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="gpucache against every peer, interleaved epochs")
    p.add_argument("src", type=Path, help="an image folder (every JPEG below it is a sample)")
    p.add_argument(
        "--venvs",
        type=Path,
        default=Path("/work/peer-venvs"),
        help="where install.sh made the peers' environments",
    )
    p.add_argument(
        "--work",
        type=Path,
        default=Path("/tmp/gpucache-peers/work"),
        help="where each contender's format is written once and kept",
    )
    p.add_argument("--out", type=Path, required=True, help="OUT.json, OUT.md and OUT.png")
    p.add_argument("--pipelines", default="train,eval")
    p.add_argument("--only", help="comma list of contenders (default: all enabled)")
    p.add_argument("--skip", default="", help="comma list of contenders to leave out")
    p.add_argument(
        "--exact",
        action="store_true",
        help="add gpucache with exact (full-scale) decode beside the default, which "
        "decodes at a reduced DCT scale where the output is 2x smaller",
    )
    p.add_argument(
        "--exact-kw",
        type=json.loads,
        default={"exact": True},
        help="the GpuCachedLoader keywords of --exact (JSON)",
    )
    p.add_argument(
        "--max-side",
        type=int,
        default=None,
        help="add gpucache built with this size cap; FFCV smart uses it too",
    )
    p.add_argument(
        "--jpeg-quality",
        type=int,
        default=None,
        metavar="Q",
        help="add gpucache built with jpeg_quality=Q (every image re-encoded where "
        "smaller, as FFCV's jpg mode at 90)",
    )
    p.add_argument("--limit", type=int, default=None, help="use only N of the images")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5, help="timed epochs per contender")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800, help="seconds for one epoch or setup")
    p.add_argument(
        "--gpucache-src",
        type=Path,
        default=ROOT,
        help="the gpucache source tree the gpucache contenders import (default: this "
        "checkout; e.g. an older commit's, C extension built in place)",
    )
    p.add_argument(
        "--before-src",
        type=Path,
        default=None,
        help="also run gpucache and gpucache-rst from this source tree, as "
        "gpucache-before and gpucache-rst-before, in the same rounds",
    )
    p.add_argument("--note", default="", help="a line recorded with the result")
    args = p.parse_args(argv)
    flags = {
        "exact": args.exact,
        "max-side": args.max_side is not None,
        "jpeg-quality": args.jpeg_quality is not None,
    }
    cap = args.max_side or 512
    chosen = [
        c
        for c in contenders(cap, args.exact_kw, args.jpeg_quality or 90)
        if (c.flag is None or flags[c.flag])
        and c.name not in args.skip.split(",")
        and (not args.only or c.name in args.only.split(","))
    ]
    if args.before_src is not None:
        at = chosen.index(next(c for c in chosen if c.name.startswith("gpucache")))
        before = [
            replace(
                c,
                name=f"{c.name}-before",
                src=str(args.before_src.resolve()),
                what=f"{c.what}, from {args.before_src}",
            )
            for c in chosen
            if c.name in ("gpucache", "gpucache-rst")
        ]
        chosen[at:at] = before
    files = files_of(args.src)
    if args.limit and args.limit < len(files):  # evenly spaced, so every class keeps its share
        files = [files[k * len(files) // args.limit] for k in range(args.limit)]
    key = hashlib.sha1("\n".join(files).encode()).hexdigest()[:10]
    work = args.work / f"{args.src.name}-{key}"
    if args.gpucache_src.resolve() != ROOT:  # stores of another version kept apart
        work = work / hashlib.sha1(str(args.gpucache_src.resolve()).encode()).hexdigest()[:8]
    work.mkdir(parents=True, exist_ok=True)
    from gpucache.bench._report import machine_info, source_commit

    report = {
        "machine": machine_info(),  # with the commit of this tree
        "gpucache_src_commit": source_commit(args.gpucache_src.resolve()),  # the contenders' tree
        "load_start": load(),
        "note": args.note,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "data": {
            "src": str(args.src),
            "images": len(files),
            "bytes": sum(os.path.getsize(f) for f in files),
        },
        "pipelines": {},
    }
    t0 = time.perf_counter()
    for pipeline in args.pipelines.split(","):
        report["pipelines"][pipeline] = run_pipeline(pipeline, chosen, files, args, work)
        report["load_end"], report["wall_s"] = load(), time.perf_counter() - t0
        text = write_report(report, args.out)  # after each pipeline: a late stop keeps the first
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
