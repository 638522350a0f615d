"""benchmarks/gpu_check.py end to end in its CPU emulation mode (EmulatedCuda: the CUDA code paths
on two emulated GPUs, with the device given un-indexed and indexed), on a folder with a corrupt
sample (skipped) and an EXIF-rotated one (kept); a GPU decoder that fails is a failed run, however
well the CPU retry covers for it; and the one-call device command in docs/guides/backends.md."""

import functools
import json
import re
import sys
import types
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks import gpu_check
from gpucache.decode import dali_available
from gpucache.decode._batched import make_decoder
from gpucache.decode._core import Decoded
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
]
ROOT = Path(__file__).resolve().parents[1]
ONLY_ENV = [
    "--backends",
    "nvjpeg",
    "--skip",
    "nvjpeg vs cpu,nvjpeg ordering,throughput,overlap,nvjpeg memory",
]


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
    args = (
        ["--backends", "nvjpeg,dali"]
        if full
        else ["--backends", "nvjpeg", "--skip", "throughput,overlap"]
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
    if full:
        assert {
            "gpucache nvjpeg threaded",
            "gpucache nvjpeg sync",
            "torchvision per-image decode",
        } <= set(parts["throughput"]["img_s"])
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
    args = ["--backends", "nvjpeg", "--skip", "nvjpeg vs cpu,nvjpeg ordering,throughput,overlap"]
    args += ["--memory-epochs", "4"]
    code = gpu_check.main(FAST + args + ["--folder", str(folder), "--json", str(out)])
    mem = json.loads(out.read_text())["parts"]["nvjpeg memory"]
    assert code == 1 and not mem["ok"], mem
    assert mem["growth_mib"] <= 16 and mem["reserved_growth_mib"] <= 64  # torch's: flat
    assert mem["used_growth_mib"] >= 2 * 48 and len(mem["device_used_mib"]) == 4


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
    args = ["--backends", "nvjpeg", "--skip", "nvjpeg ordering,throughput,overlap,nvjpeg memory"]
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


def test_every_decoder_call_gets_one_indexed_device(folder, tmp_path, monkeypatch):
    """torchvision keeps one CUDA decoder and makes a new one, leaking the old, whenever the
    device it is given differs from the last: gpucache and gpu_check always pass cuda:N."""
    import torchvision.io

    seen = []

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
    out = tmp_path / "check.json"
    args = [
        "--backends",
        "nvjpeg",
        "--skip",
        "nvjpeg ordering,overlap,nvjpeg memory",
        "--device",
        "cuda",
    ]
    assert gpu_check.main(FAST + args + ["--folder", str(folder), "--json", str(out)]) == 0
    assert (
        "torchvision per-image decode"
        in json.loads(out.read_text())["parts"]["throughput"]["img_s"]
    )
    assert seen and set(seen) == {"cuda:0"}, sorted(set(seen))


def test_documented_device_command_brings_its_results_back():
    """The one-call command in docs/guides/backends.md: JSON and full log under $OUT (what comes
    back from the device machine), and its two timeouts at most 420 s together, so that a
    15-minute device budget, machine start included, leaves time to run it again."""
    text = (ROOT / "docs" / "guides" / "backends.md").read_text()
    blocks = [b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "gpu_check.py" in b]
    assert len(blocks) == 1, blocks
    cmd = " ".join(blocks[0].replace("\\\n", " ").split())
    timeouts = [int(t) for t in re.findall(r"\btimeout (\d+)\b", cmd)]
    assert len(timeouts) == 2 and sum(timeouts) <= 420, timeouts
    budget = float(re.search(r"--budget-s (\d+)", cmd).group(1))
    assert budget <= timeouts[0] - 20
    assert '--json "$OUT/gpu_check.json"' in cmd and 'tee "$OUT/gpu_check.log"' in cmd
    assert "pytest" in cmd and "tests/gpu" in cmd and '"$OUT/' in cmd.split("pytest", 1)[1]
