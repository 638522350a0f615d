"""Building from object storage against building from the same files on a local disk.

Starts an S3 server on 127.0.0.1 (moto's, a separate process, a free port), uploads two data sets
made here, and builds each in a fresh process, ``--repeat`` times, medians reported:

- ``small``: ``--objects`` small JPEGs (80x60, about 3 KB, a pool of 1,000 distinct encodes) in an
  ImageFolder layout of 100 classes: ``from_folder("s3://bench/small/")`` against
  ``from_folder(local copy)``;
- ``shards``: ``--shards`` WebDataset tar shards of about ``--shard-mb`` MB each (640x480 JPEGs):
  ``from_webdataset("s3://bench/shards/train-{000..N}.tar")`` against the local shards.

Every build goes through the node cache (``cache_dir=`` a fresh folder: list, fetch or read, build,
save), the remote ones with each ``--requests`` value (requests in flight). Reported per build:
wall seconds, objects/s (samples for the folder, shards for the shards), MB/s, and peak memory
beyond the process before the build, in all and per sample beyond the data: as PSS without the
shared libraries (``gpucache.testing``'s ``pss``, from ``/proc/self/smaps``, sampled every 50 ms
in a thread of the building process; a library's share moves with the machine's other
processes) and as the RSS high-water mark (``VmHWM``, reset just before the build; it misses no
short peak). Each build's stored bytes are hashed and
must equal the local build's.

``--listing-memory N`` measures only what an object costs the listing and the fetch's arrays
(RSS before and after making them for N synthetic ImageNet-like URLs; no server, no data).

``--raw`` also times the clients alone on the small objects, at each ``--requests``: fsspec/s3fs
(``cat_file`` from a thread pool, what gpucache runs) and obstore (``get_async`` under an asyncio
semaphore), objects/s, when obstore is installed.

    nice -n 10 python benchmarks/object_storage.py --objects 10000 --shards 4 --shard-mb 64 \\
        --requests 8,32,64 --repeat 3 --raw --json benchmarks/results/object-storage.json

What this measures is the local server's speed as much as gpucache's: moto is a Python server
(one process, a thread a request, no keep-alive), far slower per request than S3 or GCS, and it
shares the machine's cores with the build. The ratio to a local build is an upper bound of the
cost on that server; against a real service the latency per request (10-100 ms) matters more,
which is what many requests in flight are for.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # benchmarks._record
from benchmarks._record import run_info, run_line, write_json  # noqa: E402

CLASSES, POOL = 100, 1000

CHILD = r"""
import hashlib, json, os, sys, threading, time
from gpucache import JpegCache
from gpucache.testing._memory import pss

kind, src, cache_dir, requests = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
peak, stop = [0], threading.Event()

def sample():  # PSS less the shared libraries (whose share moves with the machine's other processes)
    while not stop.is_set():
        peak[0] = max(peak[0], pss(os.getpid(), without_libraries=True))
        stop.wait(0.05)

def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM back to the current RSS
rss0, before = status("VmRSS"), pss(os.getpid(), without_libraries=True)
threading.Thread(target=sample, daemon=True).start()
kw = dict(cache_dir=cache_dir, progress=False)
if src.startswith("s3://"):
    kw["requests_in_flight"] = requests
t0 = time.perf_counter()
if kind == "small":
    cache = JpegCache.from_folder(src, **kw)
else:
    cache = JpegCache.from_webdataset(src if src.startswith("s3://") else sorted(
        os.path.join(src, f) for f in os.listdir(src)), **kw)
dt = time.perf_counter() - t0
stop.set()
peak[0] = max(peak[0], pss(os.getpid(), without_libraries=True))
h = hashlib.blake2b(digest_size=16)
for i in range(len(cache)):
    h.update(cache[i])
h.update(cache.labels.tobytes())
print(json.dumps({"s": dt, "n": len(cache), "data": cache.nbytes, "peak_pss": peak[0] - before,
                  "peak_rss": status("VmHWM") - rss0, "hash": h.hexdigest()}))
"""

RAW = r"""
import asyncio, json, os, sys, time
from concurrent.futures import ThreadPoolExecutor
endpoint, requests, keys = sys.argv[1], int(sys.argv[2]), json.loads(sys.stdin.read())
out = {}
import fsspec
fs = fsspec.filesystem("s3", skip_instance_cache=True, use_listings_cache=False)
t0 = time.perf_counter()
with ThreadPoolExecutor(requests) as pool:
    got = sum(len(b) for b in pool.map(lambda k: fs.cat_file(k[0], start=0, end=k[1]), keys))
out["fsspec"] = {"s": time.perf_counter() - t0, "bytes": got}
try:
    import obstore
    from obstore.store import S3Store
except ImportError:
    obstore = None
if obstore is not None:
    store = S3Store("bench", endpoint=endpoint, region="us-east-1", client_options={"allow_http": True},
                    access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
                    secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"])
    async def main():
        sem = asyncio.Semaphore(requests)
        async def one(k):
            async with sem:
                r = await obstore.get_async(store, k[0].split("/", 1)[1])
                return len(await r.bytes_async())
        return sum(await asyncio.gather(*(one(k) for k in keys)))
    t0 = time.perf_counter()
    got = asyncio.run(main())
    out["obstore"] = {"s": time.perf_counter() - t0, "bytes": got, "version": obstore.__version__}
print(json.dumps(out))
"""


MEMORY = r"""
import gc, json, sys
from pathlib import Path
import numpy as np
from gpucache.ingest.storage._fetch import Spool
from array import array
from gpucache.ingest.storage._listing import _Names, _Packer
from gpucache.ingest.storage._client import _tag_hash

def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))

n, folders = int(sys.argv[1]), 1000
gc.collect(); r0 = rss()
pack = _Packer()
for c in range(folders):  # ImageNet-like names: s3://bucket/imagenet/train/n00000042/n00000042_00017.JPEG
    names = [f"n{c:08d}_{i:05d}.JPEG" for i in range(n // folders)]
    tags = array("Q", [_tag_hash(f'"{c}-{i}"') for i in range(len(names))])
    pack.add(f"s3://bucket/imagenet/train/n{c:08d}/",
             _Names.of(names, array("q", [110_000]) * len(names), tags))
listing = pack.listing("s3")
del pack; gc.collect(); r1 = rss()
spool = Spool(Path("/nonexistent/0"), listing, None, progress=False)
done = np.zeros(int(spool.first_part[-1]), dtype=bool)  # what the fetch adds: what is done,
parts_of = np.diff(spool.first_part).astype(np.int32)  # parts an object, parts there
have = np.zeros(len(parts_of), dtype=np.int32)
gc.collect(); r2 = rss()
print(json.dumps({"objects": len(listing), "name_bytes": 20, "listing_b_per_object": (r1 - r0) / n,
                  "fetch_b_per_object": (r2 - r1) / n}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int) -> subprocess.Popen:
    code = (
        "import logging, threading; from moto.server import ThreadedMotoServer; "
        f"s = ThreadedMotoServer(ip_address='127.0.0.1', port={port}, verbose=False); s.start(); "
        "logging.getLogger('werkzeug').setLevel(logging.ERROR); print('ready', flush=True); "
        "import sys; sys.stdin.read()"  # until this script ends, however it ends
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    line = proc.stdout.readline()
    if "ready" not in line:
        proc.kill()
        raise SystemExit("the S3 server did not start")
    return proc


def make_small(root: Path, n: int) -> Path:
    tree = root / f"small{n}"
    if (tree / ".complete").exists():
        return tree
    from gpucache.testing import make_jpeg_bytes

    pool = [make_jpeg_bytes(80, 60, seed=k, quality=85) for k in range(POOL)]
    for i in range(n):
        d = tree / f"c{i % CLASSES:03d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i:07d}.jpg").write_bytes(pool[i % POOL])
    (tree / ".complete").touch()
    return tree


def make_shards(root: Path, count: int, mb: int) -> Path:
    folder = root / f"shards{count}x{mb}"
    if (folder / ".complete").exists():
        return folder
    import io

    from gpucache.testing import make_jpeg_bytes

    folder.mkdir(parents=True, exist_ok=True)
    pool = [make_jpeg_bytes(640, 480, seed=k, quality=92) for k in range(64)]
    k = 0
    for s in range(count):
        with tarfile.open(folder / f"train-{s:03d}.tar", "w") as tf:
            size = 0
            while size < mb * 1e6:
                for ext, data in (("jpg", pool[k % len(pool)]), ("cls", str(k % 10).encode())):
                    info = tarfile.TarInfo(f"{k:08d}.{ext}")
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
                    size += len(data) + 1024
                k += 1
    (folder / ".complete").touch()
    return folder


def upload(fs, local: Path, prefix: str) -> list[tuple[str, int]]:
    files = sorted(p for p in local.rglob("*") if p.is_file() and not p.name.startswith("."))
    keys = [(f"bench/{prefix}/{p.relative_to(local).as_posix()}", p.stat().st_size) for p in files]
    if len(fs.find(f"bench/{prefix}/")) != len(keys):
        for s in range(0, len(files), 500):
            fs.pipe({k: p.read_bytes() for (k, _), p in zip(keys[s : s + 500], files[s : s + 500])})
    return keys


def child(env: dict, kind: str, src: str, requests: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="gpucache-objbench-") as cache_dir:
        out = subprocess.run(
            [sys.executable, "-c", CHILD, kind, src, cache_dir, str(requests)],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def summary(runs: list[dict], count: int, nbytes: int) -> dict:
    s = statistics.median(r["s"] for r in runs)
    peak = statistics.median(r["peak_pss"] for r in runs)
    hwm = statistics.median(r["peak_rss"] for r in runs)
    n = runs[0]["n"]
    return {
        "s": round(s, 2),
        "runs_s": [round(r["s"], 2) for r in runs],
        "objects_per_s": round(count / s, 1),
        "mb_per_s": round(nbytes / s / 1e6, 1),
        "samples": n,
        "data_bytes": runs[0]["data"],
        "peak_pss_mib": round(peak / 2**20, 1),
        "peak_beyond_data_b_per_sample": round((peak - runs[0]["data"]) / n, 1),
        "peak_rss_mib": round(hwm / 2**20, 1),
        "peak_rss_beyond_data_b_per_sample": round((hwm - runs[0]["data"]) / n, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--objects", type=int, default=10000)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--shard-mb", type=int, default=64)
    p.add_argument("--requests", default="8,32,64")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--raw", action="store_true", help="also time fsspec and obstore alone")
    p.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()) / "gpucache-objbench")
    p.add_argument("--json", type=Path)
    p.add_argument(
        "--listing-memory",
        type=int,
        default=0,
        metavar="N",
        help="only measure the bytes an object costs a listing and a fetch, with N synthetic URLs "
        "(no server)",
    )
    args = p.parse_args()
    if args.listing_memory:
        out = subprocess.run(
            [sys.executable, "-c", MEMORY, str(args.listing_memory)],
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            check=True,
        )
        print(out.stdout.strip())
        return
    requests = [int(r) for r in args.requests.split(",")]

    small = make_small(args.root, args.objects)
    shards = make_shards(args.root, args.shards, args.shard_mb)
    port = free_port()
    server = start_server(port)
    endpoint = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
    }
    os.environ.update({k: env[k] for k in env if k.startswith("AWS_")})
    run = run_info()
    print(run_line(), flush=True)
    results: dict = {
        "server": "moto ThreadedMotoServer on 127.0.0.1, its own process",
    }
    try:
        import fsspec

        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        if not fs.exists("bench"):
            fs.mkdir("bench")
        t0 = time.perf_counter()
        small_keys = upload(fs, small, "small")
        shard_keys = upload(fs, shards, "shards")
        results["upload_s"] = round(time.perf_counter() - t0, 1)
        small_bytes = sum(s for _, s in small_keys)
        shard_bytes = sum(s for _, s in shard_keys)
        results["small"] = {"objects": len(small_keys), "bytes": small_bytes}
        results["shards"] = {"objects": len(shard_keys), "bytes": shard_bytes}
        pattern = f"s3://bench/shards/train-{{000..{args.shards - 1:03d}}}.tar"
        for kind, local, remote, count, nbytes in (
            ("small", str(small), "s3://bench/small/", len(small_keys), small_bytes),
            ("shards", str(shards), pattern, len(shard_keys), shard_bytes),
        ):
            child(env, kind, local, 0)  # warm-up: page cache, imports
            runs = [child(env, kind, local, 0) for _ in range(args.repeat)]
            results[kind]["local"] = summary(runs, count, nbytes)
            want = runs[0]["hash"]
            print(kind, "local", results[kind]["local"], flush=True)
            for r in requests:
                runs = [child(env, kind, remote, r) for _ in range(args.repeat)]
                assert all(x["hash"] == want for x in runs), f"{kind} @ {r}: the bytes differ"
                results[kind][f"remote_{r}"] = row = summary(runs, count, nbytes)
                row["vs_local"] = round(row["s"] / results[kind]["local"]["s"], 2)
                print(kind, "requests", r, row, flush=True)
        if args.raw:
            results["raw"] = {}
            for r in requests:
                rows = []
                for _ in range(args.repeat):
                    out = subprocess.run(
                        [sys.executable, "-c", RAW, endpoint, str(r)],
                        input=json.dumps(small_keys),
                        env=env,
                        capture_output=True,
                        text=True,
                        check=True,
                    )
                    rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
                results["raw"][str(r)] = {
                    client: {
                        "objects_per_s": round(
                            len(small_keys) / statistics.median(x[client]["s"] for x in rows), 1
                        ),
                        **(
                            {"version": rows[0][client]["version"]}
                            if "version" in rows[0][client]
                            else {}
                        ),
                    }
                    for client in rows[0]
                }
                print("raw", r, results["raw"][str(r)], flush=True)
    finally:
        server.kill()
        server.wait()
    print(json.dumps(results, indent=1))
    if args.json:
        write_json(args.json, results, run=run)


if __name__ == "__main__":
    main()
