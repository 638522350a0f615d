"""The CPU worker protocol under failure: big batches, stopped, killed and dying processes, shutdown.

Real worker processes under fork, spawn and forkserver, real JPEGs. Cases where a parent dies run in
child processes (forked from one helper so torch is imported once).
"""

import array
import fcntl
import functools
import gc
import json
import os
import signal
import subprocess
import sys
import termios
import textwrap
import threading
import time
import warnings
import weakref

import psutil
import pytest

from gpucache import GpuCachedLoader, JpegCache, WorkerError
from gpucache import transforms as T
from gpucache.testing import make_jpeg_bytes
from gpucache.testing._memory import limit_address_space, with_address_space
from tests.support.selected import selected

SIZE = T.Resize((16, 16))  # fixed size: a batch is one stacked tensor of 768 bytes per image


def _tiny_store(root, n: int) -> str:
    """``n`` samples of 16x16 JPEGs, saved: a batch of 500 is 384 KB, more than a socket buffer."""
    files = []
    for i in range(12):
        files.append(root / f"{i}.jpg")
        files[-1].write_bytes(make_jpeg_bytes(16, 16, seed=i))
    cache = JpegCache.from_files(
        [files[i % 12] for i in range(n)], [i % 3 for i in range(n)], progress=False
    )
    return str(cache.save(root / "tiny.gpuc"))


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    return _tiny_store(tmp_path_factory.mktemp("tiny"), 3000)


@pytest.fixture(scope="module")
def big_cache(tmp_path_factory):
    return JpegCache.open(_tiny_store(tmp_path_factory.mktemp("big"), 9000))


@pytest.fixture(scope="module")
def cache(store_path):
    return JpegCache.open(store_path)


def _gone(pids, within: float) -> list[int]:
    """The pids still running (zombies count as gone) after waiting up to ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.02)  # polling interval, under a deadline


def _queued(loader) -> list[int]:
    """Bytes each worker has sent that the parent has not read yet (FIONREAD on its socket)."""
    out = []
    for link in loader._backend.pool._links:
        n = array.array("i", [0])
        fcntl.ioctl(link.sock.fileno(), termios.FIONREAD, n)
        out.append(n[0])
    return out


def _until(condition, what: str, within: float = 120) -> None:
    """Poll ``condition`` until it holds; fail after ``within`` seconds (a loaded machine)."""
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"not within {within} s: {what}"
        time.sleep(0.01)  # polling interval, under a deadline


SENDING = 64 * 1024  # queued bytes that prove a worker is sending a result's data (768 B/image)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("batch_size, prefetch", [(3000, 2), (3000, 4), (1000, 8)])
def test_big_batches_never_deadlock(big_cache, batch_size, prefetch):
    # A task of 3000 samples is 288 KB of plans and a socket takes ~300 KB: with more than one
    # task queued behind the one being decoded, the old protocol blocked in send while its worker
    # blocked sending a 2.3 MB result.
    with GpuCachedLoader(
        big_cache,
        batch_size=batch_size,
        num_workers=1,
        device="cpu",
        prefetch_factor=prefetch,
        transform=SIZE,
        timeout=60,
        multiprocessing_context="fork",
    ) as loader:
        seen = [len(labels) for _, (_, labels) in zip(range(2), loader)]  # then close()
    assert seen == [batch_size] * 2


@pytest.fixture
def through_the_socket(monkeypatch):
    """Batches sent on the socket, as without memory files (gpucache/decode/cpu/_batch_files.py: not
    Linux, or into pinned memory): a worker that sends a large one blocks until it is read."""
    from gpucache.decode.cpu import _batch_files

    monkeypatch.setattr(_batch_files, "available", lambda: False)


def _blocked_mid_send(cache, *, timeout):
    """A loader whose single worker is blocked sending a 768 KB result nobody reads yet (a socket
    takes ~220 KB: the worker cannot finish sending it before the parent reads)."""
    loader = GpuCachedLoader(
        cache,
        batch_size=1000,
        num_workers=1,
        device="cpu",
        transform=SIZE,
        timeout=timeout,
        multiprocessing_context="fork",
    )
    it = iter(loader)
    images, _ = next(it)
    assert images.shape == (1000, 3, 16, 16)  # whole results: every sample decoded, none skipped
    # the worker decodes the next batch and fills the socket, then blocks in send
    _until(lambda: _queued(loader)[0] >= SENDING, "the worker sends its second result")
    return loader, it


@pytest.mark.timeout(60)
def test_stopped_worker_is_an_error_within_the_timeout(cache, through_the_socket):
    loader, it = _blocked_mid_send(cache, timeout=2)
    pid = loader.worker_pids[0]
    os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(
            WorkerError,
            match=rf"worker 0 \(pid {pid}\).*timeout=2s.*samples \[",
        ):
            next(it)
        # the timeout, then close(): a stopped worker needs the SIGKILL step (2 x 0.25 s grace)
        assert time.monotonic() - start < 2 + 8
        assert loader.worker_pids == [] and _gone([pid], 10) == []  # a stopped worker is killed
    finally:
        loader.close()


@pytest.mark.timeout(60)
def test_worker_killed_mid_send_names_worker_pid_and_samples(cache, through_the_socket):
    loader, it = _blocked_mid_send(cache, timeout=20)
    pid = loader.worker_pids[0]
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(
        WorkerError,
        match=rf"worker 0 \(pid {pid}\).*SIGKILL.*samples \[.*\(1000\)",
    ):
        next(it)
    assert loader.worker_pids == []


@pytest.mark.timeout(60)
def test_close_mid_epoch_stops_four_workers_blocked_sending(cache, through_the_socket):
    loader = GpuCachedLoader(
        cache,
        batch_size=500,
        num_workers=4,
        device="cpu",
        transform=SIZE,
        prefetch_factor=2,
        multiprocessing_context="fork",
    )
    it = iter(loader)
    next(it)
    _until(lambda: min(_queued(loader)) >= SENDING, "every worker is sending a result")
    pids = loader.worker_pids
    start = time.monotonic()
    loader.close()
    # one shared 0.25 s deadline, then SIGTERM, then SIGKILL: never a per-worker wait. (How fast
    # it is, 0.22 s median on a loaded 2-core machine, is a measurement, not this bound.)
    assert time.monotonic() - start < 4 * 0.25 + 2
    assert _gone(pids, 0) == []


@pytest.mark.timeout(60)
def _close_once_waiting(loader, main: int) -> None:
    """close() as soon as thread ``main`` waits inside the pool for a batch."""
    _until(
        lambda: (f := sys._current_frames().get(main)) is not None and f.f_code.co_name == "_wait",
        "the main thread waits for a batch",
    )
    loader.close()


@pytest.mark.timeout(120)
def test_close_from_another_thread_wakes_a_waiting_iteration(cache):
    loader = GpuCachedLoader(
        cache,
        batch_size=50,
        num_workers=2,
        device="cpu",
        transform=SIZE,
        multiprocessing_context="fork",
    )
    it = iter(loader)
    next(it)
    pids = loader.worker_pids
    for pid in pids:  # no more results: the iteration ends up waiting in the pool
        os.kill(pid, signal.SIGSTOP)
    closer = threading.Thread(target=_close_once_waiting, args=(loader, threading.get_ident()))
    closer.start()
    got = 1
    with pytest.raises(WorkerError, match="closed"):
        for _ in it:
            got += 1
    closer.join()
    assert got <= 1 + 2 * 2  # at most the results in flight (prefetch 2 x 2 workers)
    assert _gone(pids, 10) == []  # stopped workers too
    with pytest.raises(RuntimeError, match="closed.*Make a new GpuCachedLoader"):
        iter(loader).__next__()  # a closed loader starts no new workers


@pytest.mark.timeout(120)
def test_a_forked_child_that_drops_the_loader_leaves_its_workers_alone(cache):
    """A process forked mid-epoch (a user's os.fork, a worker of another loader) inherits the
    loader; when it lets go of it, the loader's finalizer must not shut the parent's sockets or
    signal the parent's workers: the parent's epoch goes on whole."""
    loader = GpuCachedLoader(
        cache, batch_size=50, num_workers=2, device="cpu", transform=SIZE, seed=0
    )
    it = iter(loader)
    next(it)
    pids = loader.worker_pids
    child = os.fork()
    if child == 0:  # the child: let go of the loader, collect, and say whether it is gone
        gone = weakref.ref(loader)
        del it, loader
        gc.collect()
        os._exit(0 if gone() is None else 3)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child still held the loader"
    assert sorted(_gone(pids, 0)) == sorted(pids), "the child stopped the parent's workers"
    rest = sum(1 for _ in it)
    assert 1 + rest == len(cache) // 50
    assert loader.worker_pids == pids
    loader.close()


def _raise_in_worker(worker_id):
    if worker_id == 1:
        raise RuntimeError("boom from worker_init_fn")


@pytest.mark.timeout(60)
def test_raising_worker_init_fn_reports_its_traceback(cache):
    loader = GpuCachedLoader(
        cache,
        batch_size=50,
        num_workers=2,
        device="cpu",
        worker_init_fn=_raise_in_worker,
        multiprocessing_context="fork",
    )
    with pytest.raises(WorkerError) as err:
        for _ in loader:
            pass
    msg = str(err.value)
    assert "worker 1" in msg and "failed in worker_init_fn: RuntimeError: boom" in msg
    assert "Traceback" in msg and "_raise_in_worker" in msg and "OOM" not in msg


def _flat_jpeg(width: int, height: int) -> bytes:
    """A JPEG of one colour: a few KB to store and quick to decode, ``3 * width * height``
    bytes decoded."""
    from io import BytesIO

    from PIL import Image

    out = BytesIO()
    Image.new("RGB", (width, height), (90, 120, 150)).save(out, "JPEG")
    return out.getvalue()


BIG = 5000  # a BIG x BIG image decodes to 75 MB: more than any margin below leaves, but one


@pytest.fixture(scope="module")
def one_big(tmp_path_factory):
    """Four small JPEGs, then one that decodes to 75 MB; in shared memory, so that a fresh
    process can be handed it."""
    items = [make_jpeg_bytes(64, 64, seed=i) for i in range(4)] + [_flat_jpeg(BIG, BIG)]
    return JpegCache.from_files(items, progress=False).share()


# Each out-of-memory case runs in a fresh interpreter (gpucache.testing._memory.with_address_space
# says why): its loader forks or spawns its worker from there, and the worker caps its own
# address space in worker_init_fn. The cases share one such interpreter (one torch import
# instead of one a case). First the case without workers, capped in that interpreter itself
# (then the cap is lifted: a limit's soft value may go back up to its hard one); then the fork
# cases: a fork worker inherits its parent's heap, and before them the parent has only failed
# one 75 MB allocation and freed four 64x64 images (KBs of free heap against margins of 32 MB);
# then spawn, whose worker inherits nothing.


def _epoch(cache, **options) -> dict:
    """One epoch of a loader made with ``options``: batches before an error, and the error."""
    loader = GpuCachedLoader(cache, device="cpu", **options)
    batches, error, kind = 0, None, None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a skipped sample warns: an error here
            for _ in loader:
                batches += 1
    except (WorkerError, MemoryError) as err:
        error, kind = str(err), "WorkerError" if isinstance(err, WorkerError) else "MemoryError"
    finally:
        loader.close()
    stats = loader.stats
    return dict(
        batches=batches, error=error, kind=kind, skipped=stats.skipped, samples=stats.samples
    )


def _capped_epoch(cache, margin: int, **options) -> dict:
    """:func:`_epoch` in this process capped ``margin`` bytes above what it maps; the cap is
    lifted after."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit_address_space(margin)
    try:
        return _epoch(cache, **options)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _oom_epochs(cache, cases: dict) -> dict:
    """:func:`_epoch` of each case in turn: context None, capped in this process; else with one
    worker of that context capped its margin bytes above its start."""
    out = {}
    for name, (context, margin, options) in cases.items():
        if context is None:
            out[name] = _capped_epoch(cache, margin, num_workers=0, **options)
            continue
        out[name] = _epoch(
            cache,
            num_workers=1,
            multiprocessing_context=context,
            timeout=90,
            worker_init_fn=functools.partial(limit_address_space, margin),
            **options,
        )
    return out


# 32 MB of address space beyond what the process maps after start: a 64x64 JPEG decodes, the
# 75 MB one cannot.
DECODING = (32 << 20, dict(batch_size=4, exact=True, transform=SIZE))
# Room for the 75 MB image, not for the copy of it that goes to the socket (images of several
# sizes are sent as one buffer).
COPYING = (3 * BIG * BIG + (32 << 20), dict(batch_size=1))
#: what runs out -> (address space allowed above what the worker maps at start, loader options)
LIMITS = {"decoding": DECODING, "copying": COPYING}
# A worker copies its result for sending in the same code under any start method
# (decode/cpu/_worker.py, _serve); what spawn changes (a fresh interpreter capped in
# worker_init_fn, the store attached from shared memory) the decoding case under spawn covers.
# The copying case under spawn, one more interpreter, runs with `-m slow`.
_OOM_TESTS = {
    "decoding": "test_a_worker_out_of_memory_decoding_is_an_error_not_a_skipped_sample",
    "copying": "test_a_worker_out_of_memory_copying_its_result_is_named",
}
_NO_WORKERS = "test_out_of_memory_decoding_without_workers_is_a_memory_error_not_a_skipped_sample"


@pytest.fixture(scope="module")
def oom(request, one_big) -> dict:
    """The epoch of every selected case, ``(what runs out, context)``, all in one fresh
    interpreter: the case without workers first, then fork, then spawn."""
    cases = [("decoding", None)] if selected(request, _NO_WORKERS) else []
    for what, test in _OOM_TESTS.items():
        cases += [(what, context) for (context,) in selected(request, test, "context")]
    cases.sort(key=lambda case: (None, "fork", "spawn").index(case[1]))
    out, raised = with_address_space(
        functools.partial(_oom_epochs, one_big, {c: (c[1], *LIMITS[c[0]]) for c in cases}),
        None,
        timeout=240,
    )
    assert raised is None, raised
    return out


def _says_memory(msg: str, wid: int = 0) -> None:
    assert f"worker {wid} (pid" in msg and "ran out of memory" in msg, msg
    assert "not a bad sample" in msg and "num_workers=" in msg and "batch_size" in msg, msg
    assert "RLIMIT_AS" in msg, msg


@pytest.mark.timeout(300)  # the first case also runs every case's epoch (one fresh interpreter)
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_worker_out_of_memory_decoding_is_an_error_not_a_skipped_sample(oom, context):
    # It used to be skipped as "could not be decoded: MemoryError".
    out = oom["decoding", context]
    assert out["kind"] == "WorkerError", out
    assert out["batches"] == 1  # the small images decoded under the limit
    msg = out["error"]
    _says_memory(msg)
    assert "while decoding sample 4 (<bytes #4>)" in msg and "samples [4]" in msg, msg
    assert out["skipped"] == 0 and out["samples"] == 4, out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("context", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_a_worker_out_of_memory_copying_its_result_is_named(oom, context):
    # That worker used to exit with code 1, the cause only on its stderr.
    out = oom["copying", context]
    assert out["kind"] == "WorkerError", out
    assert out["batches"] == 4
    _says_memory(out["error"])
    assert "while copying its result for sending, in its batch of samples [4]" in out["error"]
    assert out["skipped"] == 0, out


@pytest.mark.timeout(300)
def test_out_of_memory_decoding_without_workers_is_a_memory_error_not_a_skipped_sample(oom):
    # num_workers=0 decodes in the main process (here a fresh child capped 32 MB above what it
    # maps): the MemoryError propagates, with the sample and the fix, and nothing is skipped.
    out = oom["decoding", None]
    assert out["batches"] == 1 and out["skipped"] == 0 and out["kind"] == "MemoryError", out
    msg = out["error"]
    assert "out of memory while decoding sample 4 (<bytes #4>)" in msg, msg
    assert "not a bad sample" in msg and "batch_size" in msg and "RLIMIT_AS" in msg, msg


NO_MAIN_GUARD = """
import sys
from gpucache import GpuCachedLoader, JpegCache
loader = GpuCachedLoader(JpegCache.open(sys.argv[1]), batch_size=4, num_workers=1,
                         device="cpu", multiprocessing_context="spawn")
next(iter(loader))
"""


@pytest.mark.timeout(300)  # the script and its worker each import torch: slow on a busy machine
def test_spawn_worker_dying_at_start_up_names_the_missing_main_guard(store_path, tmp_path):
    script = tmp_path / "no_guard.py"
    script.write_text(NO_MAIN_GUARD)
    out = subprocess.run(
        [sys.executable, str(script), store_path],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=tmp_path,
    )
    err = out.stderr.rsplit("Traceback (most recent call last)", 1)[-1]  # the parent's, last
    assert "WorkerError: worker 0" in err and "before it started (spawn start method)" in err
    assert 'if __name__ == "__main__":' in err and "OOM" not in err


# One helper imports torch once and forks one parent per case; each parent starts a loader,
# reads one batch (its workers keep decoding or sit blocked sending) and reports its pids.
# (The default run's five parents take one helper; the slow cases, a second.)
PARENTS = textwrap.dedent("""
    import json, os, signal, sys, time
    from gpucache import GpuCachedLoader, JpegCache
    from gpucache import transforms as T


    def parent(cache, ready, method, sig, workers):
        loader = GpuCachedLoader(cache, batch_size=500, num_workers=workers, device="cpu",
                                 transform=T.Resize((16, 16)), multiprocessing_context=method)
        next(iter(loader))
        # the parents share one pipe: one write(2) of a whole line (under PIPE_BUF, so atomic);
        # print() writes the text and its newline apart, and a flush between them (multiprocessing
        # flushes stdout before it starts a process) joins two reports on one line
        report = {"case": [method, sig, workers], "pid": os.getpid(), "workers": loader.worker_pids}
        os.write(1, (json.dumps(report) + "\\n").encode())
        os.write(ready, b"x")  # to the helper
        # Ctrl-C arrives mid-epoch, in the loader or in the loop body (Python's own handler, even
        # when this test runs where SIGINT is ignored)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        while sig == "SIGINT":
            for _ in loader:
                time.sleep(0.01)  # the training step
        time.sleep(300)  # not a wait for anything: the test's signal ends it, or this bound


    if __name__ == "__main__":
        cache = JpegCache.open(sys.argv[1])
        kids, ready = [], []
        for case in json.loads(sys.argv[2]):
            if case[1] == "SIGINT":  # its epochs decode without pause until it is signalled:
                for r in ready:  # it starts once every other parent has reported (or died)
                    os.read(r, 1)
            r, w = os.pipe()
            kids.append(os.fork())
            if kids[-1] == 0:
                parent(cache, w, *case)
                os._exit(0)
            os.close(w)
            ready.append(r)
        for pid in kids:
            os.waitpid(pid, 0)
""")

CASES = [
    (m, s, 4 if m == "fork" else 1)
    for m in ("fork", "spawn", "forkserver")
    for s in ("SIGKILL", "SIGTERM")
] + [("fork", "SIGINT", 4)]
# A parent dies the same way by SIGTERM as by SIGKILL: nothing in it handles SIGTERM, so the
# kernel ends it and no Python code runs (gpucache installs no SIGTERM handler); its workers go
# by the same PR_SET_PDEATHSIG and end-of-file either way. The default run keeps SIGTERM under
# fork and both signals under spawn and forkserver (each of those parents starts interpreters);
# SIGTERM under spawn and forkserver runs with `-m slow`.
SLOW_CASES = [("spawn", "SIGTERM", 1), ("forkserver", "SIGTERM", 1)]


def _parents_killed(store_path, tmp_path_factory, cases):
    """Signal each parent; seconds until its workers (and every other descendant) are gone."""
    script = tmp_path_factory.mktemp("parents") / "parents.py"
    script.write_text(PARENTS)
    helper = subprocess.Popen(
        [sys.executable, str(script), store_path, json.dumps(cases)],
        stdout=subprocess.PIPE,
        text=True,
    )
    tree = psutil.Process(helper.pid)
    try:
        reports = [json.loads(helper.stdout.readline()) for _ in cases]
        results = {}
        for rep in reports:
            case = tuple(rep["case"])
            family = [p.pid for p in psutil.Process(rep["pid"]).children(recursive=True)]
            assert set(rep["workers"]) <= set(family)
            start = time.monotonic()
            os.kill(rep["pid"], getattr(signal, case[1]))
            left = _gone(family, 10)
            took = time.monotonic() - start
            # the parent's own exit after Ctrl-C is interpreter teardown: slow on a busy machine
            results[case] = (took, rep["workers"], left + _gone([rep["pid"]], 60))
        helper.wait(timeout=120)  # interpreter teardown, after torch: slow on a loaded machine
        return results
    finally:  # after a failure: every parent not signalled yet, and its workers, too
        if helper.poll() is None:  # (the helper exits only once every parent is gone)
            for proc in [*tree.children(recursive=True), tree]:
                try:
                    proc.kill()
                except psutil.NoSuchProcess:
                    pass
        helper.wait()


@pytest.fixture(scope="module")
def parents_killed(request, store_path, tmp_path_factory):
    """Every selected case's parent, each signalled in turn."""
    picked = {case for (case,) in selected(request, "test_no_worker_survives_its_parent", "case")}
    return _parents_killed(store_path, tmp_path_factory, [c for c in CASES if c in picked])


# The first case also sets up the fixture: the parents, the spawn and forkserver workers each
# importing torch (30-50 s apiece at load 15 on 2 cores), then each parent's exit.
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, id="-".join(map(str, c)), marks=pytest.mark.slow if c in SLOW_CASES else ())
        for c in CASES
    ],
)
def test_no_worker_survives_its_parent(parents_killed, case):
    took, workers, left = parents_killed[case]
    assert left == [], f"still running {took:.1f} s after {case[1]}: {left}"
    assert took < 3, f"{case}: the workers took {took:.2f} s to go"
    assert len(workers) == case[2]


_CTRL_C_CHILD = textwrap.dedent("""
    import os, signal, sys, threading, time
    # Python's own Ctrl-C handler, even where this test runs with SIGINT ignored (a background
    # job of a non-interactive shell): a child inherits the ignore, and Python keeps it
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from gpucache import GpuCachedLoader, JpegCache
    loader = GpuCachedLoader(JpegCache.open(sys.argv[1]), batch_size=50, num_workers=2,
                             device="cpu", multiprocessing_context="fork")
    it = iter(loader)
    next(it)
    print(*loader.worker_pids, flush=True)
    for pid in loader.worker_pids:  # no more results: the next batch is waited for
        os.kill(pid, signal.SIGSTOP)
    main = threading.get_ident()

    def announce():  # once the main thread waits in the pool, say so (a deadline, no sleep)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            f = sys._current_frames().get(main)
            if f is not None and f.f_code.co_name == "_wait":
                print("waiting", flush=True)
                return
            time.sleep(0.01)  # polling interval, under a deadline

    threading.Thread(target=announce, daemon=True).start()
    import faulthandler  # a hang prints every thread's stack to stderr, for the test to show
    faulthandler.dump_traceback_later(100, exit=True)
    for _ in it:
        pass
""")


@pytest.mark.timeout(180)
def test_ctrl_c_while_waiting_for_a_batch_is_one_plain_keyboard_interrupt(store_path):
    """Ctrl-C in a loop waiting for workers: a KeyboardInterrupt traceback with nothing chained
    (no BlockingIOError from the non-blocking socket that reads like a second failure), and the
    workers stop with it."""
    child = subprocess.Popen(
        [sys.executable, "-c", _CTRL_C_CHILD, store_path],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        pids = [int(p) for p in child.stdout.readline().split()]
        assert len(pids) == 2, child.stderr.read()
        assert child.stdout.readline().strip() == "waiting"
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=120)
    finally:
        child.kill()
    assert child.returncode != 0 and err.rstrip().endswith("KeyboardInterrupt"), err
    assert "BlockingIOError" not in err and "During handling" not in err, err
    assert _gone(pids, 10) == []
