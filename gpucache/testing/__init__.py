"""Synthetic, deterministic JPEG data for tests and benchmarks.

The images are meant to *decode like photos*: smooth colour gradients, soft-edged
shapes with shading, multi-scale texture and some grain, giving file sizes close
to ImageNet's (about 90-100 KB at 500x375, quality 75-95). Pure noise would give
huge files whose entropy decoding dominates, unlike real data.

`make_jpeg_folder` writes an ImageFolder tree with an ImageNet-like spread of
sizes (median about 500x375, a ~3% tail up to 2000 px on the long side, short
side at least 100 px) and special cases at fixed indices (see its docstring).
Hostile files (decompression bombs, JPEG oddities, EXIF layouts) are the tests' own
(``tests/support/hostile.py``), not part of the package.
Everything is a pure function of the arguments: the same call gives the same
bytes (for a given numpy/Pillow/libjpeg build).
"""

from __future__ import annotations

import io
import logging
import os
import pathlib
import shutil
import tempfile
from collections.abc import Sequence

import numpy as np
from PIL import Image, ImageChops, ImageDraw, ImageFilter

__all__ = [
    "make_jpeg_folder",
    "cached_jpeg_folder",
    "make_jpeg_bytes",
    "make_mask_png",
    "natural_image",
]

#: The palette of ``make_mask_png(mode="P")``: colours unlike their indices, so a reader that
#: gave colours instead of indices would be caught.
MASK_PALETTE = [v for k in range(256) for v in (k * 37 % 256, k * 91 % 256, k * 53 % 256)]

_LOW = 256  # long side of the low-resolution canvas the shapes are drawn on
_TEXTURE_GAIN = (1.5, 3.5)  # contrast range of the fine texture


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([int(k) % 2**64 for k in key])


def _noise(
    rng: np.random.Generator,
    width: int,
    height: int,
    cells_w: int,
    cells_h: int,
    resample: Image.Resampling = Image.Resampling.BILINEAR,
) -> Image.Image:
    """Uniform byte noise on a ``cells_w x cells_h`` grid, resized to ``width x height``."""
    cells_w, cells_h = max(2, cells_w), max(2, cells_h)
    img = Image.frombytes("L", (cells_w, cells_h), rng.bytes(cells_w * cells_h))
    return img if (cells_w, cells_h) == (width, height) else img.resize((width, height), resample)


def _colours(rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` random RGB colours, partly desaturated like most photo content."""
    col = rng.uniform(10, 245, (n, 3))
    keep = rng.uniform(0.25, 1.0, (n, 1))
    out: np.ndarray = (col * keep + col.mean(axis=1, keepdims=True) * (1 - keep)).astype(np.float32)
    return out


def _natural_pil(width: int, height: int, seed: int) -> Image.Image:
    if width < 1 or height < 1:
        raise ValueError(f"invalid size {width}x{height}")
    rng = _rng(seed, 0x5EED)
    scale = _LOW / max(width, height)
    lw, lh = max(2, round(width * scale)), max(2, round(height * scale))
    x = np.linspace(0, 1, 64, dtype=np.float32)[None, :]
    y = np.linspace(0, 1, 64, dtype=np.float32)[:, None]
    # Background: a linear gradient between two colours plus a radial glow.
    c0, c1, c2 = _colours(rng, 3)
    theta = rng.uniform(0, 2 * np.pi)
    t = np.clip(0.5 + (x - 0.5) * np.cos(theta) + (y - 0.5) * np.sin(theta), 0, 1)[..., None]
    cx, cy, r2 = rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0.04, 0.6)
    glow = (0.6 * np.exp(-((x - cx) ** 2) / r2) * np.exp(-((y - cy) ** 2) / r2))[..., None]
    img = (c0 * (1 - t) + c1 * t) * (1 - glow) + c2 * glow
    canvas = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).resize(
        (lw, lh), Image.Resampling.BILINEAR
    )
    # Shapes back to front; blurring the canvas between groups of shapes gives
    # far objects softer edges than near ones (a cheap depth-of-field look).
    n_shapes = int(rng.integers(8, 25))
    for k in range(n_shapes):
        if k in (n_shapes // 3, 2 * n_shapes // 3):
            canvas = canvas.filter(ImageFilter.BoxBlur(rng.uniform(0.5, 2.0)))
        draw = ImageDraw.Draw(canvas)
        fill = tuple(int(c) for c in _colours(rng, 1)[0])
        px, py = rng.uniform(-0.1, 1.1) * lw, rng.uniform(-0.1, 1.1) * lh
        sx, sy = rng.uniform(0.02, 0.3) * lw, rng.uniform(0.02, 0.3) * lh
        kind = int(rng.integers(4))
        if kind == 0:
            draw.ellipse([px - sx, py - sy, px + sx, py + sy], fill=fill)
        elif kind == 1:
            draw.line(
                [(px, py), (px + 2 * sx, py + 2 * sy - sx)],
                fill=fill,
                width=int(rng.integers(1, 5)),
            )
        else:  # polygons; kind 2 gives (rotated) rectangles
            m = 4 if kind == 2 else int(rng.integers(3, 9))
            ang = (
                np.sort(rng.uniform(0, 2 * np.pi, m))
                if kind == 3
                else rng.uniform(0, np.pi) + np.array([0.0, 0.5, 1.0, 1.5]) * np.pi
            )
            rad = rng.uniform(0.5, 1.0, m) if kind == 3 else np.ones(m)
            draw.polygon(
                [
                    (float(px + sx * a * np.cos(b)), float(py + sy * a * np.sin(b)))
                    for a, b in zip(rad, ang)
                ],
                fill=fill,
            )
    canvas = canvas.filter(ImageFilter.BoxBlur(rng.uniform(0.3, 0.8)))
    # shading
    light = _noise(rng, lw, lh, 3, 3, Image.Resampling.BICUBIC).point(lambda v: 64 + v // 2)
    canvas = ImageChops.overlay(canvas, light.convert("RGB"))
    out = canvas.resize((width, height), Image.Resampling.BICUBIC)
    # Texture: multi-octave value noise (coarse -> per-pixel) plus a plane
    # wave, mixed towards neutral grey by a smooth mask so detail varies over
    # the image, then applied with an overlay blend like surface detail.
    tw, th = max(2, width // 2), max(2, height // 2)
    wave = rng.uniform(-0.6, 0.6, 2)[:, None] * np.arange(max(tw, th), dtype=np.float32)
    wave = 128 + 127 * np.sin(wave[0][None, :tw] + wave[1][:th, None])
    tex = _noise(rng, tw, th, tw // 12, th // 12)  # blotches
    sx, sy = rng.integers(1, 5, 2)  # anisotropic cells -> streaks (grass, wood, fur)
    tex = Image.blend(tex, _noise(rng, tw, th, tw // int(sx), th // int(sy)), 0.6)
    tex = Image.blend(tex, Image.fromarray(wave.astype(np.uint8)), rng.uniform(0.05, 0.3))
    tex = tex.resize((width, height), Image.Resampling.BILINEAR)
    grain = _noise(rng, width, height, width, height)
    tex = Image.blend(tex, grain, rng.uniform(0.25, 0.4))
    gain = rng.uniform(*_TEXTURE_GAIN)
    tex = tex.point([max(0, min(255, round(128 + (v - 128) * gain))) for v in range(256)])
    mask = _noise(rng, max(2, width // 8), max(2, height // 8), 4, 4, Image.Resampling.BICUBIC)
    mask = mask.point(lambda v: 80 + v * 175 // 255).resize(
        (width, height), Image.Resampling.BILINEAR
    )
    tex = Image.composite(tex, Image.new("L", (width, height), 128), mask).convert("RGB")
    chroma = Image.frombytes("RGB", (width, height), rng.bytes(width * height * 3))
    return ImageChops.overlay(out, Image.blend(tex, chroma, rng.uniform(0.03, 0.1)))


def natural_image(width: int, height: int, *, seed: int = 0) -> np.ndarray:
    """Return a natural-looking ``(height, width, 3)`` uint8 RGB image."""
    return np.asarray(_natural_pil(width, height, seed))


def make_jpeg_bytes(
    width: int,
    height: int,
    *,
    seed: int = 0,
    mode: str = "RGB",
    progressive: bool = False,
    quality: int = 90,
    exif_orientation: int | None = None,
) -> bytes:
    """Encode ``natural_image(width, height, seed=seed)`` as a JPEG.

    ``mode`` is "RGB", "L" (grayscale) or "CMYK" (PIL writes an Adobe marker).
    ``exif_orientation`` (1-8) adds an EXIF Orientation tag; the stored pixels
    are not rotated, so the stored size stays ``width x height``.
    """
    if mode not in ("RGB", "L", "CMYK"):
        raise ValueError(f"unsupported mode {mode!r}")
    img = _natural_pil(width, height, seed)
    if mode != "RGB":
        img = img.convert(mode)
    kwargs: dict[str, object] = {"quality": int(quality), "progressive": progressive}
    if exif_orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = int(exif_orientation)
        kwargs["exif"] = exif.tobytes()
    buf = io.BytesIO()
    img.save(buf, "JPEG", **kwargs)
    return buf.getvalue()


def make_mask_png(values: np.ndarray, mode: str = "L") -> bytes:
    """Encode a segmentation mask of integer ``values`` (H, W) as a PNG: ``"L"`` (8-bit values),
    ``"P"`` (the values as palette indices, :data:`MASK_PALETTE` as colours) or ``"I;16"``
    (16-bit values)."""
    if mode not in ("L", "P", "I;16"):
        raise ValueError(f"unsupported mode {mode!r}")
    if mode == "I;16":
        im = Image.fromarray(np.asarray(values).astype(np.uint16))
    else:
        im = Image.fromarray(np.asarray(values).astype(np.uint8), "L")
        if mode == "P":
            im = im.convert("P")  # L -> P keeps each value as its index
            im.putpalette(MASK_PALETTE)
    out = io.BytesIO()
    im.save(out, "PNG")
    return out.getvalue()


def _image_size(rng: np.random.Generator) -> tuple[int, int]:
    """ImageNet-like (width, height): mostly long side 500, landscape-heavy."""
    u = rng.uniform()
    if u < 0.03:
        long_side = rng.uniform(1500, 2000)
    elif u < 0.60:
        long_side = 500.0
    else:
        long_side = float(np.clip(rng.lognormal(np.log(450), 0.4), 100, 1500))
    shape = rng.uniform()
    ratio = (4 / 3, 3 / 2, rng.uniform(1.05, 2.0))[int(rng.choice(3, p=[0.5, 0.3, 0.2]))]
    if shape < 0.10:
        ratio = 1.0
    long_px, short_px = round(long_side), max(100, round(long_side / ratio))
    long_px = max(long_px, short_px)
    return (long_px, short_px) if shape < 0.85 else (short_px, long_px)


def make_jpeg_folder(
    root: str | os.PathLike[str],
    n: int,
    *,
    classes: Sequence[str] | int = ("ant", "bee", "cat", "dog"),
    seed: int = 0,
    quality: int | tuple[int, int] = (75, 95),
) -> pathlib.Path:
    """Write ``n`` synthetic JPEGs as ``root/<class>/<class>_<i:05d>.jpg``.

    Image ``i`` (global index, 0-based) goes to class ``classes[i % len(classes)]``
    (an int ``classes`` means names ``class_000``, ``class_001``, ...). Quality is
    fixed or drawn uniformly from the inclusive ``(lo, hi)`` range. Special cases
    sit at fixed indices, so any ``n >= 5`` contains one of each:

    * ``i % 50 == 1``  -> grayscale ("L") JPEG             (2%)
    * ``i % 100 == 2`` -> CMYK JPEG with Adobe marker      (1%)
    * ``i % 20 == 3``  -> progressive JPEG                 (5%)
    * ``i % 100 == 4`` -> EXIF Orientation = 6 (rotate 90) (1%)

    These sets are disjoint; all other images are baseline RGB. Output is
    byte-identical for the same arguments. Returns ``Path(root)``.
    """
    if isinstance(classes, int):
        classes = [f"class_{k:03d}" for k in range(classes)]
    names = list(classes)
    if not names:
        raise ValueError("need at least one class")
    root = pathlib.Path(root)
    for name in names:
        (root / name).mkdir(parents=True, exist_ok=True)
    for i in range(n):
        rng = _rng(seed, i)
        width, height = _image_size(rng)
        q = quality if isinstance(quality, int) else int(rng.integers(quality[0], quality[1] + 1))
        data = make_jpeg_bytes(
            width,
            height,
            seed=int(rng.integers(2**31)),
            mode="L" if i % 50 == 1 else "CMYK" if i % 100 == 2 else "RGB",
            progressive=i % 20 == 3,
            quality=q,
            exif_orientation=6 if i % 100 == 4 else None,
        )
        name = names[i % len(names)]
        (root / name / f"{name}_{i:05d}.jpg").write_bytes(data)
    return root


def cached_jpeg_folder(n: int, *, seed: int = 0, name: str = "synthetic") -> pathlib.Path:
    """``make_jpeg_folder(n, seed=seed)`` made once into the temp dir and reused by later runs.

    Written under a temporary name and renamed when complete, so an interrupted run never leaves a
    partial folder that a later run would take for the real one."""
    root = pathlib.Path(tempfile.gettempdir()) / f"gpucache-{name}-{n}-seed{seed}"
    if (root / ".complete").exists():
        return root
    logging.getLogger(__name__).info(
        "generating %d synthetic JPEGs into %s (once; about %.0f s)", n, root, n * 0.015
    )
    part = root.with_name(f"{root.name}.part-{os.getpid()}")
    shutil.rmtree(part, ignore_errors=True)
    make_jpeg_folder(part, n, seed=seed)
    (part / ".complete").write_text("")
    try:
        os.rename(part, root)
    except OSError:  # another run finished first, or a stale incomplete copy is there
        if not (root / ".complete").exists():
            shutil.rmtree(root, ignore_errors=True)
            os.rename(part, root)
        else:
            shutil.rmtree(part, ignore_errors=True)
    return root
