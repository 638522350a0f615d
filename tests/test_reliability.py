"""Reliability of the store (issue 8): identity of an open file, shared memory that cannot outlive
its owner, read-only views, concurrent saves, hostile store files (records, strings, fuzzing)."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from gpucache import CacheFormatError, GpuCachedLoader, JpegCache
from gpucache._mapped import attach

REPO = Path(__file__).resolve().parent.parent
LINUX = sys.platform.startswith("linux")


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def _digests(cache) -> list[str]:
    return [hashlib.sha256(cache[i]).hexdigest() for i in range(len(cache))]


def _file_digests(paths) -> list[str]:
    return [hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in paths]


# ------------------------------------------------------------ item 1: what an open store returns
@pytest.fixture()
def replaced(jpeg_folder, tmp_path):
    """A store opened from a path that was then atomically replaced by a different store."""
    original = JpegCache.from_folder(jpeg_folder, progress=False)
    path = original.save(tmp_path / "train.gpucache")
    store = JpegCache.open(path)
    files = list(original.paths)
    other = JpegCache.from_files(files[::-1], labels=[(i * 7) % 3 for i in range(len(files))],
                                 classes=["x", "y", "z"], progress=False)
    other.save(path)  # temp name + rename: a new inode at the same path
    assert JpegCache.open(path).labels.tolist() != original.labels.tolist()
    return store, original


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_replacing_an_open_store_file_never_changes_what_it_returns(replaced, context):
    store, original = replaced
    if context == "spawn":  # the bytes themselves, inside a worker
        with mp.get_context(context).Pool(1) as pool:
            inside = pool.apply(_digests, (store,))
        assert inside == _file_digests(original.paths)
    loader = GpuCachedLoader(store, batch_size=6, num_workers=1, device="cpu", shuffle=True,
                             seed=0, multiprocessing_context=context, return_metadata=True)
    seen = 0
    with loader:
        for images, labels, info in loader:
            idx = info.indices.tolist()
            assert labels.tolist() == original.labels[idx].tolist()
            for img, i in zip(images, idx):
                h, w = original.samples["height"][i], original.samples["width"][i]
                assert tuple(img.shape[-2:]) == (h, w), (i, img.shape, h, w)
            seen += len(idx)
    assert seen == len(original)


def test_without_proc_a_replaced_file_is_a_clear_error(replaced):
    """Where /proc cannot reach the owner's descriptor, the path is opened and checked."""
    store, _ = replaced
    handle = store._file.handle
    dead = _dead_pid()
    with pytest.raises(CacheFormatError, match="replaced or changed after it was opened"):
        attach(handle.name, str(handle.path), dead, handle.fd, handle.identity)
    # the file as it was opened still attaches through /proc, and a closed store refuses clearly
    assert attach(handle.name, str(handle.path), os.getpid(), handle.fd, handle.identity)
    store.close()
    with pytest.raises(ValueError, match="closed"):
        mp.get_context("spawn").Process(target=len, args=(store,)).start()


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# ------------------------------------------------------------ item 6: /dev/shm outliving its owner
_OWNER = textwrap.dedent("""
    import os, sys, time
    from gpucache import GpuCachedLoader, JpegCache

    if __name__ == "__main__":
        cache = JpegCache.from_folder(sys.argv[1], progress=False)
        loader = GpuCachedLoader(cache, batch_size=4, num_workers=1, device="cpu",
                                 multiprocessing_context=sys.argv[2])
        it = iter(loader)
        next(it)
        links = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                links.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:  # the descriptor listdir itself used
                pass
        print("SHM_FD", [link for link in links if "gpucache-" in link], flush=True)
        print("LISTED", [f for f in os.listdir("/dev/shm") if f.startswith(f"gpucache-{os.getpid()}-")],
              flush=True)
        print("READY", *loader.worker_pids, flush=True)
        time.sleep(120)
""")


@pytest.mark.skipif(not (LINUX and os.path.isdir("/dev/shm")), reason="Linux /dev/shm design")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_shared_memory_cannot_outlive_a_killed_owner(jpeg_folder, tmp_path, context, sig):
    script = tmp_path / "owner.py"
    script.write_text(_OWNER)
    proc = subprocess.Popen([sys.executable, str(script), str(jpeg_folder), context], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    got = {}
    try:
        for line in proc.stdout:
            key, _, rest = line.strip().partition(" ")
            got[key] = rest
            if key == "READY":
                break
        assert "READY" in got, proc.stderr.read()
        # the shared copy is held by a descriptor only: its name is gone while the owner runs
        assert "/dev/shm/gpucache-" in got["SHM_FD"] and "(deleted)" in got["SHM_FD"], got
        assert got["LISTED"] == "[]", got
        proc.send_signal(sig)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0  # (a SIGTERM handler may turn the signal into an exit code)
    left = sorted(Path("/dev/shm").glob(f"gpucache-{proc.pid}-*"))
    assert not left, f"{left} outlived its owner ({sig.name}, {context})"


# ------------------------------------------------------------ item 8: the read-only promise
def _base_chain(a):
    """Every object reachable from a view through .base / .obj."""
    out, x = [], a
    while x is not None:
        out.append(x)
        x = getattr(x, "base", None) if isinstance(x, np.ndarray) else getattr(x, "obj", None)
    return out


def _stores(jpeg_folder, tmp_path):
    """In memory after a skipped file (compaction), opened from a file, in shared memory."""
    files = sorted(str(p) for p in Path(jpeg_folder).rglob("*.jpg"))[:6]
    junk = tmp_path / "junk.jpg"
    junk.write_bytes(b"not a jpeg at all")
    memory = JpegCache.from_files([files[0], str(junk), *files[1:]], progress=False)
    assert len(memory.report.skipped) == 1
    opened = JpegCache.open(memory.save(tmp_path / "ro.gpucache"))
    shared = JpegCache.from_files(files, progress=False).share()
    return {"memory": memory, "file": opened, "shared": shared}


def test_no_numpy_route_writes_into_a_store(jpeg_folder, tmp_path):
    for backing, cache in _stores(jpeg_folder, tmp_path).items():
        before = [cache[i].tobytes() for i in range(len(cache))]
        arrays = [cache[1], cache.labels, cache.samples, cache._offsets, cache._paths[1]]
        for view in arrays:
            for obj in _base_chain(view):
                if isinstance(obj, np.ndarray):
                    with pytest.raises(ValueError):
                        obj.setflags(write=True)
                    with pytest.raises(ValueError, match="read-only"):
                        obj[...] = 0
                else:  # memoryview or mmap: the buffer itself refuses writes
                    with pytest.raises(TypeError):
                        obj[0:1] = b"x"
        assert [cache[i].tobytes() for i in range(len(cache))] == before, backing
        cache.close()


_TORCH_WRITE = textwrap.dedent("""
    import sys, warnings
    import torch
    from gpucache import JpegCache

    path, how, backing = sys.argv[1:4]
    cache = JpegCache.open(path)
    if backing == "memory":
        cache = cache._replace()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        view = cache[0]
        t = torch.from_numpy(view) if how == "from_numpy" else torch.frombuffer(view, dtype=torch.uint8)
    print("WARNED", any("not writable" in str(w.message) for w in caught), flush=True)
    t += 1  # a stray in-place op
    print("WROTE", flush=True)
""")


@pytest.mark.skipif(not LINUX, reason="PROT_READ mappings as on Linux")
@pytest.mark.parametrize("backing", ["memory", "file"])
@pytest.mark.parametrize("how", ["from_numpy", "frombuffer"])
def test_a_torch_write_through_a_view_faults_instead_of_changing_the_store(jpeg_folder,
                                                                           tmp_path, how,
                                                                           backing):
    """torch ignores numpy's read-only flag (it warns); the pages themselves are read-only for
    both backings, so the write faults in the process that made it and changes nothing."""
    path = JpegCache.from_folder(jpeg_folder, progress=False).save(tmp_path / "t.gpucache")
    before = path.read_bytes()
    proc = subprocess.run([sys.executable, "-c", _TORCH_WRITE, str(path), how, backing],
                          env=_env(), capture_output=True, text=True, timeout=120)
    assert "WARNED True" in proc.stdout, proc.stdout + proc.stderr
    assert "WROTE" not in proc.stdout and proc.returncode == -signal.SIGSEGV, (
        proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert path.read_bytes() == before
