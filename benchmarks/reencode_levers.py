#!/usr/bin/env python
"""What a lossy re-encode at build costs in quality and bytes, per way of doing it, on real photos.

For every JPEG photo below SRC each variant is written as a baseline JPEG into OUT/<variant>/
and compared with the original's decode (mean absolute difference in levels over RGB, and PSNR).
Variants: ``444qQ`` / ``420qQ`` (PIL's encoder at quality Q, full or halved chroma), ``420src``
(4:2:0 at the source's own quantisation tables: the luma requantised with its own table, so
nearly unchanged, and only the chroma halved: what a chroma-only re-encode would give). Time
each variant's decode with ``benchmarks/jpeg_levers.c`` on the lists written to OUT/<variant>.txt.

    python benchmarks/reencode_levers.py ../shared/data/hymenoptera /tmp/reencode
    for v in original 444q95 420q95 444q90 420q90 420src; do
        /tmp/jpeg_levers /tmp/reencode/$v.txt 5
    done
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import numpy as np
from PIL import Image, JpegImagePlugin

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # benchmarks._record
from benchmarks._record import write_json  # noqa: E402

VARIANTS = {
    "444q95": {"quality": 95, "subsampling": 0},
    "420q95": {"quality": 95, "subsampling": 2},
    "444q90": {"quality": 90, "subsampling": 0},
    "420q90": {"quality": 90, "subsampling": 2},
    "420src": {"subsampling": 2},
}  # qtables: the source's own, added per photo


def photos(src: Path) -> list[Path]:
    out = []
    for p in sorted(src.rglob("*.jpg")):
        with Image.open(p) as im:
            if im.format == "JPEG" and im.mode == "RGB":
                out.append(p)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("out", type=Path)
    a = ap.parse_args(argv)
    files = photos(a.src)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "original.txt").write_text("".join(f"{p}\n" for p in files))
    rows: dict[str, dict[str, list[float]]] = {
        v: {"bytes": [], "mad": [], "psnr": []} for v in ["original", *VARIANTS]
    }
    sampling = {0: 0, 1: 0, 2: 0}
    for k, p in enumerate(files):
        data = p.read_bytes()
        with Image.open(io.BytesIO(data)) as im:
            ref = np.asarray(im.convert("RGB"), dtype=np.float64)
            sampling[JpegImagePlugin.get_sampling(im)] = (
                sampling.get(JpegImagePlugin.get_sampling(im), 0) + 1
            )
            tables = im.quantization
            rows["original"]["bytes"].append(len(data))
            for name, kw in VARIANTS.items():
                kw = {**kw, "qtables": tables} if name == "420src" else kw
                buf = io.BytesIO()
                im.save(buf, "JPEG", **kw)
                folder = a.out / name
                folder.mkdir(exist_ok=True)
                (folder / f"{k:05d}.jpg").write_bytes(buf.getvalue())
                with Image.open(io.BytesIO(buf.getvalue())) as back:
                    got = np.asarray(back.convert("RGB"), dtype=np.float64)
                err = np.abs(got - ref)
                mse = float((err**2).mean())
                rows[name]["bytes"].append(buf.tell())
                rows[name]["mad"].append(float(err.mean()))
                rows[name]["psnr"].append(10 * np.log10(255**2 / mse) if mse else 99.0)
    for name in VARIANTS:
        (a.out / f"{name}.txt").write_text(
            "".join(f"{a.out / name / f'{k:05d}.jpg'}\n" for k in range(len(files)))
        )
    total = sum(rows["original"]["bytes"])
    print(
        f"{len(files)} RGB JPEG photos, {total / 2**20:.1f} MiB; chroma subsampling "
        f"(PIL codes 0=4:4:4, 1=4:2:2, 2=4:2:0): {sampling}"
    )
    print(
        f"{'variant':10} {'bytes':>8} {'MAD median':>11} {'p90':>6} {'max':>6} "
        f"{'PSNR median':>12} {'min':>6}"
    )
    summary = {}
    for name, r in rows.items():
        share = sum(r["bytes"]) / total
        if name == "original":
            print(f"{name:10} {share:8.3f}")
            continue
        mad, psnr = np.asarray(r["mad"]), np.asarray(r["psnr"])
        summary[name] = {
            "bytes_share": share,
            "mad_median": float(np.median(mad)),
            "mad_p90": float(np.percentile(mad, 90)),
            "mad_max": float(mad.max()),
            "psnr_median": float(np.median(psnr)),
            "psnr_min": float(psnr.min()),
        }
        s = summary[name]
        print(
            f"{name:10} {share:8.3f} {s['mad_median']:11.2f} {s['mad_p90']:6.2f} "
            f"{s['mad_max']:6.2f} {s['psnr_median']:12.1f} {s['psnr_min']:6.1f}"
        )
    write_json(a.out / "summary.json", summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
