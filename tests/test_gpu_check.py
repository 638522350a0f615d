"""benchmarks/gpu_check.py end to end in its CPU emulation mode (EmulatedCuda: the CUDA code paths
on two emulated GPUs, with the device given un-indexed and indexed), on a folder with a corrupt
sample (skipped) and an EXIF-rotated one (kept)."""

import json

import numpy as np
import pytest
import torch

from gpucache.decode import dali_available
from gpucache.decode._core import Decoded

from gpucache.testing import make_jpeg_bytes, make_jpeg_folder

gpu_check = pytest.importorskip("benchmarks.gpu_check")

FAST = ["--emulate", "--batch", "8", "--iterations", "3", "--epochs", "1", "--overlap-runs", "1",
        "--correctness-batches", "2", "--memory-epochs", "3", "--budget-s", "30"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = make_jpeg_folder(tmp_path_factory.mktemp("check"), 12, classes=("a", "b"), seed=3)
    good = make_jpeg_bytes(64, 48, seed=1)
    corrupt = good[:300] + b"\x00" * (len(good) - 302) + b"\xff\xd9"  # scan data garbled
    (root / "a" / "a_00001x.jpg").write_bytes(corrupt)
    return root


@pytest.mark.parametrize("device, backend_device", [("cuda", "cuda:0"), ("cuda:1", "cuda:1")])
def test_emulated_run_writes_every_part(folder, tmp_path, device, backend_device):
    out = tmp_path / "check.json"
    full = device == "cuda"  # the indexed run checks the device handling only, to stay fast
    args = ["--backends", "nvjpeg,dali"] if full else ["--backends", "nvjpeg",
                                                       "--skip", "throughput,overlap"]
    assert gpu_check.main(FAST + ["--folder", str(folder), "--json", str(out), "--device", device,
                                  *args]) == 0
    r = json.loads(out.read_text())
    assert r["ok"] and r["emulated"] and r["errors"] == {} and r["finished"]
    parts = r["parts"]
    env = parts["env"]
    assert env["decoder"] == "torchvision" and env["decoder_applies_exif"] is False
    assert env["backend_device"] == backend_device and env["current_device"] == 0
    assert parts["env"]["rotated"] >= 1
    for label in ("val", "train"):  # a skipped sample shifts nothing: plans as drawn
        c = parts["nvjpeg vs cpu"][label]  # float resize on the device: <= 1 level from the CPU's
        assert c["samples"] >= 5 and c["mean_abs_diff_max"] <= 1.0 and c["lost_vs_cpu"] == []
        assert c["off_device"] == [] and c["kept_not_cpu"] == []
    ordering = parts["nvjpeg ordering"]
    assert ordering["mismatches"] == 0 and ordering["iterations"] and ordering["busy_side_stream"]
    if full:
        assert {"gpucache nvjpeg threaded", "gpucache nvjpeg sync",
                "torchvision per-image decode"} <= set(parts["throughput"]["img_s"])
        assert set(parts["overlap"]["median_s"]) == {"decode", "train", "sync", "threaded"}
        if dali_available():  # DALI runs its CPU mode under the emulation
            assert parts["dali vs cpu"]["ok"] and "skipped" in parts["dali memory"]
    mem = parts["nvjpeg memory"]
    assert mem["ok"] and len(mem["allocated_mib"]) == len(mem["reserved_mib"]) >= 3
    assert mem["reserved_growth_mib"] is not None


def test_json_is_written_before_anything_can_crash(tmp_path):
    out = tmp_path / "check.json"
    with pytest.raises(FileNotFoundError):
        gpu_check.main(FAST + ["--folder", str(tmp_path / "missing"), "--json", str(out)])
    r = json.loads(out.read_text())
    assert r["finished"] and not r["ok"] and "missing" in r["errors"]["start"]


def test_compare_counts_samples_kept_that_the_cpu_refused():
    img = torch.zeros((3, 3, 4, 4), dtype=torch.uint8)
    ref = Decoded(img[:2], np.array([10, 11]), [(12, "corrupt")])  # the CPU refused 12
    got = Decoded(img[[0, 2]] + 2, np.array([10, 12]), [(11, "lost")])  # kept 12, lost 11
    r = gpu_check.compare(ref, got)
    assert r["lost_vs_cpu"] == [11] and r["kept_not_cpu"] == [12]
    assert r["mean_abs_diff"] == [2.0] and r["max_abs_diff"] == 2.0


def test_memory_growth_checks_reserved_as_well():
    flat = [10.0, 12.0, 12.0, 12.0]
    assert gpu_check.memory_growth(flat, flat)["ok"]
    assert not gpu_check.memory_growth(flat, [10.0, 100.0, 100.0, 300.0])["ok"]
    assert not gpu_check.memory_growth(flat[:2], flat[:2])["ok"]


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
