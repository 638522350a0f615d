"""Shared fixtures: real JPEG folders made with gpucache.testing, never downloaded."""

import os
import struct
from pathlib import Path

import numpy as np
import pytest

from gpucache.testing import make_jpeg_bytes, make_jpeg_folder
from tests.support import localuser

# pytest-xdist workers for the whole suite: one more than the 2-core machine's cores, because
# the workers wait on child processes (torchrun rendezvous, deadlines, S3 retries): measured on
# 2026-12-06, 860 tests took 459-471 s on two workers (about 1.45 cores busy) and 367 s on three
# (1.8 cores busy)
WORKERS = 3


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """The whole suite (``pytest`` with no paths: the README's test command) on :data:`WORKERS`
    pytest-xdist workers, each taking whole files (a file's module fixtures are made once), in
    collection order. Most of the suite's time is spent in child processes (interpreters that
    import torch, torchrun jobs) that a single pytest process mostly waits for. Left alone: runs
    of given paths (``pytest tests/test_store.py``: one process, as before), an explicit ``-n`` or
    ``--dist``, ``--pdb``, ``-p no:xdist`` or no pytest-xdist installed, and the workers
    themselves."""
    opt = config.option
    if (
        getattr(opt, "numprocesses", 0) is None  # None: xdist is there and no -n was given
        and opt.dist == "no"
        and not opt.usepdb
        and not hasattr(config, "workerinput")
        and config.args_source == pytest.Config.ArgsSource.TESTPATHS
    ):
        opt.numprocesses, opt.dist, opt.loadscopereorder = WORKERS, "loadfile", False


# The files whose tests take longest (most of their time in child processes), slowest first:
# the xdist workers take whole files in collection order, so these start first and the many
# short files fill in behind them instead of one long file running alone at the end. Measured
# with ``pytest --durations`` on the 2-core development machine (2026-12-06).
SLOWEST_FIRST = (
    "test_memory.py",
    "test_reliability.py",
    "test_distributed.py",
    "test_workers.py",
    "test_node_shares_jobs.py",
    "test_object_storage.py",
    "test_lightning.py",
    "test_doc_blocks.py",
    "test_dataset.py",
    "test_object_listing.py",
    "test_gpu_check.py",
    "test_node_shares_s3.py",
    "test_pipelines.py",
    "test_store.py",
    "test_packaging.py",
    "test_object_fetch.py",
    "test_node_scan.py",
    "test_node_progress.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files of :data:`SLOWEST_FIRST` first, in that order; within a file, its own order."""
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def _utf8(value):
    """``value`` (a report as plain data) with every string UTF-8 encodable: a path that is not
    UTF-8 (a surrogate-escaped name, as the non-UTF-8 name tests log) written with a backslash
    escape."""
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, dict):
        return {_utf8(k): _utf8(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_utf8(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_utf8(v) for v in value)
    return value


@pytest.hookimpl(hookwrapper=True)
def pytest_report_to_serializable(config, report):
    """A test's report, as an xdist worker sends it to the controller (execnet sends UTF-8
    strings only; a captured log that names a non-UTF-8 file would end the run)."""
    outcome = yield
    data = outcome.get_result()
    if data is not None:
        outcome.force_result(_utf8(data))


@pytest.fixture(scope="session")
def second_user():
    """Another local user of this machine (``useradd`` for the session, removed after); the
    attacks run as that user in child processes. Skipped, with the reason, where none can be made
    (not root, no useradd)."""
    try:
        user = localuser.create(f"gpucache-t{os.getpid()}")
    except localuser.Unavailable as err:
        pytest.skip(f"no second local user: {err}")
    try:
        yield user
    finally:
        user.remove()


@pytest.fixture(scope="session")
def jpeg_folder(tmp_path_factory) -> Path:
    """24 synthetic photos in 3 classes, including grayscale, CMYK, progressive and EXIF-6."""
    return make_jpeg_folder(
        tmp_path_factory.mktemp("imgs"), 24, classes=("ant", "bee", "cat"), seed=0
    )


@pytest.fixture(scope="session")
def photo_folder(tmp_path_factory) -> Path:
    """60 photo-size synthetic JPEGs in an ImageFolder tree of two classes (ants, bees), of every
    kind (baseline, progressive, gray, CMYK, EXIF-6) at quality 85-97."""
    return make_jpeg_folder(
        tmp_path_factory.mktemp("photos"), 60, classes=("ants", "bees"), seed=7, quality=(85, 97)
    )


@pytest.fixture(scope="session")
def small_folder(tmp_path_factory) -> Path:
    """Small images (fast to decode) for the loader tests."""
    root = tmp_path_factory.mktemp("small")
    rng = np.random.default_rng(0)
    for i in range(40):
        cls = root / f"c{i % 4}"
        cls.mkdir(exist_ok=True)
        w, h = int(rng.integers(40, 120)), int(rng.integers(40, 120))
        (cls / f"{i:03d}.jpg").write_bytes(make_jpeg_bytes(w, h, seed=i))
    return root


def sof_jpeg(precision: int = 8, sof: int = 0xC0, h: int = 2, w: int = 3, comps: int = 3) -> bytes:
    """A header-only JPEG (SOI, SOFn, EOI): enough for the sniffer, not for a decoder."""
    body = struct.pack(">BHHB", precision, h, w, comps) + b"\x01\x11\x00" * comps
    return b"\xff\xd8" + bytes([0xFF, sof]) + struct.pack(">H", len(body) + 2) + body + b"\xff\xd9"


@pytest.fixture(scope="session")
def bad_folder(tmp_path_factory) -> dict:
    """One file per bad-input case, with its documented outcome (see README "Bad input")."""
    from io import BytesIO

    from PIL import Image

    root = tmp_path_factory.mktemp("bad")
    good = make_jpeg_bytes(64, 48, seed=1)
    png = BytesIO()
    Image.new("RGB", (30, 20), (200, 10, 10)).save(png, "PNG")
    cases = {
        # name: (bytes, outcome) -- outcome is "skip" at build, "kept" or "decode-fails"
        "good.jpg": (good, "kept"),
        "empty.jpg": (b"", "skip"),
        "truncated_header.jpg": (good[:40], "skip"),
        "truncated_body.jpg": (good[: len(good) // 2], "skip"),  # no EOI marker
        "random.jpg": (np.random.default_rng(0).bytes(3000), "skip"),
        "text.jpg": (b"this is not an image\n" * 20, "skip"),
        "png_named.jpg": (png.getvalue(), "kept"),
        "cmyk.jpg": (make_jpeg_bytes(40, 30, seed=2, mode="CMYK"), "kept"),
        "gray.jpg": (make_jpeg_bytes(40, 30, seed=3, mode="L"), "kept"),
        "progressive.jpg": (make_jpeg_bytes(40, 30, seed=4, progressive=True), "kept"),
        "exif6.jpg": (make_jpeg_bytes(40, 30, seed=5, exif_orientation=6), "kept"),
        "12bit.jpg": (sof_jpeg(precision=12, sof=0xC1), "skip"),
        "lossless.jpg": (sof_jpeg(sof=0xC3), "skip"),
        # header and EOI intact but the scan data is garbage: caught at decode time
        "corrupt_scan.jpg": (
            good[:300] + b"\x00" * (len(good) - 302) + b"\xff\xd9",
            "decode-fails",
        ),
    }
    (root / "x").mkdir()
    for name, (data, _) in cases.items():
        (root / "x" / name).write_bytes(data)
    return {"root": root, "cases": {os.path.join(root, "x", k): v[1] for k, v in cases.items()}}
