"""benchmarks/peers: the checks every timed epoch passes, the data it makes, and one real run."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

PEERS = Path(__file__).resolve().parents[1] / "benchmarks" / "peers"
sys.path.insert(0, str(PEERS))

import data  # noqa: E402
import serve  # noqa: E402


class Batches:
    def __init__(self, batches):
        self.list = batches

    def batches(self):
        return iter(self.list)


def crops(n, layout="hwc"):
    shape = (n, 224, 224, 3) if layout == "hwc" else (n, 3, 224, 224)
    return np.zeros(shape, dtype=np.uint8)


def test_epoch_exactly_once_and_its_failures():
    ok = serve.run_epoch(Batches([(crops(2), [1, 0]), (crops(1, "chw"), [2])]), 3, 2)
    assert ok["exactly_once"] and ok["images"] == 3 and ok["batches"] == 2
    dup = serve.run_epoch(Batches([(crops(2), [0, 0]), (crops(1), [2])]), 3, 2)
    assert not dup["exactly_once"] and dup["missing"] == 1 and dup["repeated"] == 1
    with pytest.raises(ValueError, match="out of range"):
        serve.run_epoch(Batches([(crops(1), [3])]), 3, 2)


@pytest.mark.parametrize(
    "images",
    [
        np.zeros((2, 224, 224, 3), np.float32),
        np.zeros((2, 256, 256, 3), np.uint8),
        np.zeros((3, 224, 224, 3), np.uint8),
    ],
)
def test_batch_check_rejects_what_is_not_two_uint8_crops(images):
    with pytest.raises(ValueError, match="expected uint8"):
        serve.check(images, [0, 1], 4)


def photo(path: Path, size, seed=0):
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(small).resize(size, Image.BILINEAR).save(path, "JPEG", quality=90)


def test_data_keeps_only_jpegs_and_makes_2000x1500_mosaics(tmp_path):
    src = tmp_path / "src"
    for k, cls in enumerate(["ants", "bees", "bees"]):
        photo(src / cls / f"{k}.jpg", (64 + 8 * k, 48), seed=k)
    Image.new("RGB", (8, 8)).save(src / "ants" / "fake.jpg", "GIF")  # a GIF named .jpg
    (src / "ants" / "notes.txt").write_text("not an image")
    out = data.prepare(src, tmp_path / "work", mosaics=2, seed=1)
    assert sorted(p.name for p in out["photos"].rglob("*.jpg")) == [
        "00000.jpg",
        "00001.jpg",
        "00002.jpg",
    ]
    mosaics = sorted(out["mosaics"].rglob("*.jpg"))
    assert len(mosaics) == 2
    for m in mosaics:
        with Image.open(m) as im:
            assert im.format == "JPEG" and im.size == (2000, 1500)


def test_data_reencodes_the_photos_with_the_chroma_and_quality_asked(tmp_path):
    from PIL import JpegImagePlugin

    src = tmp_path / "src"
    for k, cls in enumerate(["ants", "bees"]):
        photo(src / cls / f"{k}.jpg", (64, 48), seed=k)
    Image.new("L", (40, 30), 90).save(src / "ants" / "gray.jpg", "JPEG")
    out = data.prepare(
        src, tmp_path / "work", mosaics=0, repeat=2, reencode=data._kinds("444:95,420:70")
    )
    assert set(out) == {"photos", "photos-444q95", "photos-420q70"}
    assert out["photos-420q70"].name == "photos-420q70-x2"
    for kind, sampling in (("photos-444q95", 0), ("photos-420q70", 2)):
        linked = sorted(out[kind].glob("*/*.jpg"))
        assert len(linked) == 6 and all(p.is_symlink() for p in linked)
        for p in linked:
            with Image.open(p) as im:
                assert im.format == "JPEG"
                assert im.mode == "L" or JpegImagePlugin.get_sampling(im) == sampling
    with pytest.raises(Exception, match="SUBSAMPLING:QUALITY"):
        data._kinds("411:90")


@pytest.mark.slow
@pytest.mark.timeout(900)  # several interpreters start torch; minutes on a loaded machine
def test_run_pil_and_gpucache_end_to_end(tmp_path):
    src = tmp_path / "photos"
    for k in range(10):
        photo(src / ("ants" if k % 2 else "bees") / f"{k}.jpg", (320, 240), seed=k)
    out = tmp_path / "res" / "peers"
    subprocess.run(
        [
            sys.executable,
            str(PEERS / "run.py"),
            str(src),
            "--only",
            "pil,gpucache",
            "--rounds",
            "1",
            "--batch-size",
            "4",
            "--work",
            str(tmp_path / "w"),
            "--out",
            str(out),
        ],
        check=True,
        timeout=600,
    )
    report = json.loads(out.with_suffix(".json").read_text())
    for pipeline in ("train", "eval"):
        for name in ("pil", "gpucache"):
            res = report["pipelines"][pipeline][name]
            assert "error" not in res, res
            assert [e["exactly_once"] for e in res["warmup"] + res["epochs"]] == [True, True]
            assert res["epochs"][0]["images"] == 10
    assert (
        out.with_suffix(".png").stat().st_size > 0
        and "| `gpucache` |" in out.with_suffix(".md").read_text()
    )


@pytest.fixture(scope="module")
def empty_ffcv_venv(tmp_path_factory) -> Path:
    """A peer folder holding a venv named ``ffcv`` without FFCV in it (install.sh's layout)."""
    venvs = tmp_path_factory.mktemp("venvs")
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venvs / "ffcv")],
        check=True,
        timeout=120,
    )
    return venvs


def test_install_check_is_not_fooled_by_the_venv_folder_of_the_same_name(empty_ffcv_venv):
    venvs = empty_ffcv_venv
    # from inside the venvs folder, `import ffcv` finds the folder ffcv/ as a namespace package
    naive = subprocess.run([str(venvs / "ffcv/bin/python"), "-c", "import ffcv"], cwd=venvs)
    assert naive.returncode == 0
    func = subprocess.run(
        ["sed", "-n", "/^ok() {/,/^}/p", str(PEERS / "install.sh")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert func.startswith("ok() {")
    for module, expect in (("ffcv", 1), ("json", 0)):  # not installed; in the standard library
        r = subprocess.run(
            ["bash", "-c", f'{func}\nDIR="$1"; ok ffcv {module}', "_", str(venvs)], cwd=venvs
        )
        assert r.returncode == expect, module


def test_runner_refuses_a_peer_whose_environment_lacks_it(empty_ffcv_venv):
    import run
    from contenders import contenders

    ffcv = next(c for c in contenders(512, {"exact": True}) if c.name == "ffcv-jpg")
    why = run.missing_peer(ffcv, empty_ffcv_venv)
    assert why is not None and "lacks ffcv, numba" in why and "install.sh" in why
    dali = next(c for c in contenders(512, {"exact": True}) if c.name == "dali")
    assert "no environment at" in run.missing_peer(dali, empty_ffcv_venv)
    here = next(c for c in contenders(512, {"exact": True}) if c.name == "gpucache")
    assert run.missing_peer(here, empty_ffcv_venv) is None
