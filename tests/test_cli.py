"""The command line as a user meets it, run as a subprocess: the help pages, the build's notice
about skipped files, verify's libjpeg notes, and bench's plan before anything is timed."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from gpucache.testing import make_jpeg_folder, natural_image

ROOT = Path(__file__).resolve().parents[1]


def _gpucache(
    *args: str, cwd: Path, env: dict | None = None, merge: bool = False
) -> subprocess.CompletedProcess:
    full = {**os.environ, **(env or {})}
    full["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), full.get("PYTHONPATH")) if p)
    main = "import sys; from gpucache.cli import main; sys.exit(main())"  # the `gpucache` script
    return subprocess.run(
        [sys.executable, "-c", main, *args],
        cwd=cwd,
        env=full,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge else subprocess.PIPE,
        timeout=300,
    )


def _damaged_jpeg(seed: int) -> bytes:
    """A JPEG whose scan has a stray restart marker: libjpeg decodes it anyway, with a warning."""
    buf = io.BytesIO()
    Image.fromarray(natural_image(96, 64, seed=seed)).save(buf, "JPEG", quality=90)
    b = bytearray(buf.getvalue())
    b[len(b) // 2 : len(b) // 2 + 2] = b"\xff\xd3"
    return bytes(b)


@pytest.fixture(scope="module")
def odd_folder(tmp_path_factory) -> Path:
    """An ImageFolder with one damaged (decodable) JPEG and one truncated file."""
    root = make_jpeg_folder(tmp_path_factory.mktemp("cli") / "imgs", 6, classes=("a", "b"), seed=4)
    (root / "a" / "damaged.jpg").write_bytes(_damaged_jpeg(1))
    (root / "b" / "truncated.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a whole JPEG")
    return root


def test_help_lists_every_command_in_plain_text(tmp_path):
    top = _gpucache("--help", cwd=tmp_path)
    assert top.returncode == 0, top.stderr
    assert "`" not in top.stdout  # no reStructuredText markup in a terminal
    for command in ("build", "info", "verify", "bench", "cache"):
        assert re.search(rf"^\s+{command}\s+\S", top.stdout, re.M), (command, top.stdout)
    build = _gpucache("build", "--help", cwd=tmp_path).stdout
    for option in ("--on-error", "--hf-split", "--hf-image-column", "--threads", "--output"):
        block = build[build.index(option) :].split("\n  -", 1)[0]  # the option's help entry
        assert len(block.split()) > 3, f"{option} has no help: {block!r}"


def test_build_and_verify_name_every_sample_they_report(odd_folder, tmp_path):
    store = tmp_path / "odd.gpucache"
    built = _gpucache("build", str(odd_folder), "-o", str(store), cwd=tmp_path)
    assert built.returncode == 0, built.stderr
    assert "cache.report" not in built.stderr.replace("cache.report in Python", "")
    assert "gpucache info --skipped" in built.stderr and "truncated.jpg" in built.stderr
    checked = _gpucache("verify", str(store), cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    lines = checked.stderr.strip().splitlines()
    assert lines, "the damaged sample is named"
    for line in lines:  # each libjpeg note with its store, sample index and path
        assert re.match(
            rf"{re.escape(str(store))}: sample \d+ \(.*damaged\.jpg\): libjpeg: "
            r"Corrupt JPEG data",
            line,
        ), line
    assert "1 with corrupt data that libjpeg decoded anyway" in checked.stdout


def test_bench_prints_its_plan_and_estimate_before_timing(tmp_path):
    run = _gpucache(
        "bench",
        "--synthetic",
        "8",
        "--contenders",
        "pil",
        "--epochs",
        "1",
        "--workers",
        "0",
        "--no-memory",
        "--batch-size",
        "4",
        cwd=tmp_path,
        env={"TMPDIR": str(tmp_path)},
        merge=True,
    )  # synthetic photos kept there
    assert run.returncode == 0, run.stdout
    out = run.stdout
    assert "plan: 1 contenders (pil), each 1 warm-up + 1 measured epochs of 8 images" in out
    assert re.search(r"estimated time: about \d+ (s|min)", out)
    assert out.index("estimated time") < out.index("warm-up pil")
