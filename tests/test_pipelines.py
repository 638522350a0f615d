"""The examples in pipelines/ as a user runs them: a progress line an epoch, and a clear error
when the torchrun example is started without torchrun."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _example(module: str, *args: str, tmp: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TMPDIR": str(tmp)}  # the synthetic photos are kept there
    env.pop("LOCAL_RANK", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_train_example_prints_a_line_an_epoch(tmp_path):
    run = _example(
        "pipelines.train_example",
        "--synthetic",
        "16",
        "--epochs",
        "2",
        "--size",
        "32",
        "--batch-size",
        "8",
        "--workers",
        "0",
        tmp=tmp_path,
    )
    assert run.returncode == 0, run.stderr
    for epoch in (1, 2):  # logged (stderr): epoch, batches, images/s, loss, train-set accuracy
        assert re.search(
            rf"^epoch {epoch}/2: 2 batches, \d+ img/s \(cpu backend, cpu\), "
            r"loss \d+\.\d+, train-set acc \d\.\d+$",
            run.stderr,
            re.M,
        ), run.stderr
    assert "val acc" not in run.stderr  # measured on the training images: named so


def test_ddp_example_without_torchrun_says_how_to_start_it(tmp_path):
    run = _example("pipelines.ddp_example", "--data", str(tmp_path), tmp=tmp_path)
    assert run.returncode == 1
    assert "start it with torchrun" in run.stderr and "LOCAL_RANK is not set" in run.stderr
    assert "Traceback" not in run.stderr


def test_every_manual_page_the_code_points_at_exists():
    """``--help`` texts and docstrings point at the manual by path; each path names a page."""
    named: dict[str, str] = {}
    for folder in ("gpucache", "pipelines", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text()
            assert 'README "' not in text, f"{path}: point at a page under docs/"
            for page in re.findall(r"docs/[\w/.-]+?\.md", text):
                named.setdefault(page, str(path.relative_to(ROOT)))
    missing = {page: where for page, where in named.items() if not (ROOT / page).is_file()}
    assert not missing, missing
    ddp = (ROOT / "pipelines" / "ddp_example.py").read_text()
    assert "docs/guides/multi-gpu.md" in ddp.split("\n")[0]  # its --help's description


def test_segmentation_example_trains_and_prints_per_class_iou(tmp_path):
    run = _example(
        "pipelines.segmentation_example",
        "--synthetic",
        "30",
        "--epochs",
        "1",
        "--size",
        "32",
        "--workers",
        "0",
        tmp=tmp_path,
    )
    assert run.returncode == 0, run.stderr
    for name in ("background", "lesion"):
        assert re.search(rf"^test IoU {name}: \d\.\d{{3}}$", run.stdout, re.M), run.stdout
    assert re.search(r"^test mIoU: \d\.\d{3}$", run.stdout, re.M)
