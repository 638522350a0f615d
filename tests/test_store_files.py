"""Store files on disk: what a killed writer leaves is cleaned up, and opening anything that is
not a store file says what it is and what to pass instead."""

import multiprocessing as mp
import os
import signal
import socket

import numpy as np
import pytest

from gpucache import CacheFormatError, JpegCache
from gpucache.testing import make_jpeg_bytes


@pytest.fixture(scope="module")
def store() -> JpegCache:
    data = [make_jpeg_bytes(32, 24, seed=k) for k in range(4)]
    return JpegCache.from_files(data, progress=False)


def _save_and_hang(target: str, conn) -> None:
    """In a child: save, and stop inside the fsync of the full-size temporary file."""
    import gpucache.store._save as fmt

    def fsync(fd):
        conn.send("inside")
        conn.poll(120)  # the parent kills this process before it sends anything

    fmt.os.fsync = fsync
    data = [make_jpeg_bytes(32, 24, seed=k) for k in range(4)]
    JpegCache.from_files(data, progress=False).save(target)


def _temps(folder) -> list[str]:
    return sorted(p for p in os.listdir(folder) if p.endswith(".tmp"))


def test_a_writer_killed_mid_save_leaves_a_temp_file_the_next_save_removes(store, tmp_path):
    target = tmp_path / "s.gpucache"
    ctx = mp.get_context("fork")
    mine, theirs = ctx.Pipe()  # a pipe, not an Event: a killed waiter cannot block it
    child = ctx.Process(target=_save_and_hang, args=(str(target), theirs))
    child.start()
    try:
        assert mine.poll(120) and mine.recv() == "inside", "the child never reached fsync"
        (left,) = _temps(tmp_path)  # .s.gpucache.<random>.tmp, written in full
        assert left.startswith(".s.gpucache.")
        size = os.path.getsize(tmp_path / left)
        assert size > store.nbytes
        store.save(target)  # the child is alive and holds its lock: its file is not touched
        assert _temps(tmp_path) == [left]
        os.kill(child.pid, signal.SIGKILL)
        child.join(60)
        assert child.exitcode == -signal.SIGKILL
        assert _temps(tmp_path) == [left]  # a killed writer leaves it behind...
        store.save(target)  # ...and the next save removes it
        assert _temps(tmp_path) == []
        assert len(JpegCache.open(target)) == 4
    finally:
        if child.is_alive():
            child.kill()
        child.join(60)


def test_clean_up_leaves_links_and_other_files_alone(store, tmp_path):
    target = tmp_path / "s.gpucache"
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    os.symlink(victim, tmp_path / ".s.gpucache.abc.tmp")  # planted link: never followed
    (tmp_path / ".s.gpucache.tmpnotours").write_bytes(b"other")  # not a temp name of ours
    store.save(target)
    assert victim.read_bytes() == b"keep me"
    assert sorted(os.listdir(tmp_path)) == [
        ".s.gpucache.abc.tmp",
        ".s.gpucache.tmpnotours",
        "s.gpucache",
        "victim",
    ]


def test_opening_what_is_not_a_store_file_says_what_it_is(store, tmp_path):
    folder = tmp_path / "stores"
    folder.mkdir()
    with pytest.raises(
        IsADirectoryError,
        match="pass the store file",
    ):
        JpegCache.open(folder)
    store.save(folder / "train.gpucache")
    with pytest.raises(
        IsADirectoryError,
        match=r"train.gpucache.*stores/train.gpucache",
    ):
        JpegCache.open(folder)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(CacheFormatError, match="fifo is a FIFO"):
        JpegCache.open(fifo)  # returns at once: no writer is waited for
    with pytest.raises(CacheFormatError, match="/dev/null is a character device"):
        JpegCache.open("/dev/null")
    sock_path = tmp_path / "sock"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(sock_path))
        with pytest.raises(CacheFormatError, match="sock is a socket"):
            JpegCache.open(sock_path)
    with pytest.raises(FileNotFoundError, match="missing.gpucache"):
        JpegCache.open(tmp_path / "missing.gpucache")
    (tmp_path / "empty.gpucache").write_bytes(b"")
    with pytest.raises(CacheFormatError, match="empty.gpucache.*empty"):
        JpegCache.open(tmp_path / "empty.gpucache")
    from gpucache.cli import main

    assert main(["info", str(folder)]) == 2
    assert main(["verify", str(fifo)]) == 2


def test_a_worker_trusts_the_index_its_parent_validated(store, tmp_path):
    """Reopening the very file in a worker runs none of the O(N) checks again: a change to the
    index after the parent validated it (same inode, same header) is not looked at again there,
    while a fresh open checks everything."""
    import pickle

    from gpucache.store._format import HEAD_V2

    path = store.save(tmp_path / "w.gpucache")
    opened = JpegCache.open(path)
    blob = pickle.dumps(opened)  # what a spawn worker receives
    labels_at = HEAD_V2.unpack_from(path.read_bytes())[8]
    with open(path, "r+b") as f:  # in place, under the mapping: index CRC no longer matches
        f.seek(labels_at)
        f.write(np.array([0], "<i8").tobytes())
    again = pickle.loads(blob)  # same process: through /proc/<pid>/fd, like a worker
    assert again._file.handle.trusted and len(again) == 4
    assert again[3].tobytes() == store[3].tobytes()
    with pytest.raises(CacheFormatError, match="index checksum mismatch"):
        JpegCache.open(path)
