"""benchmarks/gpu_check.py end to end in its CPU emulation mode (CPU device, the same code the GPU
run executes), on a folder with a corrupt sample (skipped) and an EXIF-rotated one (kept)."""

import json

import pytest

from gpucache.testing import make_jpeg_bytes, make_jpeg_folder

gpu_check = pytest.importorskip("benchmarks.gpu_check")

FAST = ["--emulate", "--batch", "8", "--iterations", "3", "--epochs", "1", "--overlap-runs", "1",
        "--correctness-batches", "2", "--memory-epochs", "2", "--budget-s", "30"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = make_jpeg_folder(tmp_path_factory.mktemp("check"), 12, classes=("a", "b"), seed=3)
    good = make_jpeg_bytes(64, 48, seed=1)
    corrupt = good[:300] + b"\x00" * (len(good) - 302) + b"\xff\xd9"  # scan data garbled
    (root / "a" / "a_00001x.jpg").write_bytes(corrupt)
    return root


def test_emulated_run_writes_every_part(folder, tmp_path):
    out = tmp_path / "check.json"
    assert gpu_check.main(FAST + ["--folder", str(folder), "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["ok"] and r["emulated"] and r["errors"] == {}
    parts = r["parts"]
    assert parts["env"]["decoder"] == "torchvision" and not parts["env"]["decoder_applies_exif"]
    assert parts["env"]["rotated"] >= 1
    for label in ("val", "train"):  # a skipped sample shifts nothing: plans as drawn
        c = parts["nvjpeg vs cpu"][label]
        assert c["samples"] >= 5 and c["mean_abs_diff_max"] == 0.0 and c["lost_vs_cpu"] == []
    assert parts["nvjpeg ordering"]["mismatches"] == 0 and parts["nvjpeg ordering"]["iterations"]
    assert {"gpucache nvjpeg threaded", "gpucache nvjpeg sync",
            "torchvision per-image decode"} <= set(parts["throughput"]["img_s"])
    assert set(parts["overlap"]["median_s"]) == {"decode", "train", "sync", "threaded"}
    assert "skipped" in parts["nvjpeg memory"]


def test_a_failing_part_is_recorded_and_the_rest_still_run(folder, tmp_path, monkeypatch):
    def boom(c):
        raise RuntimeError("emulated crash in throughput")

    monkeypatch.setattr(gpu_check, "throughput", boom)
    out = tmp_path / "check.json"
    args = FAST + ["--backends", "nvjpeg", "--folder", str(folder), "--json", str(out)]
    assert gpu_check.main(args) == 1
    r = json.loads(out.read_text())
    assert not r["ok"] and "emulated crash in throughput" in r["errors"]["throughput"]
    ran = {"env", "nvjpeg vs cpu", "nvjpeg ordering", "overlap", "nvjpeg memory"}
    assert ran <= set(r["parts"])
