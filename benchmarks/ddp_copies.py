"""Copies of the data held on one node by a torchrun job running the code of the multi-GPU guide
(docs/guides/multi-gpu.md).

    python benchmarks/ddp_copies.py [--ranks 2 3] [--contexts fork spawn forkserver] [--json F]

For each start method and rank count, pipelines/ddp_example.py runs under torchrun (gloo, CPU,
2 workers per rank) twice, on the same 40 synthetic photos repeated 2 and 10 times. Rank 0 sums the
PSS of every process under torchrun's agent (ranks and workers, shared-library mappings left out)
after the last epoch, workers alive; copies held = PSS difference / data difference (1.0 = the
data is in RAM once on the node). Run from the repository root.

The small run does as many epochs as make each rank handle about as many batches as in the big
run's one epoch (3 ranks: 4 x 4 vs 17; 2 ranks: 5 x 5 vs 25), so the two runs differ in the data
only. Every process's heap and anonymous memory grow over its first batches (allocator high-water
marks) and then nearly level off; with one epoch each, the small run's workers stop after 2
batches, and that warm-up, not image data, measured as 0.03-0.10 extra "copies" (store file
pages: 1.001 copies in every run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from gpucache.testing import make_jpeg_folder

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # benchmarks._record
from benchmarks._record import run_info, run_line, write_json  # noqa: E402


def _data(base: Path, repeat: int) -> Path:
    src = base / "src"
    if not src.exists():
        make_jpeg_folder(src, 40, seed=5)
    root = base / f"data{repeat}"
    if not root.exists():
        for i, p in enumerate(sorted(src.rglob("*.jpg")) * repeat):
            (root / f"c{i:04d}").mkdir(parents=True)
            shutil.copy(p, root / f"c{i:04d}" / "x.jpg")
    return root


BATCH = 8


def _batches(images: int, ranks: int) -> int:
    per_rank = -(-images // ranks)  # the sampler pads the last
    return -(-per_rank // BATCH)  # per rank and epoch


def _pss(base: Path, ranks: int, context: str, repeat: int, epochs: int) -> dict:
    record = base / f"rec-{context}-{ranks}-{repeat}"
    record.mkdir()
    env = dict(
        os.environ,
        TMPDIR=str(base),
        MALLOC_MMAP_THRESHOLD_="65536",
        MALLOC_TRIM_THRESHOLD_="65536",
        OMP_NUM_THREADS="1",
    )
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={ranks}",
            "-m",
            "pipelines.ddp_example",
            "--data",
            str(_data(base, repeat)),
            "--workers",
            "2",
            "--context",
            context,
            "--batch-size",
            str(BATCH),
            "--epochs",
            str(epochs),
            "--record",
            str(record),
        ],
        env=env,
        check=True,
        capture_output=True,
    )
    return json.loads((record / "pss.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    p.add_argument("--contexts", nargs="+", default=["fork", "spawn", "forkserver"])
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    run = run_info()
    print(run_line())
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpucache-ddp-") as tmp:
        base = Path(tmp)
        for ranks in args.ranks:
            for context in args.contexts:
                epochs = round(_batches(400, ranks) / _batches(80, ranks))  # same batch count
                small = _pss(base, ranks, context, 2, epochs)
                big = _pss(base, ranks, context, 10, 1)
                copies = (big["pss"] - small["pss"]) / (big["data"] - small["data"])
                rows.append(
                    {
                        "ranks": ranks,
                        "context": context,
                        "copies": round(copies, 3),
                        "data_mb": [round(small["data"] / 1e6, 1), round(big["data"] / 1e6, 1)],
                    }
                )
                print(
                    f"{ranks} ranks x 2 workers, {context:10s}: {copies:.3f} copies held "
                    f"(data {small['data'] / 1e6:.1f} -> {big['data'] / 1e6:.1f} MB)",
                    flush=True,
                )
    if args.json:
        write_json(args.json, rows, run=run)


if __name__ == "__main__":
    main()
