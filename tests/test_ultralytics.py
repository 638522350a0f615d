"""gpucache.ultralytics: Ultralytics' YOLO trains from a store, and its images are Ultralytics'.

Generated photos in YOLO layout in tmp_path; Ultralytics' settings, runs and fonts kept there
and nothing downloaded (plots off, the font check and the network check stubbed, AMP's check
runs only on CUDA). Skipped where Ultralytics is not installed (the ``test`` extra has it).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gpucache.testing import make_jpeg_bytes

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ultralytics") is None,
    reason="ultralytics is not installed (pip install 'gpucache-loader[ultralytics]'; the test "
    "extra has it)",
)

#: (width, height, EXIF orientation): landscape, portrait, square, smaller than imgsz (enlarged),
#: rotated by EXIF, grayscale and progressive among them
PHOTOS = [(200, 150, None), (150, 220, None), (180, 180, None), (96, 64, None), (210, 140, 6)]


def _photos(root: Path, split: str, n: int, seed: int) -> None:
    (root / "images" / split).mkdir(parents=True)
    (root / "labels" / split).mkdir(parents=True)
    rng = np.random.default_rng(seed)
    for k in range(n):
        w, h, orient = PHOTOS[k % len(PHOTOS)]
        data = make_jpeg_bytes(
            w,
            h,
            seed=seed * 100 + k,
            mode="L" if k == 2 else "RGB",
            progressive=k == 1,
            exif_orientation=orient,
        )
        (root / "images" / split / f"im{k}.jpg").write_bytes(data)
        rows = []
        for _ in range(2):
            cx, cy = rng.uniform(0.3, 0.7, 2)
            bw, bh = rng.uniform(0.1, 0.4, 2)
            rows.append(f"{int(rng.integers(2))} {cx:.4f} {cy:.4f} {bw:.4f} {bh:.4f}")
        (root / "labels" / split / f"im{k}.txt").write_text("\n".join(rows) + "\n")


@pytest.fixture(scope="module")
def yolo(tmp_path_factory):
    """Ultralytics imported with its settings in a temporary folder, offline, no font download."""
    import random

    import torch

    home = tmp_path_factory.mktemp("ultralytics")
    # what Ultralytics' training sets process-wide (threads, deterministic mode, seeds, two
    # variables), put back for the tests that run after these in the same process
    threads, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    states = torch.random.get_rng_state(), np.random.get_state(), random.getstate()
    with pytest.MonkeyPatch.context() as mp:
        for name in ("CUBLAS_WORKSPACE_CONFIG", "PYTHONHASHSEED"):
            if name in os.environ:
                mp.setenv(name, os.environ[name])
            else:
                mp.delenv(name, raising=False)
        mp.setattr(torch.backends.cudnn, "deterministic", torch.backends.cudnn.deterministic)
        mp.setenv("YOLO_CONFIG_DIR", str(home / "config"))
        mp.setenv("YOLO_OFFLINE", "1")
        ultralytics = importlib.import_module("ultralytics")
        from ultralytics.data import utils as data_utils

        mp.setattr(data_utils, "check_font", lambda *a, **k: None)  # fonts are for plots only
        try:
            yield ultralytics, home
        finally:
            torch.set_num_threads(threads)
            torch.use_deterministic_algorithms(det)
            torch.utils.deterministic.fill_uninitialized_memory = fill
            torch.random.set_rng_state(states[0])
            np.random.set_state(states[1])
            random.setstate(states[2])


@pytest.fixture
def data(tmp_path):
    root = tmp_path / "set"
    _photos(root, "train", 6, seed=1)
    _photos(root, "val", 3, seed=2)
    yaml = tmp_path / "data.yaml"
    yaml.write_text(
        f"path: {root}\ntrain: images/train\nval: images/val\nnames:\n  0: ant\n  1: bee\n"
    )
    return yaml


def _cfg(yolo, tmp_path, **kw):
    from ultralytics.cfg import get_cfg

    return get_cfg(overrides={"imgsz": 160, "task": "detect", "plots": False, **kw})


def test_importing_gpucache_does_not_import_ultralytics():
    code = "import sys, gpucache; assert 'ultralytics' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("cache", [False, "ram"])
def test_load_image_is_ultralytics_own_for_every_image(yolo, data, tmp_path, cache):
    """Same original and resized shapes, BGR pixels within the two JPEG decoders' rounding."""
    from ultralytics.data.build import build_yolo_dataset as theirs
    from ultralytics.data.utils import check_det_dataset

    import gpucache.ultralytics as gu

    info = check_det_dataset(str(data))
    cfg = _cfg(yolo, tmp_path, cache=cache)
    ours = gu.build_yolo_dataset(
        cfg, info["train"], 4, info, mode="train", cache_dir=str(tmp_path / "node")
    )
    assert ours.gpucache_tier == ("decoded" if cache else "raw"), ours.gpucache_reason
    ref = theirs(_cfg(yolo, tmp_path, cache=False), info["train"], 4, info, mode="train")
    assert ours.im_files == ref.im_files and len(ours.im_files) == 6
    for i in range(len(ref.im_files)):
        a, hw0, hw = ours.load_image(i)
        b, rhw0, rhw = ref.load_image(i)
        assert (hw0, hw) == (rhw0, rhw) and a.shape == b.shape and a.dtype == b.dtype, i
        diff = np.abs(a.astype(np.int16) - b.astype(np.int16))
        assert diff.max() <= 2 and diff.mean() <= 0.5, (i, diff.max(), diff.mean())
    if cache:  # one file mapped, reused by the next dataset (no second build)
        (tier,) = (tmp_path / "node").glob("*.pixels")
        again = gu.build_yolo_dataset(
            cfg, info["train"], 4, info, mode="train", cache_dir=str(tmp_path / "node")
        )
        assert again.gpucache_pixels.pixels.path == tier
        assert again.gpucache_tier == "decoded"


def test_decoded_tier_over_budget_falls_back_to_raw(yolo, data, tmp_path, monkeypatch):
    from ultralytics.data.utils import check_det_dataset

    import gpucache.ultralytics as gu
    from gpucache.ultralytics import _pixels

    monkeypatch.setattr(_pixels, "default_budget", lambda: 1000)
    info = check_det_dataset(str(data))
    with pytest.warns(RuntimeWarning, match="more than its budget"):
        ds = gu.build_yolo_dataset(
            _cfg(yolo, tmp_path, cache="ram"),
            info["train"],
            4,
            info,
            cache_dir=str(tmp_path / "node"),
        )
    assert ds.gpucache_tier == "raw" and "budget" in ds.gpucache_reason
    im, _, hw = ds.load_image(0)
    assert im.shape[:2] == hw and max(hw) == 160


def test_one_epoch_of_yolo_trains_from_the_store(yolo, data, tmp_path):
    from ultralytics import YOLO

    import gpucache.ultralytics as gu

    class Trainer(gu.DetectionTrainer):
        gpucache_cache_dir = str(tmp_path / "node")

    model = YOLO("yolo11n.yaml")  # built from its config: no weights downloaded
    model.train(
        data=str(data),
        trainer=Trainer,
        epochs=1,
        imgsz=160,
        batch=4,
        workers=2,
        device="cpu",
        cache="ram",
        plots=False,
        val=True,
        project=str(tmp_path / "runs"),
        name="t",
        exist_ok=True,
        verbose=False,
    )
    trainer = model.trainer
    assert isinstance(trainer, gu.DetectionTrainer)
    for loader in (trainer.train_loader, trainer.test_loader):
        assert isinstance(loader.dataset, gu.YOLODataset)
        assert loader.dataset.gpucache_tier == "decoded"
    assert (tmp_path / "runs" / "t" / "weights" / "last.pt").is_file()
    assert os.listdir(tmp_path / "node")


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_workers_read_the_same_tier_file(yolo, data, tmp_path, context):
    """The dataset pickles without its pixels (spawn workers map the node's file) and its
    batches through Ultralytics' collate are the same under fork and spawn workers."""
    import pickle

    import torch
    from ultralytics.data.utils import check_det_dataset

    import gpucache.ultralytics as gu

    info = check_det_dataset(str(data))
    ds = gu.build_yolo_dataset(
        _cfg(yolo, tmp_path, cache="ram"),
        info["val"],
        3,
        info,
        mode="val",
        rect=True,
        cache_dir=str(tmp_path / "node"),
    )
    assert ds.gpucache_tier == "decoded"
    assert len(pickle.dumps(ds.gpucache_pixels)) < 64 << 10  # handles, not pixels
    loader = torch.utils.data.DataLoader(
        ds,
        batch_size=3,
        num_workers=2,
        multiprocessing_context=context,
        collate_fn=ds.collate_fn,
    )
    (batch,) = list(loader)
    inline = ds.collate_fn([ds[i] for i in range(3)])
    assert torch.equal(batch["img"], inline["img"]) and batch["img"].shape[0] == 3
    assert torch.equal(batch["bboxes"], inline["bboxes"])


def test_segmentation_and_classification_train_from_the_store(yolo, tmp_path):
    from ultralytics import YOLO

    import gpucache.ultralytics as gu

    root = tmp_path / "seg"
    for split, n in (("train", 4), ("val", 2)):
        _photos(root, split, n, seed=3 if split == "train" else 4)
        for txt in (root / "labels" / split).glob("*.txt"):  # a polygon an object
            txt.write_text("0 0.2 0.2 0.6 0.25 0.5 0.7 0.25 0.6\n1 0.6 0.6 0.9 0.6 0.8 0.9\n")
    yaml = tmp_path / "seg.yaml"
    yaml.write_text(f"path: {root}\ntrain: images/train\nval: images/val\nnames:\n  0: a\n  1: b\n")
    cls_root = tmp_path / "cls"
    for split in ("train", "val"):
        for c, name in enumerate(("ant", "bee")):
            (cls_root / split / name).mkdir(parents=True)
            for k in range(2):
                jpeg = make_jpeg_bytes(90 + 10 * k, 70, seed=10 * c + k)
                (cls_root / split / name / f"{k}.jpg").write_bytes(jpeg)

    common = dict(
        epochs=1,
        imgsz=64,
        batch=4,
        workers=0,
        device="cpu",
        plots=False,
        project=str(tmp_path / "runs"),
        exist_ok=True,
        verbose=False,
    )
    for cfg, data_, base, name in (
        ("yolo11n-seg.yaml", str(yaml), gu.SegmentationTrainer, "seg"),
        ("yolo11n-cls.yaml", str(cls_root), gu.ClassificationTrainer, "cls"),
    ):
        trainer_cls = type("T", (base,), {"gpucache_cache_dir": str(tmp_path / "node")})
        model = YOLO(cfg)
        model.train(data=data_, trainer=trainer_cls, name=name, **common)
        ds = model.trainer.train_loader.dataset
        assert isinstance(model.trainer, base) and ds.gpucache_tier == "raw"
        assert (tmp_path / "runs" / name / "weights" / "last.pt").is_file()
    labels = ds.gpucache_store.labels[ds.gpucache_index]
    assert labels.tolist() == [s[1] for s in ds.samples]  # the classes the store holds


RANK_SCRIPT = """
import json, os, sys
from ultralytics.cfg import get_cfg
from ultralytics.data import utils as data_utils

data_utils.check_font = lambda *a, **k: None
import gpucache.ultralytics as gu

info = data_utils.check_det_dataset(sys.argv[1])
cfg = get_cfg(overrides={"imgsz": 160, "cache": "ram", "plots": False})
ds = gu.build_yolo_dataset(cfg, info["train"], 4, info, cache_dir=sys.argv[2])
path = ds.gpucache_pixels.pixels.path
im, hw0, hw = ds.load_image(0)
out = {"tier": ds.gpucache_tier, "pixels": str(path), "store": str(ds.gpucache_store.path),
       "ino": os.stat(path).st_ino, "shape": list(im.shape)}
rank = os.environ["RANK"]
open(os.path.join(sys.argv[3], f"rank{rank}.json"), "w").write(json.dumps(out))
"""


def test_two_ranks_of_a_node_map_one_store_and_one_tier_file(yolo, data, tmp_path):
    """Under torchrun (CPU, no process group needed) both ranks read the decoded tier from the
    same file, built once in the node cache folder."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    node, out = tmp_path / "node", tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "YOLO_CONFIG_DIR": str(yolo[1] / "config"), "YOLO_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1])])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    run = subprocess.run(
        [*cmd, str(script), str(data), str(node), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["tier"] == "decoded" for r in ranks)
    assert ranks[0]["pixels"] == ranks[1]["pixels"] and ranks[0]["ino"] == ranks[1]["ino"]
    assert ranks[0]["store"] == ranks[1]["store"] and ranks[0]["shape"] == ranks[1]["shape"]
    assert len(list(node.glob("*.pixels"))) == 1 and len(list(node.glob("*.gpucache"))) == 1


def test_another_imgsz_is_another_tier_file_and_undecodable_images_read_the_file(
    yolo, data, tmp_path
):
    from ultralytics.data.utils import check_det_dataset

    import gpucache
    import gpucache.ultralytics as gu

    info = check_det_dataset(str(data))
    node = str(tmp_path / "node")
    sets = [
        gu.build_yolo_dataset(
            _cfg(yolo, tmp_path, cache="ram", imgsz=s), info["train"], 4, info, cache_dir=node
        )
        for s in (96, 128)
    ]
    assert len(list((tmp_path / "node").glob("*.pixels"))) == 2
    assert [max(ds.load_image(0)[2]) for ds in sets] == [96, 128]
    ds = sets[0]

    def broken(j):
        raise gpucache.SampleError(f"sample {j} does not decode")

    ds.gpucache_pixels.load = broken  # as a store whose bytes fail: Ultralytics' own read
    im, hw0, hw = ds.load_image(1)
    assert im.shape[:2] == hw and max(hw) == 96 and hw0 == (220, 150)
