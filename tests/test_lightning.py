"""Lightning DDP (2 CPU ranks, gloo) on a store: pipelines/lightning_example.py, run for real.

One image per class folder, so the labels a rank trains on name its samples. Run 1 trains epoch 0
whole and crashes at epoch 1's second step (global step 4 -> the step-4 checkpoint holds the loader
at epoch 1 after one batch per rank). Run 2 resumes from that checkpoint: it must train exactly the
samples of epoch 1 that run 1 had not, once each.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpucache.testing import make_jpeg_bytes

pytestmark = [
    # found, not imported: collection in every pytest-xdist worker would pay Lightning's import
    # (about 1 s of CPU) for a test that runs Lightning in child processes only
    pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="needs lightning"),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="CPU DDP on Linux"),
    pytest.mark.timeout(900),
]  # two Lightning launches; slow on a loaded 2-core machine
REPO = Path(__file__).resolve().parent.parent
N, BATCH = 40, 8  # 20 samples per rank: batches of 8, 8, 4 -> 3 steps per epoch


def _fit(tmp: Path, record: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TMPDIR=str(tmp), OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    record.mkdir()
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pipelines.lightning_example",
            "--data",
            str(tmp / "data"),
            "--devices",
            "2",
            "--epochs",
            "2",
            "--batch-size",
            str(BATCH),
            "--workers",
            "1",
            "--checkpoints",
            str(tmp / "ckpt"),
            "--record",
            str(record),
            *args,
        ],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _seen(record: Path) -> dict[tuple[int, int], list[int]]:
    """(epoch, rank) -> labels trained on, in order."""
    out: dict[tuple[int, int], list[int]] = {}
    for rank in range(2):
        for line in (record / f"seen-{rank}.jsonl").read_text().splitlines():
            row = json.loads(line)
            out.setdefault((row["epoch"], rank), []).extend(row["labels"])
    return out


def test_ddp_epochs_cover_every_sample_and_resume_mid_epoch_from_a_checkpoint(tmp_path):
    for i in range(N):
        (tmp_path / "data" / f"c{i:03d}").mkdir(parents=True)
        (tmp_path / "data" / f"c{i:03d}" / "x.jpg").write_bytes(make_jpeg_bytes(40, 32, seed=i))
    crashed = _fit(tmp_path, tmp_path / "run1", "--every-n-steps", "4", "--fail-at-step", "4")
    assert crashed.returncode != 0 and "on purpose" in crashed.stderr, crashed.stderr[-3000:]
    run1 = _seen(tmp_path / "run1")
    epoch0 = run1[0, 0] + run1[0, 1]
    assert sorted(epoch0) == list(range(N))  # every sample once, split between the two ranks
    assert len(run1[0, 0]) == len(run1[0, 1]) == N // 2
    consumed = run1[1, 0] + run1[1, 1]  # epoch 1, step 3: one batch per rank
    assert len(consumed) == 2 * BATCH
    [ckpt] = (tmp_path / "ckpt").glob("*step=4.ckpt")

    resumed = _fit(tmp_path, tmp_path / "run2", "--resume", str(ckpt))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    run2 = _seen(tmp_path / "run2")
    assert set(run2) == {(1, 0), (1, 1)}  # only the rest of epoch 1
    rest = run2[1, 0] + run2[1, 1]
    assert sorted(consumed + rest) == list(range(N))  # the rest, once; nothing seen twice
    assert sorted(epoch0) == sorted(consumed + rest) and epoch0 != consumed + rest
