"""What a scan costs libjpeg's decode, what the scan walk costs the sniffer, and what the work
budget lets through.

    python benchmarks/scan_limit.py [--photos DIR] [--size 4000] [--attack]

1. Sniffing (``gpucache.ingest._sniff.sniff``) the photos in ``--photos`` as they are and
   re-encoded as progressive JPEG (PIL, quality 90): microseconds per file; a sequential JPEG
   whose first scan holds every component is not walked.
2. The calibration of ``store._jpeg.WORK_PER_PIXEL`` and ``ARITHMETIC_WEIGHT``: a ``--size`` x
   ``--size`` flat progressive JPEG (``tests.support.hostile.flat_progressive``) with one DC scan
   and with 40 more, Huffman and arithmetic-coded, 4:4:4, 4:2:0 and gray, and one with 40
   end-of-band AC scans (``extra_scans``), decoded by torchvision's ``decode_jpeg`` and PIL (both
   libjpeg-turbo): milliseconds per extra scan per megapixel and nanoseconds per block visited;
   and a baseline and a progressive photo-like JPEG of the same size for scale.
3. The budget: the sniffer refusing the 9456 x 9456 arithmetic JPEG with 98 DC scans, and the
   heaviest Huffman JPEG accepted at the largest square within the default ``max_pixels`` (61
   distinct scans, an end-of-band code in every block): its work against the budget and its
   decode time; with ``--attack`` the refused one is decoded too (5-13 s), to show what the
   budget saves.

Timings are best of 3 (1 for the 89 Mpx decodes), CPU time of this process.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import sys
import time
from pathlib import Path

try:
    import gpucache  # noqa: F401  (installed)
except ImportError:  # run from a source checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support

import torch
from PIL import Image

from benchmarks._record import run_line, timed
from gpucache.decode._jpeg import decode_jpeg
from gpucache.ingest._sniff import MAX_SCANS, Kind, SniffError, sniff
from gpucache.store._jpeg import ARITHMETIC_WEIGHT, WORK_PER_PIXEL
from gpucache.store._limits import DEFAULT_MAX_PIXELS, over_work, work_budget
from gpucache.testing import make_jpeg_bytes
from tests.support.hostile import (
    arithmetic_dc_repeats,
    extra_scans,
    flat_progressive,
    one_coefficient_script,
)


def best(fn, repeat: int = 3) -> float:
    return min(timed(fn, repeat, warmup=0, clock=time.process_time)[0])


def tv(b: bytes) -> None:
    decode_jpeg(torch.frombuffer(bytearray(b), dtype=torch.uint8))


def pil(b: bytes) -> None:
    with Image.open(io.BytesIO(b)) as im:
        im.load()


DECODERS = {"torchvision": tv, "PIL": pil}


def sniff_cost(name: str, files: list[bytes]) -> None:
    whole = best(lambda: [sniff(memoryview(f)) for f in files], 7) / len(files)
    progressive = sum(sniff(memoryview(f)).kind == Kind.JPEG_PROGRESSIVE for f in files)
    print(
        f"{name}: {len(files)} files ({progressive} progressive), "
        f"{sum(map(len, files)) / len(files) / 1e3:.0f} KB mean; sniff {whole * 1e6:.1f} us/file"
    )


def per_scan(size: int) -> None:
    mpx = size * size / 1e6
    dc = ((0, 1, 2), 0, 0, 0, 0)
    cases = {}
    for coding in ("Huffman", "arithmetic"):
        for label, comps, sampling, blocks in (
            ("4:4:4", 3, 0x11, 3),
            ("4:2:0", 3, 0x22, 1.5),
            ("gray", 1, 0x11, 1),
        ):
            scan = (dc[0][:comps], 0, 0, 0, 0)
            kw = dict(comps=comps, sampling=sampling, arithmetic=coding == "arithmetic")
            one = flat_progressive(size, size, (scan,), **kw)
            more = flat_progressive(size, size, (scan,) * 41, **kw)
            cases[f"{coding} DC scan, {label}"] = (one, more, blocks)
    base = make_jpeg_bytes(size, size, seed=1, progressive=True)
    cases["Huffman AC end-of-band run, Y of 4:2:0"] = (base, extra_scans(base, 40), 1)
    ac = one_coefficient_script(41, comps=1)
    one, more = (flat_progressive(size, size, s, comps=1, eob_runs=False) for s in (ac[:1], ac))
    cases["Huffman AC, an end-of-band code a block, gray"] = (one, more, 1)
    for name, (one, more, blocks) in cases.items():
        line = []
        for dname, dec in DECODERS.items():
            extra = (best(lambda d=dec, b=more: d(b)) - best(lambda d=dec, b=one: d(b))) / 40
            ns = extra / (mpx * 1e6 * blocks / 64) * 1e9
            line.append(f"{dname} {extra * 1e3 / mpx:.3f} ms/Mpx ({ns:.0f} ns a block)")
        print(f"  {name}: per extra scan " + "; ".join(line))
    seq = make_jpeg_bytes(size, size, seed=1)
    for dname, dec in DECODERS.items():
        print(
            f"  {dname}: a photo-like {size}x{size} JPEG decodes in "
            f"{best(lambda d=dec: d(seq)) * 1e3 / mpx:.1f} ms/Mpx baseline, "
            f"{best(lambda d=dec: d(base)) * 1e3 / mpx:.1f} ms/Mpx progressive (10 scans)"
        )


def budget(attack: bool) -> None:
    side = math.isqrt(DEFAULT_MAX_PIXELS)
    print(
        f"work budget at max_pixels={DEFAULT_MAX_PIXELS:,}: {work_budget(DEFAULT_MAX_PIXELS):,} "
        f"samples visited ({WORK_PER_PIXEL} a pixel; arithmetic x{ARITHMETIC_WEIGHT})"
    )
    hostile = arithmetic_dc_repeats()
    t = time.process_time()
    try:
        sniff(memoryview(hostile))
        raise SystemExit("the 98-scan arithmetic JPEG was accepted")
    except SniffError as err:
        took = time.process_time() - t
        print(
            f"  9456x9456, 98 arithmetic DC scans, {len(hostile):,} B: refused in "
            f"{took * 1e3:.2f} ms: {str(err)[:60]}..."
        )
    if attack:
        print(f"  ... decoding it anyway: {best(lambda: tv(hostile), 1):.2f} s (torchvision)")
    # the most scan work accepted at max_pixels, Huffman-coded: the DC and 60 AC scans of one
    # coefficient each, an end-of-band code in every block (63 of the 64 a pixel allowed)
    script = one_coefficient_script(61)
    heaviest = flat_progressive(side, side, script, eob_runs=False)
    info = sniff(memoryview(heaviest))
    assert over_work(info.scans, info.work, DEFAULT_MAX_PIXELS) is None
    print(
        f"  {side}x{side} 4:4:4, {info.scans} distinct Huffman scans: work {info.work:,} "
        f"({info.work / work_budget(DEFAULT_MAX_PIXELS):.0%} of the budget), accepted; "
        f"decodes in {best(lambda: tv(heaviest), 1):.2f} s (torchvision); its DC scan alone: "
        f"{best(lambda: tv(flat_progressive(side, side, script[:1])), 1):.2f} s"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--photos",
        type=Path,
        default=Path(__file__).resolve().parents[2] / "shared/data/hymenoptera",
    )
    ap.add_argument("--size", type=int, default=4000)
    ap.add_argument("--attack", action="store_true", help="decode the refused 98-scan JPEG too")
    args = ap.parse_args()
    print(run_line(), flush=True)
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
    print(f"{args.size}x{args.size}:")
    per_scan(args.size)
    budget(args.attack)


if __name__ == "__main__":
    main()
