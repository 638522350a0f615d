"""Fetching objects from a hostile S3 server on 127.0.0.1 (moto's, behind the fault layer of
``tests/support/s3server.py``), in a bucket named ``my-bucket`` (the manual's example name):

- a GET answered with a redirect (301, 302, 307, 308) to another server on 127.0.0.1 that
  serves other bytes of the same size: that server gets no request, the objects are bad
  samples naming the redirect, nothing of it is stored;
- a body sent a byte at a time ends within the part's deadline (made small here) as a bad
  sample; a body that trickles once is fetched on the next attempt;
- a URL with ``user:password@`` is refused before any request, wherever a URL is taken, and
  the secret reaches no error, log line, output or file;
- a missing object in ``my-bucket`` is a bad sample, a missing prefix "no class folders", a
  missing bucket the bucket's error;
- a full disk (a small tmpfs in a mount namespace of a child process): a failed reservation
  leaves no spool; a store that does not fit names the spool, its size, and resumes from it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("moto.server")
pytest.importorskip("s3fs")

from gpucache import BuildError, JpegCache, ObjectStoreError  # noqa: E402
from gpucache.cli import main as cli_main  # noqa: E402
from gpucache.ingest.storage import _calls, _client, _fetch  # noqa: E402
from gpucache.testing import make_jpeg_bytes  # noqa: E402
from tests.support.s3server import Stranger, serving  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SECRET = "gpucache-URL-SECRET-5d1e"


@pytest.fixture(scope="module")
def s3():
    """The server, its environment set for the module, and ``my-bucket/r/c/{0..5}.jpg`` (the
    manual's blocks use the same bucket name)."""
    images = {f"r/c/{k}.jpg": make_jpeg_bytes(40, 30, seed=k) for k in range(6)}
    with serving("my-bucket", images) as (server, fs):
        yield {
            "server": server,
            "fs": fs,
            "objects": {f"my-bucket/{k}": v for k, v in images.items()},
        }


@pytest.fixture
def fast_retries(monkeypatch):
    monkeypatch.setattr(_calls, "BACKOFF_S", 0.01)
    monkeypatch.setattr(_calls, "BACKOFF_CAP_S", 0.05)


def _other_bytes(data: bytes) -> bytes:
    """A JPEG of the same size with other pixels (its middle scan bytes zeroed)."""
    n = len(data)
    return data[: n // 2] + bytes(n // 8) + data[n // 2 + n // 8 :]


# ------------------------------------------------------------------------- redirects
def test_a_redirect_to_another_server_is_not_followed(s3, tmp_path, fast_retries):
    server, objects = s3["server"], s3["objects"]
    evil = {"/" + k: _other_bytes(v) for k, v in objects.items()}
    with Stranger(lambda path: evil.get(path, b"")) as stranger, server.faulty():
        for k, status in zip(range(1, 5), (301, 302, 307, 308)):
            server.fail(
                "redirect", f"/my-bucket/r/c/{k}.jpg", times=None, status=status,
                location=stranger.url,
            )  # fmt: skip
        cache = JpegCache.from_folder("s3://my-bucket/r/", cache_dir=tmp_path, progress=False)
        with pytest.raises(BuildError, match=r"s3://my-bucket/r/c/1\.jpg.*redirect"):
            JpegCache.from_folder(
                "s3://my-bucket/r/", cache_dir=tmp_path / "b", on_error="raise", progress=False
            )
    assert stranger.requests == []  # never asked, so never answered
    assert _stored(cache) == [
        objects["my-bucket/r/c/0.jpg"],
        *(objects[f"my-bucket/r/c/{k}.jpg"] for k in (5,)),
    ]
    reasons = {s.path: s.reason for s in cache.report.skipped}
    assert sorted(reasons) == [f"s3://my-bucket/r/c/{k}.jpg" for k in range(1, 5)]
    for k, status in zip(range(1, 5), (301, 302, 307, 308)):
        reason = reasons[f"s3://my-bucket/r/c/{k}.jpg"]
        assert f"HTTP {status}" in reason and "not followed" in reason, reason
        assert f"redirect to {stranger.url}/my-bucket/r/c/{k}.jpg" in reason, reason
    assert not set(_stored(cache)) & set(evil.values())


def _stored(cache: JpegCache) -> list[bytes]:
    return [bytes(cache[i]) for i in range(len(cache))]


# ------------------------------------------------------------------------- slow bodies
@pytest.mark.timeout(120)
def test_a_body_that_trickles_ends_within_the_deadline(s3, tmp_path, monkeypatch, fast_retries):
    server, objects = s3["server"], s3["objects"]
    monkeypatch.setattr(_calls, "DEADLINE_S", 3.0)
    monkeypatch.setattr(_fetch, "ATTEMPT_S", 1.0, raising=False)
    with server.faulty():  # a byte every 0.5 s: each read is quicker than the read timeout
        server.fail("trickle", "/my-bucket/r/c/2.jpg", times=None, seconds=0.5)
        server.fail("trickle", "/my-bucket/r/c/3.jpg", times=1, seconds=0.5)  # once
        server.reset_counts()
        t0 = time.monotonic()
        cache = JpegCache.from_folder(
            "s3://my-bucket/r/",
            cache_dir=tmp_path,
            progress=False,
            storage_options={"config_kwargs": {"read_timeout": 5}},
        )
        elapsed = time.monotonic() - t0
    assert [s.path for s in cache.report.skipped] == ["s3://my-bucket/r/c/2.jpg"]
    reason = cache.report.skipped[0].reason
    assert "no complete answer within" in reason and "gave up after" in reason, reason
    assert bytes(cache[2]) == objects["my-bucket/r/c/3.jpg"]
    gets = server.gets("/my-bucket/r/c/")
    assert gets["/my-bucket/r/c/3.jpg"] == 2 and 2 <= gets["/my-bucket/r/c/2.jpg"] <= 4
    assert elapsed < 3.0 + 20, elapsed  # the deadline, and the listing and build around it


# ------------------------------------------------------------------------- credentials in URLs
def test_a_url_with_a_password_is_refused_before_any_request(s3, tmp_path, caplog, capsys):
    server = s3["server"]
    caplog.set_level(logging.DEBUG)
    ok = "s3://my-bucket/r/c/0.jpg"
    bad = f"s3://KEY:{SECRET}@my-bucket/r/c/1.jpg"
    slashed = f"s3://AKIDEXAMPLE:{SECRET}/x+y@my-bucket/r/"  # AWS secrets hold '/' and '+'
    local_csv = tmp_path / "list.csv"
    local_csv.write_text(f"{ok},0\n{bad},1\n")
    cdir = tmp_path / "cache"
    builds = {
        "from_files": lambda: JpegCache.from_files([ok, bad], cache_dir=cdir, progress=False),
        "from_folder": lambda: JpegCache.from_folder(slashed, cache_dir=cdir, progress=False),
        "from_webdataset": lambda: JpegCache.from_webdataset(
            f"s3://KEY:{SECRET}@my-bucket/shards/train-{{000..001}}.tar", progress=False
        ),
        "a local CSV": lambda: JpegCache.from_csv(local_csv, cache_dir=cdir, progress=False),
        "a CSV URL": lambda: JpegCache.from_csv(
            f"s3://KEY:{SECRET}@my-bucket/list.csv", cache_dir=cdir, progress=False
        ),
    }
    server.reset_counts()
    errors = []
    for what, build in builds.items():
        with pytest.raises(ValueError, match=r"user name or password.*storage_options") as err:
            build()
        errors.append(f"{what}: {err.value!r} {err.value}")
        assert "s3://my-bucket/" in str(err.value), what  # the URL named, without its secret
    code = cli_main(
        ["build", slashed, "-o", str(tmp_path / "out.gpucache"), "--cache-dir", str(cdir)]
    )
    assert code != 0 and not (tmp_path / "out.gpucache").exists()
    seen = capsys.readouterr()
    assert "user name or password" in seen.err
    assert sum(server.faults.counts.values()) == 0  # refused before any request
    files = [p for p in tmp_path.rglob("*") if p.is_file() and p != local_csv]
    for blob in [
        seen.out,
        seen.err,
        caplog.text,
        *errors,
        *(p.read_text("latin-1") for p in files),
    ]:
        assert SECRET not in blob


def test_only_a_user_or_password_is_taken_out_of_a_url():
    redact = _client.redact
    assert redact(f"s3://KEY:{SECRET}@b/a.jpg") == "s3://b/a.jpg"
    assert redact(f"s3://KEY:{SECRET}/x+y@b/a.jpg") == "s3://b/a.jpg"
    assert redact("gs://KEY@b/a.jpg") == "gs://b/a.jpg"
    assert redact(f"failed on s3://K:{SECRET}@b/a.jpg: denied") == "failed on s3://b/a.jpg: denied"
    for kept in (
        "s3://b/people/ann@example.com/a:1.jpg",  # '@' and ':' in a key are no user
        "abfs://data@account.dfs.core.windows.net/train/",  # Azure's container@account
        "az://data@127.0.0.1:10000/train/",
    ):
        assert redact(kept) == kept and _client.is_url(kept)
    with pytest.raises(ValueError, match="user name or password"):
        _client.is_url(f"az://user:{SECRET}@account.blob.core.windows.net/data/")


# ------------------------------------------------------------------------- missing objects
def test_a_missing_object_in_a_bucket_named_bucket_is_a_bad_sample(s3, tmp_path, fast_retries):
    cache = JpegCache.from_files(
        ["s3://my-bucket/r/c/0.jpg", "s3://my-bucket/r/c/nothing.jpg"],
        cache_dir=tmp_path,
        progress=False,
    )
    assert len(cache) == 1 and cache.report.skipped[0].path == "s3://my-bucket/r/c/nothing.jpg"
    assert "no such object" in cache.report.skipped[0].reason
    with pytest.raises(FileNotFoundError, match="s3://my-bucket/absent"):
        JpegCache.from_folder("s3://my-bucket/absent/", cache_dir=tmp_path, progress=False)
    with pytest.raises(FileNotFoundError, match="my-bucket/lists/nothing.csv") as err:
        JpegCache.from_csv("s3://my-bucket/lists/nothing.csv", cache_dir=tmp_path, progress=False)
    assert not isinstance(err.value, ObjectStoreError)
    with pytest.raises(ObjectStoreError, match="s3://absent-data does not exist"):
        JpegCache.from_folder("s3://absent-data/train/", cache_dir=tmp_path, progress=False)


# ------------------------------------------------------------------------- full disks
def _can_mount() -> str:
    if shutil.which("unshare") is None:
        return "no unshare(1) here"
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
        capture_output=True,
    )
    return "" if probe.returncode == 0 else f"cannot mount a tmpfs here: {probe.stderr[-200:]!r}"


CHILD = """
import json, subprocess, sys
from pathlib import Path
from gpucache import JpegCache
folder, url, sizes = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
for size in sizes:  # the folder, a tmpfs, made this size (KiB), then a build in it
    subprocess.run(["mount", "-o", f"remount,size={size}k", str(folder)], check=True)
    try:
        JpegCache.from_folder(url, cache_dir=folder, progress=False)
        out = {"error": None}
    except OSError as err:
        out = {"error": str(err), "errno": err.errno}
    out["files"] = {p.name: p.stat().st_size for p in folder.iterdir()}
    print(json.dumps(out), flush=True)
"""


def _in_tmpfs(folder: Path, url: str, sizes: list[int]) -> list[dict]:
    """Builds of ``url`` in a child whose ``folder`` is a tmpfs (in its own mount namespace),
    of each size of ``sizes`` (KiB) in turn; what each gave, as JSON."""
    import shlex

    folder.mkdir()
    build = shlex.join([sys.executable, "-c", CHILD, str(folder), url, *map(str, sizes)])
    script = f"mount -t tmpfs -o size={sizes[0]}k,mode=0700 tmpfs {folder} && {build}"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        ["unshare", "-m", "sh", "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    lines = [json.loads(x) for x in run.stdout.splitlines() if x.startswith("{")]
    assert len(lines) == len(sizes), run.stderr[-3000:]
    return lines


@pytest.fixture(scope="module")
def big(s3):
    """``my-bucket/big/c/{0..7}.jpg``, about 56 KB each."""
    objects = {
        f"my-bucket/big/c/{k}.jpg": make_jpeg_bytes(320, 240, seed=k, quality=95) for k in range(8)
    }
    s3["fs"].pipe(objects)
    return objects


def test_a_full_disk_leaves_no_sparse_spool_and_names_the_spool_it_keeps(s3, big, tmp_path):
    """A disk that holds half the data (the reservation fails: no spool stays), then one and a
    half times (the spool fits, the store does not: named, kept), then four (resumed)."""
    why = _can_mount()
    if why:
        pytest.skip(why)
    server = s3["server"]
    total = sum(map(len, big.values()))
    folder = tmp_path / "disk"
    server.reset_counts()
    small, half, room = _in_tmpfs(
        folder, "s3://my-bucket/big/", [total // 2048, total * 3 // 2048, 4 * total // 1024]
    )
    assert small["errno"] == 28 and "cannot reserve" in small["error"], small
    assert not [n for n in small["files"] if n.endswith((".fetch", ".fetched"))], small["files"]
    assert f"{total / 2**20:,.1f} MiB" in small["error"] and "MiB free there" in small["error"]
    assert half["errno"] == 28, half
    spool = [n for n in half["files"] if n.endswith(".fetch")]
    assert len(spool) == 1 and half["files"][spool[0]] == total
    assert f"The spool {folder / spool[0]}" in half["error"], half["error"]
    assert f"{total / 2**20:,.1f} MiB" in half["error"] and "resumes from it" in half["error"]
    assert not [n for n in half["files"] if n.endswith(".gpucache")]
    assert room["error"] is None and [n for n in room["files"] if n.endswith(".gpucache")]
    assert server.gets("/my-bucket/big/") == {"/" + k: 1 for k in big}  # the last fetched none
