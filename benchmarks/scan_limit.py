"""What the scan limit costs the sniffer, and what a scan costs libjpeg's decode.

    python benchmarks/scan_limit.py [--photos DIR] [--size 4000]

1. Sniffing (``gpucache.ingest._sniff.sniff``) over the photos in ``--photos`` as they are and
   re-encoded as progressive JPEG (PIL, quality 90): microseconds per file, and what counting the
   scans of the progressive ones costs (``count_scans`` alone on the same bytes). A sequential
   JPEG whose first scan holds every component is not counted.
2. Decoding (``decode_jpeg``, libjpeg-turbo) a ``--size`` x ``--size`` progressive JPEG as encoded
   and with extra end-of-band scans (``tests.support.hostile.extra_scans``): seconds per
   decode and per scan, at the limit (``MAX_SCANS`` scans) and beyond; and the time the sniffer
   takes to refuse one with 20,000 scans. Timings are best of 3, CPU time of this process.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
from pathlib import Path

try:
    import gpucache  # noqa: F401  (installed)
except ImportError:  # run from a source checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from PIL import Image

from gpucache.decode._core import decode_jpeg
from gpucache.ingest._sniff import MAX_SCANS, Kind, SniffError, count_scans, sniff
from gpucache.testing import make_jpeg_bytes
from tests.support.hostile import extra_scans


def best(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        t = time.process_time()
        fn()
        times.append(time.process_time() - t)
    return min(times)


def sniff_cost(name: str, files: list[bytes]) -> None:
    counted = [f for f in files if sniff(memoryview(f)).kind == Kind.JPEG_PROGRESSIVE]
    sos = [f.index(b"\xff\xda") for f in counted]
    whole = best(lambda: [sniff(memoryview(f)) for f in files], 7) / len(files)
    line = (
        f"{name}: {len(files)} files, {sum(map(len, files)) / len(files) / 1e3:.0f} KB mean; "
        f"sniff {whole * 1e6:.1f} us/file"
    )
    if counted:
        count = best(lambda: [count_scans(f, p) for f, p in zip(counted, sos)], 7) / len(counted)
        scans = sorted(count_scans(f, p) for f, p in zip(counted, sos))
        line += (
            f"; {len(counted)} progressive ({scans[0]}-{scans[-1]} scans), counting their "
            f"scans {count * 1e6:.1f} us each"
        )
    print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--photos",
        type=Path,
        default=Path(__file__).resolve().parents[2] / "shared/data/hymenoptera",
    )
    ap.add_argument("--size", type=int, default=4000)
    args = ap.parse_args()
    print(f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; MAX_SCANS={MAX_SCANS}")
    photos = [p.read_bytes() for p in sorted(args.photos.rglob("*.jpg"))]
    if photos:
        sniff_cost("photos as they are", photos)
        progressive = []
        for data in photos:
            buf = io.BytesIO()
            Image.open(io.BytesIO(data)).convert("RGB").save(
                buf, "JPEG", quality=90, progressive=True
            )
            progressive.append(buf.getvalue())
        sniff_cost("photos re-encoded progressive", progressive)
    base = make_jpeg_bytes(args.size, args.size, seed=1, progressive=True)
    own = count_scans(base, base.index(b"\xff\xda"))
    decode = lambda b: decode_jpeg(torch.frombuffer(bytearray(b), dtype=torch.uint8))  # noqa
    t0 = best(lambda: decode(base))
    print(
        f"{args.size}x{args.size} progressive, {own} scans, {len(base) / 1e6:.1f} MB: "
        f"decode {t0:.3f} s"
    )
    for extra in (MAX_SCANS - own, 1000):
        data = extra_scans(base, extra)
        t = best(lambda data=data: decode(data), 1 if extra > MAX_SCANS else 3)
        print(
            f"  + {extra} end-of-band scans ({own + extra} in all): decode {t:.3f} s, "
            f"{(t - t0) / extra * 1e3:.2f} ms a scan"
        )
    hostile = extra_scans(base, 20_000)
    t = time.process_time()
    try:
        sniff(memoryview(hostile))
        raise SystemExit("a JPEG with 20,000 scans was accepted")
    except SniffError:
        pass
    print(
        f"  + 20,000 scans ({len(hostile) / 1e6:.1f} MB): refused by the sniffer in "
        f"{(time.process_time() - t) * 1e3:.2f} ms"
    )


if __name__ == "__main__":
    main()
