"""The data sets of the peer run, made once into a work folder (never committed).

``photos``: the real JPEG photos of an image folder (ImageNet-size), linked into
``<work>/photos/<class>/`` (with ``--repeat N``, each photo linked N times into
``<work>/photos-xN/``, for epochs long enough to time: 397 photos are half a second); anything
that is not a JPEG is left out, so every peer reads the same files. ``mosaics``: 2000x1500
JPEGs (quality 90), each a 4 x 3 grid of 500x500 tiles cut from those photos (centre square, Lanczos resize), so their content and compressed statistics are a real
photo's at high resolution. ``--reencode 444:95,420:90``: the same photos stored another way,
decoded and written again as baseline JPEGs with that chroma subsampling (4:4:4 full-resolution
chroma, 4:2:2, 4:2:0) and quality, EXIF and ICC kept, gray images kept gray, linked into
``<work>/photos-<sub>q<quality>[-xN]/`` (``--repeat`` times, like the photos; the files beside
it): a claim measured on one kind of JPEG is checked on another. All are deterministic for a
given source and seed.

    python benchmarks/peers/data.py /work/shared/data/hymenoptera /tmp/gpucache-peers --mosaics 200
    python benchmarks/peers/data.py SRC /tmp/gpucache-peers --repeat 4 --reencode 444:95,420:90
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


SUBSAMPLING = {"444": 0, "422": 1, "420": 2}  # PIL's subsampling= codes


def reencode_photos(photos, dst: Path, sub: str, quality: int, repeat: int = 1) -> Path:
    """The photos written again as ``sub`` (``"444"``, ``"422"``, ``"420"``) JPEGs at
    ``quality`` into ``<dst>.files/`` (beside ``dst``: a run over ``dst`` reads each once), then
    linked like :func:`link_photos`."""
    from PIL import Image

    files = dst.with_name(f"{dst.name}.files")
    files.mkdir(parents=True, exist_ok=True)
    made = []
    for k, (p, cls) in enumerate(photos):
        out = files / f"{k:05d}.jpg"
        if not out.exists():
            with Image.open(p) as im:
                im.load()
                keep = {key: im.info[key] for key in ("exif", "icc_profile") if im.info.get(key)}
                if im.mode not in ("L", "RGB", "CMYK"):
                    im = im.convert("RGB")
                tmp = out.with_suffix(".tmp")
                im.save(tmp, "JPEG", quality=quality, subsampling=SUBSAMPLING[sub], **keep)
            os.replace(tmp, out)
        made.append((out, cls))
    return link_photos(made, dst, repeat)


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


def prepare(
    src: Path,
    work: Path,
    mosaics: int,
    seed: int = 0,
    repeat: int = 1,
    reencode: tuple[tuple[str, int], ...] = (),
) -> dict[str, Path]:
    photos = real_photos(src)
    tail = "" if repeat == 1 else f"-x{repeat}"
    made = {"photos": link_photos(photos, work / f"photos{tail}", repeat)}
    for sub, quality in reencode:
        name = f"photos-{sub}q{quality}"
        made[name] = reencode_photos(photos, work / f"{name}{tail}", sub, quality, repeat)
    if mosaics:
        made["mosaics"] = make_mosaics(photos, work / f"mosaics-{mosaics}", mosaics, seed)
    return made


def _kinds(text: str) -> tuple[tuple[str, int], ...]:
    out = []
    for item in filter(None, text.split(",")):
        sub, _, quality = item.partition(":")
        if sub not in SUBSAMPLING or not quality.isdigit() or not 1 <= int(quality) <= 100:
            raise argparse.ArgumentTypeError(
                f"{item!r}: write SUBSAMPLING:QUALITY, SUBSAMPLING one of 444, 422, 420 and "
                "QUALITY 1-100, e.g. 444:95,420:90"
            )
        out.append((sub, int(quality)))
    return tuple(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src", type=Path, help="an image folder of real photos")
    p.add_argument("work", type=Path, help="where the data sets go (e.g. /tmp/gpucache-peers)")
    p.add_argument("--mosaics", type=int, default=200, help="how many 2000x1500 mosaics")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=1, help="link each photo this many times")
    p.add_argument(
        "--reencode",
        type=_kinds,
        default=(),
        metavar="SUB:Q,...",
        help="also the photos re-encoded, e.g. 444:95,420:90 (4:4:4 at quality 95, 4:2:0 at 90)",
    )
    a = p.parse_args(argv)
    made = prepare(a.src, a.work, a.mosaics, a.seed, a.repeat, a.reencode)
    print(json.dumps({k: str(v) for k, v in made.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
