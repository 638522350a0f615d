"""Reliability of the store: identity of an open file, shared memory that cannot outlive
its owner, read-only views, concurrent saves, hostile store files (records, strings, fuzzing)."""

from __future__ import annotations

import functools
import hashlib
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from gpucache import CacheFormatError, GpuCachedLoader, JpegCache
from gpucache.store._mapped import attach
from tests.support import forked
from tests.support.selected import selected

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
    other = JpegCache.from_files(
        files[::-1],
        labels=[(i * 7) % 3 for i in range(len(files))],
        classes=["x", "y", "z"],
        progress=False,
    )
    other.save(path)  # temp name + rename: a new inode at the same path
    assert JpegCache.open(path).labels.tolist() != original.labels.tolist()
    return store, original


@pytest.mark.parametrize(
    "context",
    [
        "spawn",
        # forkserver workers get the store pickled and attach to it as spawn workers do
        # (gpucache/decode/cpu/_pool.py: every start method but fork): the spawn case covers it
        pytest.param("forkserver", marks=pytest.mark.slow),
    ],
)
def test_replacing_an_open_store_file_never_changes_what_it_returns(replaced, context):
    store, original = replaced
    if context == "spawn":  # the bytes themselves, inside another process
        # Pool.apply pickles its arguments under every start method, so the forked process
        # attaches to the store through its pickle (/proc/<pid>/fd) as a spawned one does
        with mp.get_context("fork").Pool(1) as pool:
            inside = pool.apply(_digests, (store,))
        assert inside == _file_digests(original.paths)
    loader = GpuCachedLoader(
        store,
        batch_size=6,
        num_workers=1,
        device="cpu",
        shuffle=True,
        seed=0,
        multiprocessing_context=context,
        return_metadata=True,
    )
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
        time.sleep(120)  # not a wait for anything: the test's signal ends it, or this bound
""")


_OWNERS = [(c, sig) for c in ("spawn", "forkserver") for sig in (signal.SIGKILL, signal.SIGTERM)]
# The default run kills a spawn owner with SIGKILL and a forkserver owner with SIGTERM: each
# start method and each signal once. The other two are the same mechanisms crossed (both start
# methods share the store the same way, gpucache/decode/cpu/_pool.py), marked slow.
_OWNERS_QUICK = {("spawn", signal.SIGKILL), ("forkserver", signal.SIGTERM)}
_OWNER_CASES = [
    pytest.param(
        c, s, marks=() if (c, s) in _OWNERS_QUICK else pytest.mark.slow, id=f"{c}-{int(s)}"
    )
    for c, s in _OWNERS
]


@pytest.fixture(scope="module")
def owners_killed(request, jpeg_folder, tmp_path_factory):
    """The selected owners started at once (each its own process and shared copy), each
    signalled once it is READY: ``(context, sig) -> (what it printed, its pid, exit code,
    stderr)``."""
    script = tmp_path_factory.mktemp("owners") / "owner.py"
    script.write_text(_OWNER)
    cases = selected(request, "test_shared_memory_cannot_outlive_a_killed_owner", "context", "sig")
    procs = {
        case: subprocess.Popen(
            [sys.executable, str(script), str(jpeg_folder), case[0]],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for case in cases
    }
    out = {}
    try:
        for (context, sig), proc in procs.items():
            got = {}
            assert proc.stdout is not None and proc.stderr is not None
            for line in proc.stdout:
                key, _, rest = line.strip().partition(" ")
                got[key] = rest
                if key == "READY":
                    proc.send_signal(sig)
                    break
            proc.wait(timeout=30)
            out[context, sig] = (got, proc.pid, proc.returncode, proc.stderr.read())
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return out


@pytest.mark.skipif(not (LINUX and os.path.isdir("/dev/shm")), reason="Linux /dev/shm design")
@pytest.mark.parametrize("context, sig", _OWNER_CASES)
def test_shared_memory_cannot_outlive_a_killed_owner(owners_killed, context, sig):
    got, pid, code, stderr = owners_killed[context, sig]
    assert "READY" in got, stderr
    # the shared copy is held by a descriptor only: its name is gone while the owner runs
    assert "/dev/shm/gpucache-" in got["SHM_FD"] and "(deleted)" in got["SHM_FD"], got
    assert got["LISTED"] == "[]", got
    assert code != 0  # (a SIGTERM handler may turn the signal into an exit code)
    left = sorted(Path("/dev/shm").glob(f"gpucache-{pid}-*"))
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
    return {"memory": memory, "file": opened, "shared memory": shared}


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
    import os, sys, traceback, warnings
    import torch
    from gpucache import JpegCache

    path = sys.argv[1]
    for case in sys.argv[2:]:
        how, backing = case.split(":")
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:  # each write in a fork of this fresh interpreter: torch warns once a process
            try:
                cache = JpegCache.open(path)
                if backing == "memory":
                    cache = cache._replace()
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    view = cache[0]
                    t = (torch.from_numpy(view) if how == "from_numpy"
                         else torch.frombuffer(view, dtype=torch.uint8))
                print(case, "WARNED", any("not writable" in str(w.message) for w in caught),
                      flush=True)
                t += 1  # a stray in-place op
                print(case, "WROTE", flush=True)
            except BaseException:
                traceback.print_exc()
                sys.stderr.flush()
                os._exit(1)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print(case, "CODE", os.waitstatus_to_exitcode(status), flush=True)
""")


@pytest.fixture(scope="module")
def torch_writes(request, jpeg_folder, tmp_path_factory):
    """One fresh interpreter that imports torch once and makes each selected write in a fork of
    itself (a fault ends only that fork): ``(how, backing) -> (its lines, exit code, stderr)``,
    with the store file's bytes before and after all of them."""
    cases = selected(
        request,
        "test_a_torch_write_through_a_view_faults_instead_of_changing_the_store",
        "how",
        "backing",
    )
    folder = tmp_path_factory.mktemp("torch_write")
    path = JpegCache.from_folder(jpeg_folder, progress=False).save(folder / "t.gpucache")
    before = path.read_bytes()
    proc = subprocess.run(
        [sys.executable, "-c", _TORCH_WRITE, str(path), *(f"{h}:{b}" for h, b in cases)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    out = {}
    for how, backing in cases:
        mine = [
            line.split(" ", 1)[1]
            for line in proc.stdout.splitlines()
            if line.startswith(f"{how}:{backing} ")
        ]
        codes = [int(line.split()[1]) for line in mine if line.startswith("CODE ")]
        out[how, backing] = (mine, codes[0] if codes else None, proc.stderr)
    return out, before, path.read_bytes()


@pytest.mark.skipif(not LINUX, reason="PROT_READ mappings as on Linux")
@pytest.mark.parametrize("backing", ["memory", "file"])
@pytest.mark.parametrize("how", ["from_numpy", "frombuffer"])
def test_a_torch_write_through_a_view_faults_instead_of_changing_the_store(
    torch_writes, how, backing
):
    """torch ignores numpy's read-only flag (it warns); the pages themselves are read-only for
    both backings, so the write faults in the process that made it and changes nothing."""
    out, before, after = torch_writes
    lines, code, stderr = out[how, backing]
    assert "WARNED True" in lines, (lines, stderr[-2000:])
    assert "WROTE" not in lines and code == -signal.SIGSEGV, (code, lines, stderr[-2000:])
    assert after == before


# ------------------------------------------------------------ item 9: concurrent saves to one path
def _save_many(args) -> int:
    path, src, n = args
    cache = JpegCache.open(src)
    for _ in range(n):
        cache.save(path)
    return n


def test_concurrent_saves_to_one_path_all_succeed_and_leave_a_valid_file(jpeg_folder, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    cache = JpegCache.from_folder(jpeg_folder, progress=False)
    src = cache.save(tmp_path / "src.gpucache")
    target = tmp_path / "out" / "same.gpucache"
    target.parent.mkdir()
    opened, saved = [], threading.Event()

    def reader():  # every open while writers race sees a complete store
        while not saved.is_set() or len(opened) < 40:
            if target.exists():
                opened.append(len(JpegCache.open(target)))
            saved.wait(0.005)  # pacing, so that the opens spread over the saves

    with ThreadPoolExecutor(9) as pool:
        r = pool.submit(reader)
        saves = [pool.submit(cache.save, target) for _ in range(60)]
        try:
            for f in saves:
                f.result()  # none fails (the old shared temp name failed 113 of 300)
        finally:
            saved.set()  # a failed save fails the test now, not the reader's wait at the timeout
        r.result(timeout=300)
    assert set(opened) == {len(cache)}
    # processes, not threads, racing too: forked (the start method is not what is tested; each
    # save makes its temporary name after the fork, from os.urandom)
    with mp.get_context("fork").Pool(3) as pool:
        assert sum(pool.map(_save_many, [(target, src, 5)] * 3)) == 15
    assert _digests(JpegCache.open(target)) == _digests(cache)
    assert sorted(p.name for p in target.parent.iterdir()) == ["same.gpucache"]
    with pytest.raises(FileNotFoundError, match="folder does not exist"):
        cache.save(tmp_path / "missing" / "x.gpucache")


# ------------------------------------------------------------ item 10: pixel budget on the store
def test_max_pixels_is_set_at_build_and_open_and_reaches_workers(tmp_path, monkeypatch):
    from conftest import sof_jpeg

    from gpucache.store._limits import DEFAULT_MAX_PIXELS, check_pixels

    monkeypatch.chdir(tmp_path)
    Path("small.jpg").write_bytes(sof_jpeg(h=10, w=10))
    Path("big.jpg").write_bytes(sof_jpeg(h=100, w=200))
    strict = JpegCache.from_files(["small.jpg", "big.jpg"], max_pixels=1000, progress=False)
    assert len(strict) == 1 and strict.max_pixels == 1000
    assert "max_pixels" in strict.report.skipped[0].reason
    loose = JpegCache.from_files(["small.jpg", "big.jpg"], max_pixels=None, progress=False)
    assert len(loose) == 2 and loose.max_pixels is None
    path = loose.save(tmp_path / "px.gpucache")
    assert JpegCache.open(path).max_pixels == DEFAULT_MAX_PIXELS
    opened = JpegCache.open(path, max_pixels=500)
    with pytest.raises(ValueError, match="max_pixels=500"):
        check_pixels(opened, 1)
    # the store reaches another process through its pickle (Pool.apply pickles its arguments
    # under fork too), as it reaches spawn and forkserver workers
    with mp.get_context("fork").Pool(1) as pool:
        assert pool.apply(getattr, (opened, "max_pixels")) == 500


# ------------------------------------------------------------ item 10: hostile store files
def rechecksum(b: bytearray) -> bytes:
    """Recompute a v2 file's index, directory and header CRCs after an edit, so that the
    validation behind the checksums is what gets tested."""
    import zlib

    from gpucache.store._format import CRC, ENTRY, HEAD_V2

    f = list(HEAD_V2.unpack_from(b))
    crc = 0
    for k in range(6):
        start, length = f[6 + 2 * k], f[7 + 2 * k]
        crc = zlib.crc32(bytes(b[start : start + length]), crc)
    f[21] = crc
    f[24] = zlib.crc32(bytes(b[f[22] : f[22] + ENTRY.size * f[23]]))
    HEAD_V2.pack_into(b, 0, *f)
    CRC.pack_into(b, HEAD_V2.size, zlib.crc32(bytes(b[: HEAD_V2.size])))
    return bytes(b)


@pytest.fixture()
def small_store(jpeg_folder, tmp_path) -> tuple[bytes, dict]:
    from gpucache.store._format import HEAD_V2

    cache = JpegCache.from_folder(jpeg_folder, progress=False)
    cache = cache._replace(extra={"rst": np.arange(len(cache), dtype="<i4")})
    raw = cache.save(tmp_path / "small.gpucache").read_bytes()
    f = HEAD_V2.unpack_from(raw)
    spans = {
        name: (f[6 + 2 * k], f[7 + 2 * k])
        for k, name in enumerate(
            ["offsets", "labels", "samples", "classes", "paths", "metadata", "data"]
        )
    }
    return raw, spans


def _write(tmp_path, data: bytes) -> Path:
    p = tmp_path / "hostile.gpucache"
    p.write_bytes(data)
    return p


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("height", 0, "invalid record"),
        ("width", 0, "invalid record"),
        ("kind", 99, "invalid record"),
        ("components", 9, "invalid record"),
    ],
)
def test_invalid_sample_records_are_refused_at_open(small_store, tmp_path, field, value, match):
    from gpucache.ingest._sniff import SAMPLE_DTYPE

    raw, spans = small_store
    b = bytearray(raw)
    rec = spans["samples"][0] + 3 * SAMPLE_DTYPE.itemsize + SAMPLE_DTYPE.fields[field][1]
    fmt = "<I" if field in ("height", "width") else "<B"
    import struct

    struct.pack_into(fmt, b, rec, value)
    path = _write(tmp_path, rechecksum(b))
    with pytest.raises(CacheFormatError, match=f"sample 3 has an {match}"):
        JpegCache.open(path)
    from gpucache.cli import main

    assert main(["info", str(path)]) == 2  # a clear message, no traceback


def test_non_utf8_bytes_in_a_string_table_read_back_losslessly(small_store, tmp_path):
    """Paths are OS names: any bytes are kept and read back as the str os.fsdecode gives."""
    raw, spans = small_store
    start, length = spans["paths"]
    b = bytearray(raw)
    b[start + length - 1] = 0xFF  # last byte of the last path
    b[start + length - 3 : start + length - 1] = "\N{SNOWMAN}".encode()[:2]  # a cut character
    opened = JpegCache.open(_write(tmp_path, rechecksum(b)))
    last = opened.paths[len(opened) - 1]
    assert os.fsencode(last).endswith(b"\xe2\x98\xff") and last.endswith("\udce2\udc98\udcff")


def _truncate_and_read(path: str, send) -> None:
    """In a forked child (a SIGBUS ends it, not pytest): open, truncate in place, read."""
    from gpucache.decode._sample import decode_sample

    cache = JpegCache.open(path)
    n = len(cache)
    os.truncate(path, 8192)  # someone rewrites the file in place
    caught = []
    for what in ("view", "decode"):
        try:
            cache[n - 1].sum() if what == "view" else decode_sample(cache, n - 1)
        except CacheFormatError as err:
            caught.append((what, "truncated" in str(err)))
    send.send(caught)


def test_truncating_an_open_store_file_is_an_error_not_sigbus(small_store, tmp_path):
    raw, _ = small_store
    path = _write(tmp_path, raw)
    code, got = forked.result_of(_truncate_and_read, str(path), within=120)
    assert code == 0, code  # -7 would be SIGBUS
    assert got == [("view", True), ("decode", True)], got
    with pytest.raises(CacheFormatError, match="truncated"):
        JpegCache.open(path)


_LIMITS = textwrap.dedent("""
    import os, resource, sys
    from gpucache import JpegCache, SharedMemoryError

    files = sorted(os.path.join(r, f) for r, _, fs in os.walk(sys.argv[1]) for f in fs)
    # big enough (~35 MB) that memory freed elsewhere cannot make room for it under the limit
    cache = JpegCache.from_files(files * (16 if sys.argv[2] == "as" else 1), progress=False)
    if sys.argv[2] == "fsize":
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
    elif sys.argv[2] == "as":
        vm = int([l.split()[1] for l in open("/proc/self/status") if l.startswith("VmSize")][0])
        resource.setrlimit(resource.RLIMIT_AS, (vm * 1024 + cache.nbytes // 2,
                                                resource.RLIM_INFINITY))
    try:
        cache.share()
    except SharedMemoryError as err:
        print("ERROR", str(err).replace("\\n", " "), flush=True)
    else:
        print("SHARED", flush=True)
    print("LEFT", sorted(f for f in os.listdir("/dev/shm")
                         if f.startswith(f"gpucache-{os.getpid()}-")), flush=True)
""")


@pytest.mark.skipif(not (LINUX and os.path.isdir("/dev/shm")), reason="Linux rlimits, /dev/shm")
@pytest.mark.parametrize(
    "limit, match",
    [
        ("fsize", "file-size limit of this process (ulimit -f / RLIMIT_FSIZE) is 1.0 MiB"),
        ("as", "address-space limit (ulimit -v / RLIMIT_AS)"),
        ("rofs", "Read-only file system"),
    ],
)
def test_constrained_share_gives_a_clear_error(jpeg_folder, tmp_path, limit, match):
    cmd = [sys.executable, "-c", _LIMITS, str(jpeg_folder), limit]
    if limit == "rofs":
        import shutil

        if os.geteuid() != 0 or shutil.which("unshare") is None:
            pytest.skip("mounting a read-only /dev/shm needs root and unshare")
        cmd = [
            "unshare",
            "-m",
            "sh",
            "-c",
            'mount -t tmpfs -o ro,size=16m tmpfs /dev/shm || exit 77; exec "$0" "$@"',
            *cmd,
        ]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120)
    if proc.returncode == 77:
        pytest.skip(f"cannot mount a read-only /dev/shm: {proc.stderr.strip()}")
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    got = dict(line.partition(" ")[::2] for line in proc.stdout.splitlines())
    assert "SHARED" not in got and match in got.get("ERROR", ""), proc.stdout
    assert "cache.save" in got["ERROR"] or "num_workers=0" in got["ERROR"]
    assert got["LEFT"] == "[]"


# ------------------------------------------------------------ out of memory is no bad sample
def _flat(fmt: str, width: int, height: int) -> bytes:
    """An image of one colour in ``fmt``: small to store, ``width * height`` pixels decoded."""
    from io import BytesIO

    from PIL import Image

    out = BytesIO()
    Image.new("RGB", (width, height), (90, 120, 150)).save(out, fmt)
    return out.getvalue()


def _build_reencoded(png: bytes) -> tuple[int, int]:
    cache = JpegCache.from_files([png], max_side=64, num_threads=1, progress=False)
    return int(cache.samples["height"][0]), int(cache.samples["width"][0])


def _verify(cache) -> list:
    from gpucache.cli._checks import check_decodes

    return [p.reason for p in check_decodes(cache, threads=1, progress=False)]


@pytest.mark.timeout(120)
def test_out_of_memory_at_build_and_verify_is_a_memory_error_not_a_bad_sample():
    # A fresh child process capped 48 MB above what it maps: re-encoding a 6000x6000 PNG (144 MB in
    # PIL) used to keep the image as it was, unannounced; verifying a 6000x6000 JPEG (108 MB)
    # reported the sample as undecodable.
    from gpucache.testing._memory import with_address_space

    png = _flat("PNG", 6000, 6000)
    out, raised = with_address_space(functools.partial(_build_reencoded, png), 48 << 20)
    assert out is None and raised is not None and raised[1], raised  # a MemoryError
    assert "out of memory re-encoding a 6000x6000 image at build" in raised[2], raised
    assert "not a bad sample" in raised[2] and "num_threads=" in raised[2], raised
    cache = JpegCache.from_files([_flat("JPEG", 6000, 6000)], progress=False).share()
    # without the cap it decodes (in a child, as the capped run); the image needs 108 MB
    assert with_address_space(functools.partial(_verify, cache), None) == ([], None)
    out, raised = with_address_space(functools.partial(_verify, cache), 48 << 20)
    assert out is None and raised is not None and raised[1], raised  # a MemoryError
    assert "out of memory verifying sample 0 (<bytes #0>)" in raised[2], raised
