#!/usr/bin/env python
"""Would re-encoding segmentation masks at build make a store smaller? Sizes and encode times of
generated masks saved as PNG the usual way (PIL's default, zlib level 6: what most data set tools
write) and re-encoded losslessly (``optimize=True``, ``compress_level=9``).

Masks: ISIC-like (one lesion blob, 8-bit L 0/255, 1022x767), VOC-like (1-3 objects with a 255
border, palette P, 500x375), 16-bit (30 rectangles of ids >= 1000, I;16, 1024x512); 20 of each.

    python benchmarks/mask_png_size.py > benchmarks/results/mask-png-size.txt
"""

from __future__ import annotations

import io
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # benchmarks._record
from benchmarks._record import run_line  # noqa: E402

RNG = np.random.default_rng(0)


def isic() -> Image.Image:
    im = Image.new("L", (1022, 767), 0)
    cx, cy, r = RNG.integers(300, 700), RNG.integers(250, 500), RNG.integers(100, 250)
    pts = [
        (
            cx + r * (1 + 0.2 * RNG.standard_normal()) * np.cos(t),
            cy + r * (1 + 0.2 * RNG.standard_normal()) * np.sin(t),
        )
        for t in np.linspace(0, 2 * np.pi, 40)
    ]
    ImageDraw.Draw(im).polygon(pts, fill=255)
    return im


def voc() -> Image.Image:
    im = Image.new("L", (500, 375), 0)
    d = ImageDraw.Draw(im)
    for _ in range(RNG.integers(1, 4)):
        x0, y0 = RNG.integers(0, 350), RNG.integers(0, 250)
        box = (x0, y0, x0 + RNG.integers(60, 150), y0 + RNG.integers(60, 120))
        d.ellipse(box, fill=int(RNG.integers(1, 21)), outline=255, width=3)
    p = im.convert("P")
    p.putpalette([v for k in range(256) for v in (k * 37 % 256, k * 91 % 256, k * 53 % 256)])
    return p


def deep() -> Image.Image:
    a = np.zeros((512, 1024), np.uint16)
    for k in range(30):
        y, x = RNG.integers(0, 480), RNG.integers(0, 990)
        a[y : y + RNG.integers(10, 60), x : x + RNG.integers(10, 80)] = 1000 + k
    return Image.fromarray(a)


def main() -> None:
    print(run_line())
    ways = {"PIL default": {}, "optimize": {"optimize": True}, "level 9": {"compress_level": 9}}
    for name, make in (
        ("ISIC-like L 1022x767", isic),
        ("VOC-like P 500x375", voc),
        ("16-bit I;16 1024x512", deep),
    ):
        ims = [make() for _ in range(20)]
        row = {}
        for label, kw in ways.items():
            t, n = time.perf_counter(), 0
            for im in ims:
                b = io.BytesIO()
                im.save(b, "PNG", **kw)
                n += b.tell()
            row[label] = (n / len(ims), (time.perf_counter() - t) / len(ims) * 1e3)
        base = row["PIL default"][0]
        print(
            f"{name}: "
            + "; ".join(
                f"{k} {v[0] / 1024:.1f} KiB ({v[0] / base:.0%}), {v[1]:.1f} ms/mask"
                for k, v in row.items()
            )
        )


if __name__ == "__main__":
    main()
