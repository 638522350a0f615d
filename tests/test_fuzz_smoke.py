"""A few seconds of the fuzz harness (benchmarks/fuzz/run.py) under AddressSanitizer + UBSan.

The long run is ``python benchmarks/fuzz/run.py --minutes 30`` (docs/development.md). Skipped when
gcc, its ASan runtime or libjpeg's headers are missing.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

RUN = Path(__file__).resolve().parents[1] / "benchmarks" / "fuzz" / "run.py"


def _asan_ready() -> bool:
    if shutil.which("gcc") is None or not Path("/usr/include/jpeglib.h").exists():
        return False
    out = subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True)
    return Path(out.stdout.strip()).is_absolute() and Path(out.stdout.strip()).exists()


@pytest.mark.skipif(not _asan_ready(), reason="no gcc ASan runtime or libjpeg headers here")
def test_fuzz_smoke_run_finds_nothing(tmp_path):
    from gpucache.testing import make_jpeg_folder

    photos = make_jpeg_folder(tmp_path / "photos", 26, seed=3)  # photo seeds of its own
    r = subprocess.run(
        [
            sys.executable,
            str(RUN),
            "--seconds",
            "4",
            "--out",
            str(tmp_path / "out"),
            "--photos",
            str(photos),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert r.returncode == 0, (summary["crashes"], summary["mismatches"], r.stderr[-3000:])
    assert summary["iterations"] > 20 and summary["calls"] > 100  # it really ran the targets
