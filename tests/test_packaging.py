"""What users install: the wheel holds the library only (the CUDA emulation, hostile files and
listing counts are the tests' own, in tests/support/), and ``import gpucache`` stays light."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: Module names that are test support; none may be in the wheel.
TEST_ONLY = (
    "emulated_cuda",
    "emulated_order",
    "emulated_nvjpeg",
    "_emulated_",
    "hostile",
    "_audit",
)


def test_import_gpucache_leaves_testing_and_image_draw_out():
    code = (
        "import sys, gpucache; "
        "print(sorted(m for m in ('gpucache.testing', 'PIL.ImageDraw') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"
    code = "import gpucache; print(gpucache.testing.make_jpeg_bytes.__module__)"  # on first use
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "gpucache.testing"


@pytest.mark.timeout(600)
def test_the_wheel_holds_no_test_only_module(tmp_path):
    src = tmp_path / "src"  # a clean copy: no build/ folder of an earlier build leaks into it
    shutil.copytree(
        REPO / "gpucache",
        src / "gpucache",
        ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"),
    )
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    out = tmp_path / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(out),
            str(src),
        ],
        check=True,
        cwd=tmp_path,
    )
    (wheel,) = out.glob("gpucache-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    modules = [n for n in names if n.startswith("gpucache/") and n.endswith(".py")]
    assert "gpucache/__init__.py" in modules and "gpucache/testing/__init__.py" in modules
    leaked = [n for n in names if any(t in Path(n).name for t in TEST_ONLY)]
    assert not leaked, leaked
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "pipelines/"))]
