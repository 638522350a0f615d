"""Ultralytics' YOLO data loader on real photos: its own images against gpucache's two tiers.

    PYTHONPATH=. python benchmarks/ultralytics_loader.py [SRC] [--imgsz 640] [--workers 2]
        [--epochs 2] [--json out.json]

SRC is an ImageFolder tree with ``train/`` and ``val/`` (default: ../shared/data/hymenoptera,
397 photos, most about 500 x 375). It is laid out for YOLO in a fresh temporary folder (the
images linked, one made-up box an image, its class the folder's), and Ultralytics' settings go
there too (offline, no font download). Four contenders, the same ``YOLODataset`` of the train
split (``mode="train"``: mosaic, random perspective, HSV, flips; batch 16, Ultralytics' collate):

- ``ultralytics-file``: Ultralytics' own, ``cache=False`` (``cv2.imread`` + resize every load);
- ``ultralytics-ram``: Ultralytics' own, ``cache="ram"`` (decoded and resized into one buffer at
  the start of every run, shared with spawn workers through ``/dev/shm``);
- ``gpucache-raw``: ``gpucache.ultralytics.build_yolo_dataset``, ``cache=False``: decoded from
  the store's JPEG bytes every load;
- ``gpucache-decoded``: the same, ``cache="ram"``: the decoded tier, one file in the node cache.

Each contender runs in a fresh process a worker context (fork, spawn), ``--rounds`` times\n(interleaved): the dataset's build time
(gpucache: a first run in an empty node cache folder, then a rerun that finds the store and the
tier there), then ``--epochs`` epochs of a ``torch.utils.data.DataLoader`` with ``--workers``
persistent workers (images/s of the last epoch, workers warm) and the summed PSS of the process
and its workers after it. Before any timing, ``load_image`` of gpucache's decoded tier is checked
against Ultralytics' own on every train image (the same shapes; max and mean difference).
``--ranks 2``: each contender (fork workers) again under ``torchrun --nproc_per_node=2`` on the
CPU, each rank its own dataset and workers as Ultralytics' DDP ranks have: the ranks' PSS summed.
``--train``: one epoch of ``YOLO("yolo11n.yaml").train(...)`` with each (no validation).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks._record import run_info, write_json  # noqa: E402

SHARED = ROOT.parent / "shared" / "data" / "hymenoptera"
CONTENDERS = ("ultralytics-file", "ultralytics-ram", "gpucache-raw", "gpucache-decoded")
MiB = 2**20


def layout(src: Path, dst: Path) -> Path:
    """``src/{train,val}/<class>/*`` as YOLO's ``images/`` and ``labels/`` (links, made-up
    boxes); the data YAML's path."""
    classes = sorted(p.name for p in (src / "train").iterdir() if p.is_dir())
    for split in ("train", "val"):
        (dst / "images" / split).mkdir(parents=True)
        (dst / "labels" / split).mkdir(parents=True)
        for c, name in enumerate(classes):
            for k, f in enumerate(sorted((src / split / name).iterdir())):
                stem = f"{name}_{k}"
                (dst / "images" / split / f"{stem}{f.suffix.lower()}").symlink_to(f.resolve())
                w, h = 0.3 + 0.4 * ((k * 7) % 10) / 10, 0.3 + 0.4 * ((k * 3) % 10) / 10
                (dst / "labels" / split / f"{stem}.txt").write_text(
                    f"{c} 0.5 0.5 {w:.3f} {h:.3f}\n"
                )
    names = "".join(f"  {c}: {n}\n" for c, n in enumerate(classes))
    yaml = dst / "data.yaml"
    yaml.write_text(f"path: {dst}\ntrain: images/train\nval: images/val\nnames:\n{names}")
    return yaml


def _ultralytics(home: Path):  # type: ignore[no-untyped-def]
    os.environ["YOLO_CONFIG_DIR"] = str(home / "config")
    os.environ["YOLO_OFFLINE"] = "1"
    from ultralytics.data import utils as data_utils

    data_utils.check_font = lambda *a, **k: None  # fonts are for plots only: nothing downloaded
    return data_utils


def dataset(name: str, yaml: Path, imgsz: int, node: Path):  # type: ignore[no-untyped-def]
    data_utils = _ultralytics(yaml.parent)
    from ultralytics.cfg import get_cfg
    from ultralytics.data.build import build_yolo_dataset as theirs

    import gpucache.ultralytics as gu

    info = data_utils.check_det_dataset(str(yaml))
    cache = "ram" if name.endswith(("ram", "decoded")) else False
    cfg = get_cfg(overrides={"imgsz": imgsz, "cache": cache, "plots": False})
    if name.startswith("ultralytics"):
        return theirs(cfg, info["train"], 16, info, mode="train")
    return gu.build_yolo_dataset(cfg, info["train"], 16, info, mode="train", cache_dir=str(node))


def one(name: str, context: str, yaml: Path, imgsz: int, workers: int, epochs: int, node: Path):
    """One contender in this (fresh) process: a JSON line on stdout."""
    import torch

    from gpucache.testing._memory import tree_pss

    torch.set_num_threads(1)
    out: dict[str, object] = {"contender": name, "context": context}
    t = time.perf_counter()
    ds = dataset(name, yaml, imgsz, node)
    out["build_s"] = round(time.perf_counter() - t, 3)
    if name.startswith("gpucache"):
        t = time.perf_counter()
        again = dataset(name, yaml, imgsz, node)  # the node's store and tier found
        out["rebuild_s"] = round(time.perf_counter() - t, 3)
        out["tier"] = again.gpucache_tier
        del again
    loader = torch.utils.data.DataLoader(
        ds,
        batch_size=16,
        shuffle=True,
        num_workers=workers,
        multiprocessing_context=context,
        persistent_workers=True,
        collate_fn=ds.collate_fn,
        generator=torch.Generator().manual_seed(0),
    )
    rates = []
    for _ in range(epochs):
        t, n = time.perf_counter(), 0
        for batch in loader:
            n += len(batch["img"])
        rates.append(n / (time.perf_counter() - t))
    out["images_s"] = [round(r, 1) for r in rates]
    out["pss_mib"] = round(tree_pss() / MiB, 1)
    out["images"] = len(ds)
    print(json.dumps(out), flush=True)


def train(name: str, yaml: Path, imgsz: int, workers: int, node: Path) -> None:
    """One epoch of ``YOLO("yolo11n.yaml")`` on the train split (no validation), timed from the
    epoch's start to its end: a JSON line on stdout. (On the CPU Ultralytics trains with
    ``workers=0`` whatever is asked: the loop loads its own images.)"""
    _ultralytics(yaml.parent)
    from ultralytics import YOLO

    import gpucache.ultralytics as gu

    trainer = None
    if name.startswith("gpucache"):
        trainer = type("Trainer", (gu.DetectionTrainer,), {"gpucache_cache_dir": str(node)})
    model = YOLO("yolo11n.yaml")
    marks: dict[str, float] = {}
    model.add_callback(
        "on_train_epoch_start", lambda _: marks.setdefault("start", time.perf_counter())
    )
    model.add_callback("on_train_epoch_end", lambda _: marks.setdefault("end", time.perf_counter()))
    cache = "ram" if name.endswith(("ram", "decoded")) else False
    t = time.perf_counter()
    model.train(
        data=str(yaml),
        trainer=trainer,
        epochs=1,
        imgsz=imgsz,
        batch=16,
        workers=workers,
        device="cpu",
        cache=cache,
        plots=False,
        val=False,
        project=str(node / "runs"),
        name="t",
        exist_ok=True,
        verbose=False,
    )
    n = len(model.trainer.train_loader.dataset)
    epoch = marks["end"] - marks["start"]
    print(
        json.dumps(
            {
                "contender": name,
                "images": n,
                "epoch_s": round(epoch, 2),
                "images_s": round(n / epoch, 1),
                "train_call_s": round(time.perf_counter() - t, 2),
            }
        ),
        flush=True,
    )


def check(yaml: Path, imgsz: int, node: Path) -> dict[str, object]:
    """gpucache's decoded tier's ``load_image`` against Ultralytics' own, every train image."""
    import numpy as np

    ours = dataset("gpucache-decoded", yaml, imgsz, node)
    ref = dataset("ultralytics-file", yaml, imgsz, node)
    assert ours.im_files == ref.im_files and ours.gpucache_tier == "decoded"
    worst, means = 0, []
    for i in range(len(ref.im_files)):
        a, hw0, hw = ours.load_image(i)
        b, rhw0, rhw = ref.load_image(i)
        assert (hw0, hw, a.shape) == (rhw0, rhw, b.shape), (i, hw0, hw, rhw0, rhw)
        d = np.abs(a.astype(np.int16) - b.astype(np.int16))
        worst, means = max(worst, int(d.max())), [*means, float(d.mean())]
    return {
        "images": len(means),
        "max_diff": worst,
        "mean_diff_mean": round(float(np.mean(means)), 4),
        "mean_diff_worst_image": round(max(means), 4),
        "tier_mib": round(ours.gpucache_pixels.pixels.nbytes / MiB, 1),
        "store_mib": round(ours.gpucache_store.nbytes / MiB, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("src", nargs="?", default=str(SHARED))
    ap.add_argument("--imgsz", type=int, default=640)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--contexts", default="fork,spawn")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds of every run")
    ap.add_argument("--ranks", type=int, default=1, help="also each contender under torchrun")
    ap.add_argument("--train", action="store_true", help="also one epoch of YOLO training each")
    ap.add_argument("--json")
    for mode in ("--one", "--train-one"):
        ap.add_argument(
            mode, nargs=4, metavar=("NAME", "CONTEXT", "YAML", "NODE"), help=argparse.SUPPRESS
        )
    a = ap.parse_args()
    if a.one:
        name, context, yaml, node = a.one
        one(name, context, Path(yaml), a.imgsz, a.workers, a.epochs, Path(node))
        return
    if a.train_one:
        name, _, yaml, node = a.train_one
        train(name, Path(yaml), a.imgsz, a.workers, Path(node))
        return
    run = run_info()
    with tempfile.TemporaryDirectory(prefix="gpucache-yolo-bench-") as tmp:
        yaml = layout(Path(a.src), Path(tmp) / "set")
        result: dict[str, object] = {"src": a.src, "imgsz": a.imgsz, "workers": a.workers}
        result["check"] = c = check(yaml, a.imgsz, Path(tmp) / "check-node")
        print("load_image against Ultralytics':", c, flush=True)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        common = ["--imgsz", str(a.imgsz), "--workers", str(a.workers), "--epochs", str(a.epochs)]

        def child(pre: list[str], mode: str, name: str, context: str) -> list[dict]:
            node = Path(tmp) / f"node-{name}-{context}"  # empty: the first run builds
            cmd = [*pre, __file__, *common, mode, name, context, str(yaml), str(node)]
            p = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
            lines = [json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith("{")]
            shutil.rmtree(node, ignore_errors=True)
            if p.returncode or not lines:
                raise SystemExit(f"{name} {context} failed:\n{p.stderr[-3000:]}")
            return lines

        rows = []
        for r in range(a.rounds):
            for context in a.contexts.split(","):
                for name in CONTENDERS:
                    rows.append({"round": r, **child([sys.executable], "--one", name, context)[-1]})
                    print(rows[-1], flush=True)
        if a.ranks > 1:  # each rank its own dataset and workers, as Ultralytics' DDP ranks
            run_ranks = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            run_ranks.append(f"--nproc_per_node={a.ranks}")
            ranked = []
            for name in CONTENDERS:
                each = child(run_ranks, "--one", name, "fork")
                ranked.append(
                    {
                        "contender": name,
                        "ranks": len(each),
                        "pss_mib_sum": round(sum(float(e["pss_mib"]) for e in each), 1),
                        "images_s_each": [e["images_s"][-1] for e in each],
                        "build_s_each": [e["build_s"] for e in each],
                    }
                )
                print(ranked[-1], flush=True)
            result["ranks"] = ranked
        if a.train:
            trained = []
            for name in CONTENDERS:
                trained.append(child([sys.executable], "--train-one", name, "fork")[-1])
                print(trained[-1], flush=True)
            result["train"] = trained
        result["rows"] = rows
    if a.json:
        write_json(a.json, result, run=run)


if __name__ == "__main__":
    main()
