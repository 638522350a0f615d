"""What a listing of objects costs: requests, time and memory an object, for a folder of
``--objects`` objects (``from_folder``) and for ``--named`` URLs spread over a folder of
``--folder`` objects (``from_files``).

The objects exist only in their listings: an S3 server on 127.0.0.1 (``tests/support/s3server.py``,
moto behind its fault layer, in its own process) answers ``ListObjectsV2`` for them from a
:class:`VirtualFolder` (names ``0000000000.jpg``..., 1,000 keys a page), so a million objects need
no upload. The listing runs in another fresh process, after one small listing that makes the
client's own state; measured there: wall seconds, the listing requests the server saw, the RSS
high-water mark beyond the RSS before (``VmHWM``, reset just before; it misses no short peak)
and the RSS the listing keeps once made (the listing alive, after ``gc.collect()``), each per
object.

    nice -n 10 python benchmarks/object_listing.py --objects 1000000 --folder 200000 --named 40
    # the same against another checkout of gpucache (e.g. an earlier commit):
    nice -n 10 python benchmarks/object_listing.py ... --code /path/to/checkout

moto's server is Python on the same cores: the seconds are this server's as much as the
client's; the requests and bytes are the client's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

SERVER = r"""
import sys
from tests.support.s3server import S3Server, VirtualFolder
objects, folder = int(sys.argv[1]), int(sys.argv[2])
server = S3Server()
server.start()
for v in (VirtualFolder("bkt", "big", objects), VirtualFolder("bkt", "wide", folder),
          VirtualFolder("bkt", "warm", 10)):
    server.answer(v, v.matches)
print(server.endpoint, flush=True)
for line in sys.stdin:  # "count": the listing requests so far
    print(server.lists(), flush=True)
server.stop()
"""

CHILD = r"""
import gc, json, sys, time
kind, n, named = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
try:
    from gpucache.ingest.storage._client import filesystem
    from gpucache.ingest.storage._listing import list_folder, list_urls
except ImportError:  # a checkout from before gpucache/ingest/storage/
    from gpucache.ingest._remote import filesystem
    try:
        from gpucache.ingest._listing import list_folder, list_urls
    except ImportError:  # a checkout from before _listing
        from gpucache.ingest._remote import list_folder, list_urls

def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))

fs = filesystem("s3://bkt/", None)
list_folder("s3://bkt/warm/", None, fs)  # the client's own state
gc.collect()
print("ready", flush=True); sys.stdin.readline()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM back to the current RSS
rss0 = status("VmRSS")
t0 = time.perf_counter()
if kind == "folder":
    listing = list_folder("s3://bkt/big/", None, fs)[0]
else:
    step = n // named
    listing = list_urls([f"s3://bkt/wide/c/{i:010d}.jpg" for i in range(0, n, step)], None, fs=fs)
dt = time.perf_counter() - t0
peak = status("VmHWM") - rss0
gc.collect()
kept = status("VmRSS") - rss0
print(json.dumps({"s": dt, "objects": len(listing), "peak": peak, "kept": kept}), flush=True)
"""


def measure(code: Path, server: subprocess.Popen, endpoint: str, kind: str, n: int, named: int):
    env = {
        **os.environ,
        "PYTHONPATH": str(code),
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, kind, str(n), str(named)],
        env=env,
        cwd=code,  # `python -c` puts the working folder first on sys.path
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin and child.stdout and server.stdin and server.stdout
    assert child.stdout.readline().strip() == "ready"
    server.stdin.write("count\n")
    server.stdin.flush()
    before = int(server.stdout.readline())
    child.stdin.write("go\n")
    child.stdin.flush()
    row = json.loads(child.stdout.readline())
    child.wait()
    server.stdin.write("count\n")
    server.stdin.flush()
    row["requests"] = int(server.stdout.readline()) - before
    per = n if kind == "folder" else row["objects"]
    row["peak_b_per_object"] = round(row["peak"] / per, 1)
    row["kept_b_per_object"] = round(row["kept"] / per, 1)
    row["s"] = round(row["s"], 2)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--objects", type=int, default=1_000_000)
    p.add_argument("--folder", type=int, default=200_000)
    p.add_argument("--named", type=int, default=40)
    p.add_argument("--code", type=Path, default=REPO, help="the gpucache checkout to measure")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(args.objects), str(args.folder)],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        endpoint = server.stdout.readline().strip()
        results = {
            "command": " ".join(sys.argv),
            "code": str(args.code),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
            f"Python {platform.python_version()}",
            "date": time.strftime("%Y-%m-%d"),
            "folder": measure(args.code, server, endpoint, "folder", args.objects, 0),
            "named": measure(args.code, server, endpoint, "named", args.folder, args.named),
        }
    finally:
        if server.stdin:
            server.stdin.close()
        server.wait(timeout=60)
    text = json.dumps(results, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
