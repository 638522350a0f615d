"""benchmarks/gpu_check.py end to end in its CPU emulation mode (EmulatedCuda: the CUDA code paths
on two emulated GPUs, with the device given un-indexed and indexed), on a folder with a corrupt
sample (skipped) and an EXIF-rotated one (kept); a GPU decoder that fails is a failed run, however
well the CPU retry covers for it; what it leaves in its output folder (whole tracebacks, the
machine, a hung part's stacks); a folder of photos for the data parts; and the one-call device
command in docs/guides/backends.md."""

import functools
import json
import re
import sys
import threading
import time
import types
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks import gpu_check
from gpucache.decode import dali_available
from gpucache.decode._outcome import Decoded
from gpucache.decode.gpu._batched import make_decoder
from gpucache.decode.gpu._nvjpeg import NvjpegBackend
from gpucache.testing import make_jpeg_bytes, make_jpeg_folder
from tests.support.emulated_cuda import EmulatedCuda

FAST = [
    "--emulate",
    "--batch",
    "8",
    "--iterations",
    "3",
    "--epochs",
    "1",
    "--overlap-runs",
    "1",
    "--correctness-batches",
    "2",
    "--memory-epochs",
    "3",
    "--budget-s",
    "30",
    "--masked",
    "8",
    "--mask-batch",
    "4",
]
ROOT = Path(__file__).resolve().parents[1]
NVJPEG_PARTS = [
    "env",
    "nvjpeg vs cpu",
    "nvjpeg ordering",
    "transforms",
    "throughput",
    "overlap",
    "nvjpeg memory",
    "nvjpeg shapes",
    "nvjpeg fill",
    "nvjpeg syncs",
    "decoders",
]


def only(*names: str) -> list[str]:
    """The arguments that run the nvjpeg backend's ``names`` parts alone."""
    return ["--backends", "nvjpeg", "--skip", ",".join(p for p in NVJPEG_PARTS if p not in names)]


ONLY_ENV = only("env")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = make_jpeg_folder(tmp_path_factory.mktemp("check"), 12, classes=("a", "b"), seed=3)
    good = make_jpeg_bytes(64, 48, seed=1)
    corrupt = good[:300] + b"\x00" * (len(good) - 302) + b"\xff\xd9"  # scan data garbled
    (root / "a" / "a_00001x.jpg").write_bytes(corrupt)
    return root


def _recording_devices(monkeypatch) -> list[str]:
    """The device of every CUDA call of torchvision's decode_jpeg under gpu_check's emulation,
    recorded as the calls come."""
    import torchvision.io

    seen: list[str] = []

    class Recording(EmulatedCuda):
        def __enter__(self):
            out = super().__enter__()
            self.inner = inner = torchvision.io.decode_jpeg

            def decode_jpeg(input, *args, **kwargs):
                device = torch.device(kwargs.get("device", "cpu"))
                if device.type == "cuda":
                    seen.append(str(device))
                return inner(input, *args, **kwargs)

            torchvision.io.decode_jpeg = decode_jpeg
            return out

        def __exit__(self, *exc):
            torchvision.io.decode_jpeg = self.inner
            return super().__exit__(*exc)

    monkeypatch.setattr(gpu_check, "EmulatedCuda", Recording)
    return seen


@pytest.mark.parametrize("device, backend_device", [("cuda", "cuda:0"), ("cuda:1", "cuda:1")])
def test_emulated_run_writes_every_part(folder, tmp_path, monkeypatch, device, backend_device):
    """Every part, and every decoder call of them on one indexed device: torchvision keeps one
    CUDA decoder and makes a new one, leaking the old, whenever the device it is given differs
    from the last, so gpucache and gpu_check always pass cuda:N."""
    seen = _recording_devices(monkeypatch)
    out = tmp_path / "check.json"
    full = device == "cuda"  # the indexed run checks the device handling only, to stay fast
    args = (
        ["--backends", "nvjpeg,dali"]
        if full
        else only("env", "nvjpeg vs cpu", "nvjpeg ordering", "nvjpeg memory", "nvjpeg syncs")
    )
    assert (
        gpu_check.main(
            FAST + ["--folder", str(folder), "--json", str(out), "--device", device, *args]
        )
        == 0
    )
    r = json.loads(out.read_text())
    assert r["ok"] and r["emulated"] and r["errors"] == {} and r["finished"]
    parts = r["parts"]
    env = parts["env"]
    assert env["decoder"] == "torchvision" and env["decoder_applies_exif"] is False
    assert env["backend_device"] == backend_device and env["current_device"] == 0
    assert parts["env"]["rotated"] >= 1
    probe = env["probes"]["torchvision"]
    assert probe["ok"] and probe["device"] == probe["asked"] == backend_device
    for label in ("val", "train"):  # a skipped sample shifts nothing: plans as drawn
        c = parts["nvjpeg vs cpu"][label]  # float resize on the device: <= 1 level from the CPU's
        assert c["samples"] >= 5 and c["mean_abs_diff_max"] <= 1.0 and c["lost_vs_cpu"] == []
        assert c["off_device"] == [] and c["kept_not_cpu"] == []
        assert c["gpu_ok"] and 0 < c["gpu_allowed"] <= c["gpu_decoded"] <= c["samples"]
    ordering = parts["nvjpeg ordering"]
    assert ordering["mismatches"] == 0 and ordering["iterations"] and ordering["busy_side_stream"]
    if full:  # batched against per-image, TF32 off and on; autocast never reaches the pixels
        tr = parts["transforms"]
        assert tr["ok"] and tr["autocast_bf16_max_abs_diff"] == 0
        assert all(
            tr[k]["images"] >= 5 and tr[k]["max_abs_diff"] <= 1 for k in ("tf32_off", "tf32_on")
        )
        assert {
            "gpucache nvjpeg threaded",
            "gpucache nvjpeg sync",
            "torchvision per-image decode",
        } <= set(parts["throughput"]["img_s"])
        assert set(parts["overlap"]["median_s"]) == {"decode", "train", "sync", "threaded"}
        if dali_available():  # DALI runs its CPU mode under the emulation
            assert parts["dali vs cpu"]["ok"] and "skipped" in parts["dali memory"]
            assert parts["dali shapes"]["ok"] and parts["dali fill"]["ok"]
            assert parts["dali syncs"]["ok"]
        for size in ("224x160", "160x224", "224x224"):  # flipped, with masks, both paths
            shape = parts["nvjpeg shapes"][size]
            assert shape["ok"] and shape["samples"] >= 8 and shape["iou_mean"] >= 0.9
            assert shape["batched_vs_per_image_mask_values_differing"] == 0
        fill = parts["nvjpeg fill"]
        assert fill["ok"] and all(fill[k]["padded_pixels"] > 0 for k in ("224x160", "160x224"))
        syncs = parts["nvjpeg syncs"]["host_syncs_per_batch"]
        assert parts["nvjpeg syncs"]["ok"] and "MainThread" not in syncs
        assert "gpucache-nvjpeg-transform" not in syncs
        dec = parts["decoders"]
        assert dec["ok"] and {"torchvision x1", "torchvision x2", "torchvision x4"} <= set(
            dec["img_s"]
        )
        assert [dec["calls_at_once"][f"torchvision x{k}"] for k in (1, 2, 4)] == [1, 1, 1]
    mem = parts["nvjpeg memory"]
    assert mem["ok"] and len(mem["allocated_mib"]) == len(mem["reserved_mib"]) >= 3
    assert mem["reserved_growth_mib"] is not None
    assert seen and set(seen) == {backend_device}, sorted(set(seen))


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


def test_memory_growth_sees_what_torch_does_not_allocate():
    """nvJPEG's and DALI's own device buffers are outside torch's caching allocator: a leak
    there shows only in the device's used memory (mem_get_info), which the check reads too."""
    flat = [10.0, 20.0, 20.0, 20.0]
    assert gpu_check.memory_growth(flat, flat, [500.0, 600.0, 600.0, 610.0])["ok"]
    leak = gpu_check.memory_growth(flat, flat, [500.0, 600.0, 600.0, 800.0])
    assert not leak["ok"] and leak["used_growth_mib"] == 200.0


def test_the_memory_part_sees_a_decoder_that_leaks_outside_torch(folder, tmp_path, monkeypatch):
    """A decoder that keeps device memory of its own every call (nvJPEG's buffers are not
    torch's) leaves torch's allocated and reserved memory flat: the memory part reads the
    device's used memory each epoch and fails on it."""
    leaking = functools.partial(EmulatedCuda, decoder_leak=48 * 2**20)
    monkeypatch.setattr(gpu_check, "EmulatedCuda", leaking)
    out = tmp_path / "check.json"
    args = ["--memory-epochs", "4", *only("env", "nvjpeg memory")]
    code = gpu_check.main(FAST + args + ["--folder", str(folder), "--json", str(out)])
    mem = json.loads(out.read_text())["parts"]["nvjpeg memory"]
    assert code == 1 and not mem["ok"], mem
    assert mem["growth_mib"] <= 16 and mem["reserved_growth_mib"] <= 64  # torch's: flat
    assert mem["used_growth_mib"] >= 2 * 48 and len(mem["device_used_mib"]) == 4


def test_a_failing_part_is_recorded_whole_and_the_rest_still_run(folder, tmp_path, monkeypatch):
    """Its whole traceback, causes and all (not the last 3,000 characters), in the JSON, in the
    output folder's errors file and in the log."""
    long = "x" * 5000

    def boom(c):
        try:
            raise ValueError("the root cause")
        except ValueError as err:
            raise RuntimeError(f"emulated crash in throughput {long}") from err

    monkeypatch.setattr(gpu_check, "throughput", boom)
    out = tmp_path / "check.json"
    args = FAST + ["--folder", str(folder), "--json", str(out)]
    args += only("env", "throughput", "nvjpeg memory")
    assert gpu_check.main(args) == 1
    r = json.loads(out.read_text())
    error = r["errors"]["throughput"]
    assert not r["ok"] and "the root cause" in error and f"throughput {long}" in error
    assert error in (tmp_path / "gpu_check_errors.txt").read_text()
    assert {"env", "nvjpeg memory"} <= set(r["parts"])


def test_a_hung_part_leaves_every_threads_stack(folder, tmp_path, monkeypatch):
    """A part still running past its share (and a grace) dumps every thread's stack into the
    output folder, and runs on; the machine is recorded there too."""
    from benchmarks import gpu_check_out

    monkeypatch.setattr(gpu_check_out, "HANG_GRACE_S", 0.1)
    stacks = tmp_path / "out" / "gpu_check_stacks.txt"
    seen = threading.Event()

    def stuck_in_overlap(c):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "stuck_in_overlap" not in stacks.read_text():
            seen.wait(0.05)  # polled with a deadline: the dump comes from faulthandler's thread
        return {"ok": True}

    monkeypatch.setattr(gpu_check, "overlap", stuck_in_overlap)
    args = ["--emulate", "--budget-s", "1", "--folder", str(folder), *only("env", "overlap")]
    assert gpu_check.main(args + ["--out", str(tmp_path / "out")]) == 0
    text = stacks.read_text()
    assert "===== overlap" in text and "in stuck_in_overlap" in text
    r = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert r["system"]["torch"] == torch.__version__ and "torch_cuda" in r["system"]
    system = (tmp_path / "out" / "gpu_check_system.txt").read_text()
    assert "===== nvidia-smi -q" in system and "===== torch.__config__.show()" in system


def test_a_folder_of_photos_feeds_the_data_parts(folder, tmp_path):
    """PHOTOS (a flat folder here; at most --max-photos of it, drawn at random) is what the
    transforms, throughput and memory parts run on; correctness stays on the other store."""
    photos = tmp_path / "photos"
    photos.mkdir()
    for k in range(8):
        (photos / f"p{k}.jpg").write_bytes(make_jpeg_bytes(48 + 8 * k, 40, seed=k))
    out = tmp_path / "out"
    args = FAST + ["--folder", str(folder), "--out", str(out), "--max-photos", "5", str(photos)]
    args += only("env", "nvjpeg vs cpu", "transforms", "throughput", "nvjpeg memory")
    assert gpu_check.main(args) == 0
    r = json.loads((out / "gpu_check.json").read_text())
    assert r["photos"] == str(photos) and r["photos_in_store"] == 5
    parts = r["parts"]
    assert parts["throughput"]["photos"] == parts["nvjpeg memory"]["photos"] == 5
    assert parts["transforms"]["tf32_off"]["images"] == 5
    assert parts["nvjpeg vs cpu"]["val"]["samples"] >= 5 and parts["env"]["images"] == 13


def test_env_reads_versions_from_the_installed_distributions(folder, tmp_path, monkeypatch):
    """A stand-in module in sys.modules (one a test left there, a package that failed to load)
    has no __version__: the versions come from the installed metadata."""
    for name in [m for m in sys.modules if m.startswith("torchcodec.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchcodec", types.ModuleType("torchcodec"))
    out = tmp_path / "check.json"
    gpu_check.main(FAST + ONLY_ENV + ["--folder", str(folder), "--json", str(out)])
    r = json.loads(out.read_text())
    assert "env" not in r["errors"], r["errors"].get("env")
    env = r["parts"]["env"]
    assert env["torch"] == metadata.version("torch")
    assert env["torchvision"] == metadata.version("torchvision")
    assert env["torchcodec"] == gpu_check.version("torchcodec")
    assert gpu_check.version("gpucache-no-such-distribution") is None


def _broken(data):
    raise RuntimeError("nvJPEG: the decoder failed to initialise (emulated)")


def test_a_gpu_decoder_that_always_fails_fails_the_run(folder, tmp_path, monkeypatch):
    """Every sample then goes to the backend's CPU retry, whose pixels match the CPU decode:
    the check counts the samples the GPU decoder took."""
    monkeypatch.setattr(
        gpu_check,
        "torchvision_decoder",
        lambda device: make_decoder("broken", device, _broken, applies_exif=False),
    )
    out = tmp_path / "check.json"
    args = only("env", "nvjpeg vs cpu")
    code = gpu_check.main(FAST + args + ["--folder", str(folder), "--json", str(out)])
    r = json.loads(out.read_text())
    part = r["parts"]["nvjpeg vs cpu"]
    assert not part["ok"]
    for label in ("val", "train"):
        c = part[label]
        assert c["gpu_decoded"] == 0 and c["gpu_allowed"] >= 5 and not c["gpu_ok"]
        assert c["mean_abs_diff_max"] <= 1.0 and c["lost_vs_cpu"] == []  # the pixels alone pass
    assert code == 1 and not r["ok"] and r["errors"] == {}
    env = r["parts"]["env"]
    assert not env["ok"] and "failed to initialise" in env["decoder_error"]  # its EXIF probe
    assert env["probes"]["torchvision"]["ok"]  # torchvision's own decoder works here


def test_an_nvjpeg_that_does_not_work_fails_the_env_probe(folder, tmp_path, monkeypatch):
    """torchvision's batched CUDA decode called directly, as a training script would: its error
    is recorded and fails the run."""
    import torchvision.io

    real = torchvision.io.decode_jpeg

    def no_cuda_decoder(input, *args, **kwargs):
        if isinstance(input, list):  # the batched (nvJPEG) path; single CPU decodes still work
            raise RuntimeError("nvjpegCreateSimple failed: NVJPEG_STATUS_NOT_INITIALIZED")
        return real(input, *args, **kwargs)

    monkeypatch.setattr(torchvision.io, "decode_jpeg", no_cuda_decoder)
    out = tmp_path / "check.json"
    assert gpu_check.main(FAST + ONLY_ENV + ["--folder", str(folder), "--json", str(out)]) == 1
    r = json.loads(out.read_text())
    probe = r["parts"]["env"]["probes"]["torchvision"]
    assert not r["ok"] and not r["parts"]["env"]["ok"]
    assert not probe["ok"] and "NVJPEG_STATUS_NOT_INITIALIZED" in probe["error"]
    assert probe["asked"] == "cuda:0"


def _device_command() -> str:
    text = (ROOT / "docs" / "guides" / "backends.md").read_text()
    blocks = [b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "gpu_check.py" in b]
    assert len(blocks) == 1, blocks
    return blocks[0]


def test_documented_device_command_diagnoses_on_the_first_try():
    """The one-call command in docs/guides/backends.md: ``python3`` (the device machine's
    interpreter with torch), the machine printed first (gpu_env.py), stacks on a crash or a
    hang (``-X faulthandler``, ``timeout -s ABRT``, unbuffered output), every failing GPU test
    run (no ``-x``), everything under $OUT (what comes back from the device machine), and at
    most 300 s in all (every timeout and its kill delay added), so that a 15-minute device
    budget, machine start included, leaves time to run it again."""
    cmd = " ".join(_device_command().replace("\\\n", " ").split())
    runs = re.findall(r"timeout -s ABRT -k (\d+) (\d+) python3 -X faulthandler ", cmd)
    assert len(runs) == 2, runs
    every = re.findall(r"(?<![-\w])timeout (?:-s \w+ )?(?:-k (\d+) )?(\d+) ", cmd)
    assert len(every) == 4 and sum(int(k or 0) + int(t) for k, t in every) <= 300, every
    assert not re.search(r"\bpython\b", cmd) and "PYTHONUNBUFFERED=1" in cmd
    budget = float(re.search(r"--budget-s (\d+)", cmd).group(1))
    assert budget <= int(runs[0][1]) - 30
    assert '--out "$OUT"' in cmd and 'tee "$OUT/gpu_check.log"' in cmd
    assert cmd.index("gpu_env.py") < cmd.index("gpu_check.py")  # the machine first
    assert cmd.startswith("set -o pipefail;") and "pytest_timeout" in cmd
    tests = cmd.split("-m pytest", 1)[1]
    assert "tests/gpu" in tests and 'tee "$OUT/' in tests and not re.search(r" -x\b", tests)


FAKE_PYTHON = """#!/bin/sh
# stands in for the device machine's python3: each step of the command says what it is
case "$*" in
  *gpu_env.py*) echo "torch.cuda.is_available(): True"; echo "gpucache imported: False" ;;
  *"import pytest_timeout"*) exit 0 ;;
  *gpu_check.py*) echo "gpu_check: ${CHECK_SAYS}"; exit "${CHECK_EXIT}" ;;
  *"-m pytest"*) echo "pytest tests/gpu: ${TESTS_EXIT}"; exit "${TESTS_EXIT}" ;;
esac
"""


@pytest.mark.parametrize(
    "check, tests, want",
    [(0, 0, 0), (1, 0, 1), (0, 1, 1), (134, 0, 134)],
    ids=["both-pass", "check-fails", "gpu-tests-fail", "check-aborted"],
)
def test_the_device_command_returns_the_checks_status_not_tees(tmp_path, check, tests, want):
    """Run as written, with a stand-in python3: piped into ``tee``, a failing check would still
    have ended the command with 0; with ``pipefail`` the command ends with the check's status
    (a timeout's SIGABRT, 134, included), else the GPU tests', and each step's output is in its
    log under $OUT, the machine's printed first."""
    import os
    import subprocess

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "OUT": str(out),
        "CHECK_EXIT": str(check),
        "CHECK_SAYS": "FAIL" if check else "PASS",
        "TESTS_EXIT": str(tests),
    }
    env.pop("PHOTOS", None)
    p = subprocess.run(
        ["bash", "-c", _device_command()],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert p.returncode == want, (p.returncode, p.stdout, p.stderr)
    assert p.stdout.index("is_available") < p.stdout.index("gpu_check:")
    assert "gpucache imported: False" in (out / "gpu_env.log").read_text()
    assert "gpu_check:" in (out / "gpu_check.log").read_text()
    assert "pytest tests/gpu" in (out / "pytest_gpu.log").read_text()


def test_gpu_env_prints_the_machine_before_gpucache_is_imported():
    """The command's first step, run for real: nvidia-smi (or why not), the versions and
    torch.cuda.is_available() on stdout, with no gpucache import, and exit 0."""
    import subprocess

    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_env.py")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert p.returncode == 0, p.stderr
    text = p.stdout
    assert text.index("===== nvidia-smi") < text.index("===== versions")
    for line in (
        f"torch: torch=={metadata.version('torch')}",
        f"torchvision: torchvision=={metadata.version('torchvision')}",
        "torch.cuda.is_available(): False",  # no GPU here (the emulation is in-process only)
        "gpucache imported: False",
    ):
        assert line in text, text
    assert re.search(r"^torchcodec: ", text, re.M) and re.search(r"^dali: ", text, re.M)
    assert re.search(r"^pytest-timeout: pytest-timeout==", text, re.M)  # the test extra's


def test_the_shapes_part_fails_on_a_flip_mirrored_over_the_longer_side(
    folder, tmp_path, monkeypatch
):
    """The batched resample's flip as it once was (mirrored over max(H, W)): on the output taller
    than wide the images' columns shift and their masks do not, so the part fails there (the
    difference from the cpu decode and from the per-image path, and the alignment IoU); the
    other two shapes pass."""
    from gpucache.transforms import _resample

    real = _resample._taps_host

    def longer_side(length, resized, start2, out, flip, span):
        return real(length, resized, start2, out, flip, out)

    monkeypatch.setattr(_resample, "_taps_host", longer_side)
    out = tmp_path / "check.json"
    code = gpu_check.main(
        FAST + only("nvjpeg shapes") + ["--folder", str(folder), "--json", str(out)]
    )
    shapes = json.loads(out.read_text())["parts"]["nvjpeg shapes"]
    assert code == 1 and not shapes["ok"]
    tall = shapes["224x160"]
    assert not tall["ok"] and tall["mean_abs_diff_max"] > 3 and tall["iou_gap_max"] > 0.05
    assert tall["batched_vs_per_image_max_abs_diff"] > 1
    assert shapes["160x224"]["ok"] and shapes["224x224"]["ok"]


def test_the_fill_and_syncs_parts_fail_on_what_they_guard(folder, tmp_path, monkeypatch):
    """Padding left at zero fails the fill part; a host sync a batch on the loader's thread (a
    value read from the device, as the mask gather once did) fails the syncs part."""
    from gpucache.decode.gpu import _decoded_plans

    monkeypatch.setattr(_decoded_plans, "fill_padding", lambda images, plans, fill: images)
    real_get = NvjpegBackend.get

    def get_and_read(self):
        out = real_get(self)
        int(out.images.flatten()[0])  # a device read on the loader's thread
        return out

    monkeypatch.setattr(NvjpegBackend, "get", get_and_read)
    out = tmp_path / "check.json"
    args = (
        FAST + only("nvjpeg fill", "nvjpeg syncs") + ["--folder", str(folder), "--json", str(out)]
    )
    assert gpu_check.main(args) == 1
    r = json.loads(out.read_text())["parts"]
    fill = r["nvjpeg fill"]["224x160"]
    assert not fill["ok"] and fill["fill_pixels_wrong"] > 0 and fill["mask_fill_wrong"] == 0
    syncs = r["nvjpeg syncs"]
    assert not syncs["ok"] and syncs["host_syncs_per_batch"]["MainThread"] >= 1


def test_the_decoders_part_records_a_decoder_that_fails_and_measures_the_rest(
    folder, tmp_path, monkeypatch
):
    """A decoder of its own (nvImageCodec, DALI) that fails is recorded, not a failed check;
    torchvision's calls never overlap (its mutex), at every concurrency."""
    from benchmarks import gpu_check_decoders

    real = gpu_check_decoders.available_decoders

    def with_a_broken_one(c):
        makers = real(c)

        def broken():
            def decode(data):
                raise RuntimeError("nvimgcodec: no hardware decoder (emulated)")

            return decode

        makers["nvimgcodec"] = broken
        return makers

    monkeypatch.setattr(gpu_check_decoders, "available_decoders", with_a_broken_one)
    out = tmp_path / "check.json"
    assert (
        gpu_check.main(FAST + only("decoders") + ["--folder", str(folder), "--json", str(out)]) == 0
    )
    dec = json.loads(out.read_text())["parts"]["decoders"]
    assert dec["ok"] and "no hardware decoder" in dec["errors"]["nvimgcodec x1"]
    assert dec["fastest"] in dec["img_s"] and dec["photos"] >= 5
    assert all(dec["calls_at_once"][f"torchvision x{k}"] == 1 for k in (1, 2, 4))
