"""Data in object storage, against a real S3 server on 127.0.0.1 (moto's, ``tests/support/
s3server.py``), credentials and endpoint from the standard environment variables alone.

- ``from_folder`` of an ``s3://`` prefix, ``from_webdataset`` of a brace pattern, ``from_files``
  and ``from_csv`` of object URLs and ``gpucache build s3://...`` give exactly the bytes, labels
  and classes of the same files built from the disk; each object is fetched once, and a second
  build of the same listing fetches nothing.
- faults (through the server's fault layer): 503s, dropped connections, bodies cut short and a
  server slower than the read timeout are retried; an object that stays unreadable is a bad
  sample named by URL with its reason; a build killed midway publishes nothing and resumes
  without fetching what it had recorded; objects rewritten during the build stop it; a missing
  or denied bucket is a clear error naming the bucket.
- no secret reaches a store, the node folder, a log line, an error or ``gpucache info``.
- two nodes of two ranks (processes forked with torchrun's variables, a TMPDIR a node): one fetch
  of each object per node, one store a node that both its ranks map, every sample once per
  epoch across the ranks' loaders.
"""

from __future__ import annotations

import io
import logging
import tarfile
import time
from pathlib import Path

import pytest

pytest.importorskip("moto.server")
pytest.importorskip("s3fs")

from gpucache import BuildError, JpegCache, ObjectStoreError  # noqa: E402
from gpucache.cli import main as cli_main  # noqa: E402
from gpucache.ingest.storage import _calls  # noqa: E402
from gpucache.testing import make_jpeg_bytes, make_jpeg_folder  # noqa: E402
from tests.support import forked  # noqa: E402
from tests.support.s3server import S3Server  # noqa: E402

SECRET = "gpucache-SECRET-do-not-leak-7f3a"


def _stored(cache: JpegCache) -> list[bytes]:
    return [bytes(cache[i]) for i in range(len(cache))]


def _same(remote: JpegCache, local: JpegCache) -> None:
    assert _stored(remote) == _stored(local)
    assert remote.labels.tolist() == local.labels.tolist()
    assert remote.classes == local.classes


def _shard(path: Path, keys: range) -> None:
    with tarfile.open(path, "w") as tf:
        for k in keys:
            for ext, data in (
                ("jpg", make_jpeg_bytes(40, 30, seed=k)),
                ("cls", str(k % 3).encode()),
            ):
                info = tarfile.TarInfo(f"{k:06d}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """The server, its environment set for the whole module, and the data uploaded to it."""
    import s3fs

    base = tmp_path_factory.mktemp("s3data")
    server = S3Server()
    server.start()
    try:
        with pytest.MonkeyPatch.context() as mp:
            for k, v in server.env(SECRET).items():
                mp.setenv(k, v)
            fs = s3fs.S3FileSystem(skip_instance_cache=True)
            if not fs.exists("bkt"):  # moto keeps buckets per process, past a server
                fs.mkdir("bkt")
            train = make_jpeg_folder(base / "train", 12, classes=("ant", "bee", "cat"), seed=3)
            ddp = base / "ddp"  # one image a class: a label names its sample
            for i in range(8):
                (ddp / f"c{i}").mkdir(parents=True)
                (ddp / f"c{i}" / "x.jpg").write_bytes(make_jpeg_bytes(36, 28, seed=40 + i))
            small = make_jpeg_folder(base / "small", 12, classes=("a", "b"), seed=9)
            (base / "shards").mkdir()
            for s in range(4):
                _shard(base / "shards" / f"train-{s:03d}.tar", range(3 * s, 3 * s + 3))
            uploads = {}
            for name, root in (
                ("train", train),
                ("ddp", ddp),
                ("small", small),
                ("shards", base / "shards"),
            ):
                for p in sorted(root.rglob("*")):
                    if p.is_file():
                        uploads[f"bkt/{name}/{p.relative_to(root).as_posix()}"] = p.read_bytes()
            fs.pipe(uploads)
            yield {
                "server": server,
                "fs": fs,
                "train": train,
                "ddp": ddp,
                "small": small,
                "shards": sorted((base / "shards").glob("*.tar")),
            }
    finally:
        server.stop()


@pytest.fixture
def fast_retries(monkeypatch):
    monkeypatch.setattr(_calls, "BACKOFF_S", 0.01)
    monkeypatch.setattr(_calls, "BACKOFF_CAP_S", 0.05)


def _objects(root: Path, prefix: str) -> list[str]:
    return [f"/bkt/{prefix}/{p.relative_to(root).as_posix()}" for p in sorted(root.rglob("*.jpg"))]


# ------------------------------------------------------------------------- the same as from disk
def test_folder_from_s3_is_the_local_build_fetched_once_per_listing(s3, tmp_path):
    server = s3["server"]
    server.reset_counts()
    cache = JpegCache.from_folder("s3://bkt/train/", cache_dir=tmp_path, progress=False)
    _same(cache, JpegCache.from_folder(s3["train"], progress=False))
    assert cache.paths[0] == "s3://bkt/train/ant/ant_00000.jpg"
    gets = server.gets("/bkt/train/")
    assert gets == {p: 1 for p in _objects(s3["train"], "train")}
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".gpucache", ".info"]  # no spool
    server.reset_counts()
    again = JpegCache.from_folder("s3://bkt/train", cache_dir=tmp_path, progress=False)
    assert _stored(again) == _stored(cache) and not server.gets("/bkt/train/")  # listed only


def test_shards_csv_and_file_lists_of_urls(s3, tmp_path):
    server = s3["server"]
    server.reset_counts()
    remote = JpegCache.from_webdataset(
        "s3://bkt/shards/train-{000..003}.tar", cache_dir=tmp_path / "a", progress=False
    )
    _same(remote, JpegCache.from_webdataset(s3["shards"], progress=False))
    assert remote.paths[0] == "s3://bkt/shards/train-000.tar/000000.jpg"
    assert len(remote) == 12 and set(server.gets("/bkt/shards/").values()) == {1}

    files = sorted(s3["small"].rglob("*.jpg"))
    urls = [f"s3://bkt/small/{p.relative_to(s3['small']).as_posix()}" for p in files]
    labels = [int(p.parent.name == "b") for p in files]
    listed = JpegCache.from_files(urls, labels, cache_dir=tmp_path / "b", progress=False)
    assert _stored(listed) == [p.read_bytes() for p in files] and listed.labels.tolist() == labels
    csv = tmp_path / "list.csv"
    csv.write_text("path,label\n" + "".join(f"{u},{p.parent.name}\n" for u, p in zip(urls, files)))
    from_csv = JpegCache.from_csv(csv, cache_dir=tmp_path / "c", progress=False)
    assert _stored(from_csv) == _stored(listed) and from_csv.classes == ["a", "b"]
    # a CSV in the bucket, its rows relative to it
    s3["fs"].pipe_file(
        "bkt/small/list.csv",
        "".join(
            f"{p.relative_to(s3['small']).as_posix()},{p.parent.name}\n" for p in files
        ).encode(),
    )
    in_bucket = JpegCache.from_csv(
        "s3://bkt/small/list.csv", cache_dir=tmp_path / "d", progress=False
    )
    assert _stored(in_bucket) == _stored(listed) and in_bucket.paths[0] == urls[0]
    with pytest.raises(ValueError, match="mixes URLs"):
        JpegCache.from_files([urls[0], str(files[1])], progress=False)


def test_cli_builds_a_store_from_a_prefix(s3, tmp_path, capsys):
    out = tmp_path / "train.gpucache"
    assert (
        cli_main(
            [
                "build",
                "s3://bkt/train/",
                "-o",
                str(out),
                "--cache-dir",
                str(tmp_path / "c"),
                "--requests",
                "4",
            ]
        )
        == 0
    )
    _same(JpegCache.open(out), JpegCache.from_folder(s3["train"], progress=False))
    assert cli_main(["info", str(out)]) == 0
    assert "12 samples" in capsys.readouterr().out


# ------------------------------------------------------------------------- faults
def test_transient_faults_are_retried(s3, tmp_path, fast_retries):
    server = s3["server"]
    objs = _objects(s3["small"], "small")
    with server.faulty():
        server.fail("status", objs[0], times=2)  # 503 SlowDown, twice
        server.fail("status", objs[1], times=1, status=500, code="InternalError")
        server.fail("drop", objs[2], times=1)  # connection closed before any response
        server.fail("cut", objs[3], times=1)  # half the body, then the connection goes
        # slower than the read timeout; the timeout leaves room for a loaded machine (two test
        # workers on two cores), where an answer can take longer than half a second
        server.fail("delay", objs[4], times=1, seconds=8.0)
        server.reset_counts()
        cache = JpegCache.from_folder(
            "s3://bkt/small/",
            cache_dir=tmp_path,
            progress=False,
            storage_options={"config_kwargs": {"read_timeout": 2.0}},
            requests_in_flight=4,
        )
    _same(cache, JpegCache.from_folder(s3["small"], progress=False))
    assert cache.report.skipped == []
    gets = server.gets("/bkt/small/")
    assert [gets[p] for p in objs[:5]] == [3, 2, 2, 2, 2]
    assert all(gets[p] == 1 for p in objs[5:])


def test_an_object_that_stays_unreadable_is_a_bad_sample(s3, tmp_path, fast_retries):
    server = s3["server"]
    objs = _objects(s3["small"], "small")
    with server.faulty():
        server.fail("status", objs[5], times=None)  # 503 on every attempt
        server.fail("status", objs[6], times=None, status=403, code="AccessDenied")
        server.reset_counts()
        cache = JpegCache.from_folder("s3://bkt/small/", cache_dir=tmp_path / "a", progress=False)
        assert len(cache) == 10 and cache.report.total == 12
        reasons = {s.path: s.reason for s in cache.report.skipped}
        assert set(reasons) == {f"s3:/{objs[5]}", f"s3:/{objs[6]}"}
        assert "SlowDown" in reasons[f"s3:/{objs[5]}"] and "6 attempts" in reasons[f"s3:/{objs[5]}"]
        assert "403" in reasons[f"s3:/{objs[6]}"]
        gets = server.gets("/bkt/small/")
        assert gets[objs[5]] == _calls.RETRIES + 1 and gets[objs[6]] == 1  # bounded; 403 final
        with pytest.raises(BuildError, match=f"s3:/{objs[5]}"):
            JpegCache.from_folder(
                "s3://bkt/small/", cache_dir=tmp_path / "b", on_error="raise", progress=False
            )
        # a listed URL with no object: a bad sample with that reason, not a hole
        listed = JpegCache.from_files(
            ["s3://bkt/small/a/nothing.jpg", f"s3:/{objs[0]}"],
            cache_dir=tmp_path / "c",
            progress=False,
        )
        assert len(listed) == 1 and "no such object" in listed.report.skipped[0].reason


def _builds_train(cdir: Path) -> None:
    JpegCache.from_folder("s3://bkt/train/", cache_dir=cdir, progress=False, requests_in_flight=1)


def test_a_killed_build_publishes_nothing_and_resumes_without_refetching(s3, tmp_path):
    server = s3["server"]
    cdir = tmp_path / "cache"
    with server.faulty():
        server.fail("delay", "/bkt/train/", times=None, seconds=0.1)  # a slow server
        server.reset_counts()
        proc = forked.start(_builds_train, cdir)  # a build in a forked child, killed below
        try:
            journal = None
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and proc.is_alive():
                found = list(cdir.glob("*.fetched")) if cdir.exists() else []
                if found and found[0].stat().st_size >= 4 * 12:  # 4 objects recorded
                    journal = found[0]
                    break
                time.sleep(0.05)  # polling the child's journal, under the deadline
            assert journal is not None, f"no progress (exit code {proc.exitcode})"
        finally:
            proc.kill()
            proc.join(timeout=60)
    assert not list(cdir.glob("*.gpucache")), "a partial store was published"
    recorded = journal.read_bytes()
    parts = {
        int.from_bytes(recorded[k : k + 8], "little") for k in range(0, len(recorded) - 11, 12)
    }
    objs = _objects(s3["train"], "train")
    first = server.gets("/bkt/train/")
    server.reset_counts()
    cache = JpegCache.from_folder("s3://bkt/train/", cache_dir=cdir, progress=False)
    _same(cache, JpegCache.from_folder(s3["train"], progress=False))
    second = server.gets("/bkt/train/")
    assert 4 <= len(parts) < len(objs)
    assert all(second[objs[p]] == 0 for p in parts), (
        "an object recorded before the kill was fetched again"
    )
    assert sum(second.values()) == len(objs) - len(parts)
    assert all(first[p] + second[p] <= 2 for p in objs)  # only one in flight at the kill
    assert sorted(p.suffix for p in cdir.iterdir()) == [".gpucache", ".info"]


def test_objects_rewritten_during_the_build_stop_it(s3, tmp_path):
    server, fs = s3["server"], s3["fs"]
    fs.pipe({f"bkt/chg/c/{k}.jpg": make_jpeg_bytes(30, 20, seed=k) for k in range(3)})

    def rewrite(path):
        fs.pipe_file("bkt/chg/c/2.jpg", make_jpeg_bytes(31, 20, seed=99))

    with server.faulty():
        server.fail("hook", "/bkt/chg/c/0.jpg", times=1, hook=rewrite)
        with pytest.raises(ObjectStoreError, match=r"changed.*s3://bkt/chg/c/2.jpg"):
            JpegCache.from_folder(
                "s3://bkt/chg/", cache_dir=tmp_path, progress=False, requests_in_flight=1
            )
    assert not [p for p in tmp_path.iterdir() if p.suffix in (".gpucache", ".fetch", ".fetched")]
    cache = JpegCache.from_folder("s3://bkt/chg/", cache_dir=tmp_path, progress=False)
    assert bytes(cache[2]) == make_jpeg_bytes(31, 20, seed=99)  # the data set as it is now


def test_missing_and_denied_buckets_are_clear_errors(s3, tmp_path, fast_retries):
    server = s3["server"]
    with pytest.raises(ObjectStoreError, match=r"s3://nobucket.*AWS_ENDPOINT_URL"):
        JpegCache.from_folder("s3://nobucket/train/", cache_dir=tmp_path, progress=False)
    with server.faulty():
        server.fail(
            "status", lambda p: p.rstrip("/") == "/bkt", times=None, status=403, code="AccessDenied"
        )
        with pytest.raises(ObjectStoreError, match=r"s3://bkt.*denied.*AWS_ACCESS_KEY_ID"):
            JpegCache.from_folder("s3://bkt/train/", cache_dir=tmp_path, progress=False)
    with server.faulty():  # listing allowed, every read denied: stop early, not 12 bad samples
        server.fail("status", "/bkt/train/", times=None, status=403, code="AccessDenied")
        with pytest.raises(
            ObjectStoreError, match=r"cannot read s3://bkt/train/.*denied.*s3:GetObject"
        ):
            JpegCache.from_folder("s3://bkt/train/", cache_dir=tmp_path, progress=False)
    with pytest.raises(ValueError, match="as a string: 's3://bkt/train'"):
        JpegCache.from_folder(Path("s3://bkt/train"), progress=False)
    with pytest.raises(ValueError, match=r"http://.*s3://"):
        JpegCache.from_folder("http://example.invalid/train/", progress=False)  # nothing sent
    try:
        import gcsfs  # noqa: F401
    except ImportError:  # gs:// goes through the same code, with gcsfs: the fix is named
        with pytest.raises(
            ImportError, match=r"pip install gcsfs \(a clone's extra: pip install -e '\.\[gcs\]'\)"
        ):
            JpegCache.from_folder("gs://bkt/train/", progress=False)


def test_no_secret_reaches_a_store_a_record_a_log_or_an_error(
    s3, tmp_path, caplog, capsys, fast_retries
):
    server = s3["server"]
    caplog.set_level(logging.DEBUG)
    objs = _objects(s3["small"], "small")
    other = "gpucache-OPTION-secret-91be"
    with server.faulty():
        server.fail("status", objs[0], times=None, status=503)
        env_built = JpegCache.from_folder(
            "s3://bkt/small/", cache_dir=tmp_path / "env", progress=False
        )
        opt_built = JpegCache.from_folder(
            "s3://bkt/small/",
            cache_dir=tmp_path / "opt",
            progress=False,
            storage_options={"key": "gpucache-test-key", "secret": other},
        )
    assert len(env_built) == len(opt_built) == 11
    errors = []
    for bad in ("s3://nobucket/x/",):
        try:
            JpegCache.from_folder(
                bad,
                cache_dir=tmp_path / "err",
                progress=False,
                storage_options={"secret": other, "key": "k"},
            )
        except Exception as err:  # noqa: BLE001 - every error's text is checked
            errors.append(f"{err!r} {err}")
    with server.faulty():
        server.fail(
            "status", lambda p: p.rstrip("/") == "/bkt", times=None, status=403, code="AccessDenied"
        )
        try:
            JpegCache.from_folder("s3://bkt/small/", cache_dir=tmp_path / "err", progress=False)
        except ObjectStoreError as err:
            errors.append(f"{err!r} {err}")
    assert len(errors) == 2
    out = tmp_path / "env" / "out.gpucache"  # the store the node cache holds, through the CLI
    build = ["build", "s3://bkt/small/", "-o", str(out), "--cache-dir", str(out.parent)]
    assert cli_main(build) == 0 and cli_main(["info", "--skipped", str(out)]) == 0
    seen = capsys.readouterr()
    texts = [seen.out, seen.err, caplog.text, *errors]
    files = [
        p
        for d in (tmp_path / "env", tmp_path / "opt", tmp_path / "err")
        if d.exists()
        for p in d.iterdir()
    ]
    assert files and any(p.suffix == ".gpucache" for p in files)
    for secret in (SECRET, other):
        for blob in [*(t.encode() for t in texts), *(p.read_bytes() for p in files)]:
            assert secret.encode() not in blob
            assert secret.encode().hex().encode() not in blob
        for p in files:
            assert secret not in p.name


# ------------------------------------------------------------------------- two nodes
def _rank_builds(env: dict, out: Path) -> None:
    """A rank, forked from this process: the variables torchrun sets for it, its node's TMPDIR,
    then the build of the bucket's prefix; ``out``: the store's path."""
    forked.as_launched(env)
    cache = JpegCache.from_folder("s3://bkt/ddp/", progress=False)
    out.write_text(str(cache.path))


def test_two_nodes_fetch_each_object_once_per_node(s3, tmp_path):
    """Two nodes of two ranks, each rank a process forked from this one (the library already
    imported) with the variables torchrun sets and its node's TMPDIR (tests/test_distributed.py
    and tests/test_node_shares_jobs.py run torchrun itself); the ranks' loaders, as the ranks of
    pipelines/ddp_example.py make them, then read each node's store."""
    from gpucache import GpuCachedLoader

    server = s3["server"]
    server.reset_counts()
    ranks = []
    for node in range(2):
        (tmp_path / f"node{node}").mkdir()
        for local in range(2):
            env = forked.rank_env(tmp_path / f"node{node}", node, local, 2, 2)
            out = tmp_path / f"rank{env['RANK']}"
            ranks.append((node, forked.start(_rank_builds, env, out), out))
    forked.join_all([proc for _, proc, _ in ranks])
    assert [proc.exitcode for _, proc, _ in ranks] == [0] * 4
    gets = server.gets("/bkt/ddp/")
    assert gets == {f"/bkt/ddp/c{i}/x.jpg": 2 for i in range(8)}, gets  # once per node
    paths = []
    for node in range(2):
        stores = list((tmp_path / f"node{node}").rglob("*.gpucache"))
        assert len(stores) == 1
        mapped = {out.read_text() for k, _, out in ranks if k == node}
        assert mapped == {str(stores[0])}  # both ranks of the node map the node's one store
        paths.append(stores[0])
    seen = []  # batches of 2, a shared seed, 4 replicas: what each rank plays, 2 epochs
    for rank in range(4):
        loader = GpuCachedLoader(
            JpegCache.open(paths[rank // 2]),
            batch_size=2,
            shuffle=True,
            seed=11,
            num_replicas=4,
            rank=rank,
            num_workers=0,
        )
        seen.append([[x for _, y in loader for x in y.tolist()] for _ in range(2)])
        loader.close()
    for epoch in range(2):
        assert sorted(x for rank in seen for x in rank[epoch]) == list(range(8))


def test_cache_clean_removes_a_spool_left_by_a_killed_build(tmp_path):
    from gpucache.node._clean import clean

    key = "0123456789abcdef" * 2
    spool = [tmp_path / f"{key}.{ext}" for ext in ("fetch", "fetched", "kept")]
    for p in spool:
        p.write_bytes(b"x" * 12)
    clean(tmp_path, older_than=3600)  # fresh: kept for the build that resumes
    assert all(p.exists() for p in spool)
    removed = clean(tmp_path, everything=True)
    assert sorted(removed.leftovers) == sorted(spool) and not any(p.exists() for p in spool)
