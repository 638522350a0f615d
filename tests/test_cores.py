"""One count of usable cores (affinity, capped by a cgroup CPU quota) behind every default."""

from __future__ import annotations

import os

import pytest

from gpucache.base import _cores
from gpucache.decode.cpu._procs import default_workers
from gpucache.ingest._pipeline import default_threads as read_threads
from gpucache.store._checksum import default_threads as check_threads


def _tree(tmp_path, monkeypatch, own: str, files: dict[str, str]) -> None:
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (tmp_path / "self-cgroup").write_text(own)
    monkeypatch.setattr(_cores, "_CGROUP", root)
    monkeypatch.setattr(_cores, "_PROC_CGROUP", tmp_path / "self-cgroup")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)


@pytest.mark.parametrize(
    "own, files, quota, usable",
    [
        # cgroup v2: the tightest limit on the way up counts
        (
            "0::/job/step\n",
            {
                "cgroup.controllers": "cpu",
                "job/cpu.max": "250000 100000",
                "job/step/cpu.max": "max 100000",
            },
            2.5,
            3,
        ),
        # v2 in a container: its own path is not under its mount, the mount's root is its cgroup
        ("0::/kubepods/pod1\n", {"cgroup.controllers": "cpu", "cpu.max": "50000 100000"}, 0.5, 1),
        # v1, cpu mounted with cpuacct
        (
            "4:cpu,cpuacct:/docker/abc\n0::/\n",
            {
                "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "400000",
                "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000",
            },
            4.0,
            4,
        ),
        # no limit, or nothing readable: the affinity alone
        ("0::/\n", {"cgroup.controllers": "cpu", "cpu.max": "max 100000"}, None, 8),
        ("4:cpu:/\n", {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, None, 8),
        ("0::/\n", {"cgroup.controllers": "cpu", "cpu.max": "garbage"}, None, 8),
        ("", {}, None, 8),
    ],
)
def test_usable_cores_are_the_affinity_capped_by_the_cpu_quota(
    tmp_path, monkeypatch, own, files, quota, usable
):
    _tree(tmp_path, monkeypatch, own, files)
    assert _cores.cpu_quota() == quota
    assert _cores.usable_cores() == usable


def test_every_default_counts_the_same_cores(tmp_path, monkeypatch):
    """The loader's workers, the verify threads and the build's readers (two a core, at most 16)."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_RANK", "SLURM_NTASKS_PER_NODE", "SLURM_LOCALID"):
        monkeypatch.delenv(name, raising=False)
    _tree(
        tmp_path, monkeypatch, "0::/\n", {"cgroup.controllers": "cpu", "cpu.max": "300000 100000"}
    )
    assert default_workers() == check_threads() == 3
    assert read_threads() == 6
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    (tmp_path / "cgroup" / "cpu.max").write_text("max 100000")
    assert default_workers() == check_threads() == 64 and read_threads() == 16
