"""What users install: the wheel holds the library only (the CUDA emulation, hostile files and
listing counts are the tests' own, in tests/support/), and ``import gpucache`` stays light."""

from __future__ import annotations

import re
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
    code = (  # one fresh interpreter: what the import loaded, then gpucache.testing on first use
        "import sys, gpucache; "
        "print(sorted(m for m in ('gpucache.testing', 'PIL.ImageDraw') if m in sys.modules)); "
        "print(gpucache.testing.make_jpeg_bytes.__module__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    assert out.split() == ["[]", "gpucache.testing"]


#: What a clone holds that no build may see: VCS data, virtual environments, earlier builds.
NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", "*.so", "*.pyc", "*.gpucache"
)


@pytest.mark.timeout(600)
def test_the_wheel_holds_the_library_alone(tmp_path):
    src = tmp_path / "src"  # the whole clone, as `pip wheel .` there sees it, minus earlier builds
    shutil.copytree(REPO, src, ignore=NOT_SOURCE)
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
    (wheel,) = out.glob("*.whl")
    assert wheel.name.startswith("gpucache_loader-")  # the distribution's own name on the index
    names = zipfile.ZipFile(wheel).namelist()
    modules = [n for n in names if n.startswith("gpucache/") and n.endswith(".py")]
    assert "gpucache/__init__.py" in modules and "gpucache/testing/__init__.py" in modules
    assert "gpucache/__main__.py" in modules
    top = {n.split("/")[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"gpucache"}, sorted(top)
    leaked = [n for n in names if any(t in Path(n).name for t in TEST_ONLY)]
    assert not leaked, leaked


def test_python_m_gpucache_is_the_command_line():
    run = subprocess.run(
        [sys.executable, "-m", "gpucache", "--help"], cwd=REPO, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("usage: gpucache ") and "build" in run.stdout


def test_the_version_is_pyprojects_from_metadata_or_from_the_checkout(tmp_path, capsys):
    """Written once, in pyproject.toml: the installed metadata carries it, a plain checkout on
    PYTHONPATH (no distribution installed) reads it from the pyproject beside the package."""
    import gpucache
    from gpucache._version import UNKNOWN, read_version
    from gpucache.cli import main

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert gpucache.__version__ == version == read_version()
    assert read_version("no-such-distribution-xyz") == version  # the checkout's pyproject
    assert read_version("no-such-distribution-xyz", tmp_path / "pyproject.toml") == UNKNOWN
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"gpucache {version}"


def test_no_line_installs_the_index_s_gpucache():
    """``gpucache`` on the package index is another project: every install line names a package
    (``s3fs``, ``nvidia-dali-cuda120``) or the clone's extras (``pip install -e '.[s3]'``)."""
    wrong = re.compile(r"""pip install\s+(-\S+\s+)*['"]?gpucache(?![\w-])""")
    texts = [
        REPO / "README.md",
        *(REPO / "docs").rglob("*.md"),
        *(REPO / "benchmarks").glob("*.md"),
    ]
    texts += [*(REPO / "gpucache").rglob("*.py"), *(REPO / "benchmarks").rglob("*.py")]
    texts += [*(REPO / "pipelines").rglob("*.py")]
    found = [
        f"{p.relative_to(REPO)}:{n}"
        for p in texts
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if wrong.search(line)
    ]
    assert not found, found
