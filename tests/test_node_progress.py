"""A waiting rank follows the builder's progress: it waits while the build moves, however long
that takes, and fails with a clear error naming the builder once nothing moves for the stall
timeout. The builder is a real build slowed on purpose: each input's ``readinto`` waits for one
byte on a FIFO that the test writes, one byte per input."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gpucache.testing import make_jpeg_bytes
from tests.support.hostile import before_marker

REPO = Path(__file__).resolve().parent.parent
N, STALL, PACE = 40, 2.0, 0.2  # the paced part lasts 25 x 0.2 = 5 s, 2.5 stall timeouts
# (the builder rewrites its lock record at most every 0.5 s: every 2nd or 3rd input here)
pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs a FIFO")

BUILDER = """
import os, sys
from pathlib import Path
from gpucache import JpegCache
from gpucache.node import _cache as _node
from gpucache.ingest._build import build
from gpucache.ingest._inputs import Samples
from gpucache.ingest._options import BuildOptions

paths, cdir, fifo = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
gate = os.open(fifo, os.O_RDONLY)

class Gated:  # a Source that reads one byte from the test first
    def __init__(self, p):
        self.name, self.data = p, Path(p).read_bytes()
        self.nbytes = len(self.data)
    def readinto(self, slot):
        if os.read(gate, 1) != b"g":
            raise OSError("the test closed the gate")
        slot[:] = self.data

def slow_build(inputs, extra, on_progress):
    print("building", flush=True)
    labels = __import__("numpy").zeros(len(inputs), dtype="int64")
    return build(JpegCache, [Gated(p) for p in inputs], Samples(labels, ["x"]),
                 BuildOptions(num_threads=1, progress=False), on_progress=on_progress)

cache = _node.built_once(JpegCache, lambda: (paths, ("gated",)), slow_build, (paths, "gated"),
                         BuildOptions(cache_dir=cdir))
print("built", cache.path, flush=True)
"""


def _never(*_):
    raise AssertionError("a waiter built the store itself")


def _waiter(paths, cdir, outcome: dict) -> threading.Thread:
    from gpucache import JpegCache
    from gpucache.ingest._options import BuildOptions
    from gpucache.node import _cache as _node

    def run():
        try:
            outcome["cache"] = _node.built_once(
                JpegCache,
                lambda: (paths, ("gated",)),
                _never,
                (paths, "gated"),
                BuildOptions(cache_dir=cdir),
                stall_timeout=STALL,
            )
        except BaseException as err:  # handed to the test thread
            outcome["error"] = err
        outcome["at"] = time.monotonic()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_waiter_follows_a_slow_builder_and_fails_only_when_it_stalls(tmp_path):
    # inputs of ~300 KB: each one is a read chunk of its own, so progress moves per input
    photo = before_marker(make_jpeg_bytes(32, 32, seed=3), b"\xff\xdb", b"\xff" * 300_000)
    paths = []
    for i in range(N):
        p = tmp_path / "imgs" / f"{i:02d}.jpg"
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(photo)
        paths.append(str(p))
    cdir, fifo = tmp_path / "c", tmp_path / "gate"
    cdir.mkdir(mode=0o700)
    os.mkfifo(fifo)
    gate = os.open(fifo, os.O_RDWR)  # never blocks; the builder's read waits on it
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    builder = subprocess.Popen(
        [sys.executable, "-c", BUILDER, ",".join(paths), str(cdir), str(fifo)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert builder.stdout.readline().strip() == "building"  # it holds the lock now
        first = {}
        waiter = _waiter(paths, cdir, first)
        fed = 0
        for _fed in range(1, 26):  # slow but moving, far past the stall timeout
            os.write(gate, b"g")
            time.sleep(PACE)  # the builder's slowness itself, not a synchronisation
            assert waiter.is_alive(), first
        stopped = time.monotonic()  # the build stops moving
        waiter.join(timeout=STALL + 60)
        err = first.get("error")
        assert isinstance(err, TimeoutError), first
        assert first["at"] - stopped >= STALL - 1  # it waited for the stall timeout...
        assert f"no progress for {STALL:.0f} s from pid {builder.pid} on " in str(err)
        assert re.search(rf": \d+/{N} samples, [\d.]+ MiB", str(err)) and "cache_dir" in str(err)
        assert builder.poll() is None  # ...and left the builder alone

        second = {}
        waiter = _waiter(paths, cdir, second)
        for _ in range(N - fed):
            os.write(gate, b"g")
        assert builder.stdout.readline().startswith("built")
        waiter.join(timeout=120)
        assert "cache" in second, second  # opened the builder's store, did not build
        assert len(second["cache"]) == N and str(second["cache"].path).startswith(str(cdir))
    finally:
        os.close(gate)
        builder.kill()
        builder.wait()


def test_the_lock_record_takes_every_form_of_progress_report(tmp_path):
    from gpucache.node._lock import NodeLock, _read, describe

    with NodeLock(tmp_path / "k.lock", tmp_path / "k.gpucache", 1.0) as lock:
        seen = []
        reports = [("stat", 4096, 10_000), (3, 10, 2 << 20), ("read", 10, 10, 5 << 20, 6 << 20)]
        for report in reports:
            lock.progress(*report)
            lock._write()  # as the 0.5 s throttle would, later
            seen.append(describe(_read(lock.fd)))
    assert seen[0].startswith(f"pid {os.getpid()} on ") and "(stat: 4,096/10,000 samples" in seen[0]
    assert "(read: 3/10 samples, 2.0 MiB" in seen[1] and "(read: 10/10 samples, 5.0 MiB" in seen[2]
    assert not (tmp_path / "k.lock").exists()  # removed on release
