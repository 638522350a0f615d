"""The README's Results rows on real photos: uint8 and float32 + Normalize, train and eval, against
DataLoader + ImageFolder + PIL doing the same, in interleaved rounds of ``gpucache bench``.

    PYTHONPATH=. python benchmarks/readme_rows.py [SRC] [--rounds 3] [--epochs 5] [--workers 2]
        [--base DIR] [--json out.json]

SRC is an ImageFolder tree (default: ../shared/data/hymenoptera). Each round runs, one after the
other (the order flips every round), ``gpucache bench SRC --contenders pil,cpu-file-fork
--workers 2 --no-memory --epochs N`` for each pipeline (train: RandomResizedCrop 224 + flip; val:
Resize 256 + CenterCrop 224), without and with ``--normalize`` (the README's example: float32
out of Normalize; the DataLoader's ToDtype + Normalize run in its workers). Within a bench run the
two contenders' epochs alternate. ``--base DIR`` runs the same commands with another checkout of
gpucache (say, the commit before a change, with this checkout's ``gpucache/bench/`` copied in
for ``--normalize``) in the same rounds, so a before/after holds on the same machine load.

Each row's figure is the median over rounds of the run's ratio (gpucache img/s over DataLoader's,
each the median of the run's epochs); the load average (1 min) is recorded at each run's start
and end. Every batch is checked by the bench (dtype, shape, labels per epoch).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks._record import run_info, run_line, write_json  # noqa: E402

SHARED = ROOT.parent / "shared" / "data" / "hymenoptera"


def _bench(checkout: Path, src: str, pipeline: str, normalize: bool, args, out: Path) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "gpucache",
        "bench",
        src,
        "--contenders",
        "pil,cpu-file-fork",
        "--workers",
        str(args.workers),
        "--no-memory",
        "--epochs",
        str(args.epochs),
        "--pipeline",
        pipeline,
        "--json",
        str(out),
    ] + (["--normalize"] if normalize else [])
    env = dict(os.environ, PYTHONPATH=str(checkout))
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, cwd=checkout)
    report = json.loads(out.read_text())
    rates = {r["name"]: r["summary"]["img_s"] for r in report["main"]["contenders"]}
    return {
        "pil_img_s": rates["pil"],
        "gpucache_img_s": rates["cpu-file-fork"],
        "ratio": rates["cpu-file-fork"] / rates["pil"],
        "load_average": report["machine"].get("load_average", [None])[0],
        "load_average_end": report.get("load_average_end", [None])[0],
        "commit": report["machine"].get("commit"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src", nargs="?", default=str(SHARED))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--base", type=Path, help="another checkout to run beside this one")
    p.add_argument("--base-commit", help="the commit --base holds, when it is not a git checkout")
    p.add_argument("--pipelines", default="train,val")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    run = run_info()
    print(run_line(), flush=True)
    checkouts = {"this": ROOT} | ({"base": args.base.resolve()} if args.base else {})
    configs = [
        (who, pipeline, normalize)
        for pipeline in args.pipelines.split(",")
        for normalize in (False, True)
        for who in checkouts
    ]
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for k, (who, pipeline, normalize) in enumerate(
                configs if r % 2 == 0 else configs[::-1]
            ):
                row = _bench(
                    checkouts[who], args.src, pipeline, normalize, args, Path(tmp) / f"{r}-{k}.json"
                )
                row.update(round=r, checkout=who, pipeline=pipeline, normalize=normalize)
                runs.append(row)
                print(
                    f"round {r} {who:<4} {pipeline:<5} {'float32' if normalize else 'uint8  '} "
                    f"DataLoader {row['pil_img_s']:6.0f} img/s, gpucache "
                    f"{row['gpucache_img_s']:6.0f} ({row['ratio']:.2f}x); load "
                    f"{row['load_average']} -> {row['load_average_end']}",
                    flush=True,
                )
    rows = []
    for who, pipeline, normalize in configs:
        mine = [
            x
            for x in runs
            if (x["checkout"], x["pipeline"], x["normalize"]) == (who, pipeline, normalize)
        ]
        rows.append(
            {
                "checkout": who,
                "commit": mine[0]["commit"] or (args.base_commit if who == "base" else None),
                "pipeline": pipeline,
                "output": "float32 + Normalize" if normalize else "uint8",
                "ratio_median": statistics.median(x["ratio"] for x in mine),
                "ratios": [round(x["ratio"], 3) for x in mine],
                "pil_img_s_median": statistics.median(x["pil_img_s"] for x in mine),
                "gpucache_img_s_median": statistics.median(x["gpucache_img_s"] for x in mine),
                "load_average": [x["load_average"] for x in mine],
            }
        )
    print("\ncheckout pipeline output               DataLoader  gpucache  ratio (median)")
    for row in rows:
        print(
            f"{row['checkout']:<8} {row['pipeline']:<8} {row['output']:<20} "
            f"{row['pil_img_s_median']:10.0f} {row['gpucache_img_s_median']:9.0f}  "
            f"{row['ratio_median']:.2f}x  {row['ratios']}"
        )
    if args.json:
        write_json(
            args.json,
            {
                "src": args.src,
                "workers": args.workers,
                "epochs": args.epochs,
                "rows": rows,
                "runs": runs,
            },
            run=run,
        )


if __name__ == "__main__":
    main()
