"""The two data sets of the peer run, made once into a work folder (never committed).

``photos``: the real JPEG photos of an image folder (ImageNet-size), linked into
``<work>/photos/<class>/`` (with ``--repeat N``, each photo linked N times into
``<work>/photos-xN/``, for epochs long enough to time: 397 photos are half a second); anything that is not a JPEG is left out, so every peer reads the same
files. ``mosaics``: 2000x1500 JPEGs (quality 90), each a 4 x 3 grid of 500x500 tiles cut from those
photos (centre square, Lanczos resize), so their content and compressed statistics are a real
photo's at high resolution. Both are deterministic for a given source and seed.

    python benchmarks/peers/data.py /work/shared/data/hymenoptera /tmp/gpucache-peers --mosaics 200
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

JPEG_EXT = (".jpg", ".jpeg")
MOSAIC_SIZE, TILE = (2000, 1500), 500


def real_photos(src: Path) -> list[tuple[Path, str]]:
    """(path, class) of every JPEG below ``src``, sorted; the class is the parent folder's name."""
    out = []
    for p in sorted(src.rglob("*")):
        if p.is_file() and p.suffix.lower() in JPEG_EXT:
            with open(p, "rb") as f:
                if f.read(2) != b"\xff\xd8":  # named .jpg, but not a JPEG
                    continue
            out.append((p, p.parent.name))
    if not out:
        raise FileNotFoundError(f"no JPEG files below {src}: give an image folder of photos")
    return out


def link_photos(photos, dst: Path, repeat: int = 1) -> Path:
    """``dst/<class>/<n>.jpg`` symlinks to the photos (each ``repeat`` times): one folder, every
    file a JPEG."""
    for k, (p, cls) in enumerate(photos * repeat):
        link = dst / cls / f"{k:05d}.jpg"
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(p.resolve())
    return dst


def make_mosaics(photos, dst: Path, n: int, seed: int) -> Path:
    """``n`` mosaics of 4 x 3 real-photo tiles into ``dst/<class>/``; the class is the first tile's."""
    from PIL import Image

    rng = random.Random(seed)
    cols, rows = MOSAIC_SIZE[0] // TILE, MOSAIC_SIZE[1] // TILE
    for k in range(n):
        picks = [rng.randrange(len(photos)) for _ in range(cols * rows)]
        out = dst / photos[picks[0]][1] / f"m{k:05d}.jpg"
        if out.exists():
            continue
        canvas = Image.new("RGB", MOSAIC_SIZE)
        for t, i in enumerate(picks):
            with Image.open(photos[i][0]) as im:
                im = im.convert("RGB")
                side = min(im.size)
                x0, y0 = (im.width - side) // 2, (im.height - side) // 2
                tile = im.crop((x0, y0, x0 + side, y0 + side)).resize((TILE, TILE), Image.LANCZOS)
            canvas.paste(tile, ((t % cols) * TILE, (t // cols) * TILE))
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        canvas.save(tmp, "JPEG", quality=90)
        os.replace(tmp, out)
    return dst


def prepare(src: Path, work: Path, mosaics: int, seed: int = 0, repeat: int = 1
            ) -> dict[str, Path]:
    photos = real_photos(src)
    name = "photos" if repeat == 1 else f"photos-x{repeat}"
    return {"photos": link_photos(photos, work / name, repeat),
            "mosaics": make_mosaics(photos, work / f"mosaics-{mosaics}", mosaics, seed)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src", type=Path, help="an image folder of real photos")
    p.add_argument("work", type=Path, help="where the data sets go (e.g. /tmp/gpucache-peers)")
    p.add_argument("--mosaics", type=int, default=200, help="how many 2000x1500 mosaics")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=1, help="link each photo this many times")
    a = p.parse_args(argv)
    made = prepare(a.src, a.work, a.mosaics, a.seed, a.repeat)
    print(json.dumps({k: str(v) for k, v in made.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
