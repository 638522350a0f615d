"""The images the contenders read: an ImageFolder tree, a saved store, or generated photos."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from ._common import Source, say


def synthetic_folder(n: int, seed: int) -> Path:
    """The built-in generator's photos, made once into the temp dir (see cached_jpeg_folder)."""
    from ..testing import cached_jpeg_folder

    root = cached_jpeg_folder(n, seed=seed, name="bench-synthetic")
    say(f"synthetic JPEGs: {root}")
    return root


def _export_store(store: Path, tmp: Path) -> Path:
    """Write a saved store's images back out as an ImageFolder (for the file-reading peers)."""
    from ..node._jpegcache import JpegCache

    cache = JpegCache.open(store)
    root = tmp / "exported"
    names = cache.classes or ["unlabeled"]
    for i in range(len(cache)):
        label = int(cache.labels[i])
        folder = root / (names[label] if label >= 0 else "unlabeled")
        folder.mkdir(parents=True, exist_ok=True)
        ext = Path(cache.paths[i]).suffix.lower() or ".jpg"
        (folder / f"{i:07d}{ext}").write_bytes(cache[i].tobytes())
    return root


def prepare_source(args: argparse.Namespace, tmp: Path, need_store: bool) -> Source:
    """The run's Source; with ``need_store``, a saved store of it in ``tmp`` (build/save timed)."""
    from ..ingest._build import scan_folder

    t0 = time.perf_counter()
    info: dict[str, Any] = {}
    store = None
    if args.synthetic:
        root = synthetic_folder(args.synthetic, args.seed)
        info["src"] = f"synthetic {args.synthetic} (seed {args.seed}): {root}"
    elif Path(args.src).is_file():
        store = Path(args.src)
        root = _export_store(store, tmp)
        info["src"] = f"store {store} (images exported to {root} for the file readers)"
    elif Path(args.src).is_dir():
        root = Path(args.src)
        info["src"] = str(root)
    else:
        raise FileNotFoundError(f"{args.src} is neither an ImageFolder tree nor a store file")
    info["prepare_s"] = time.perf_counter() - t0
    paths, labels, classes = scan_folder(root)
    samples = [(p, int(y)) for p, y in zip(paths, labels.tolist())]
    src = Source(str(root), samples, classes, info=info)
    info.update(images=len(samples), classes=len(classes), bytes=src.nbytes)
    if need_store and store is None:
        from ..node._jpegcache import JpegCache

        t0 = time.perf_counter()
        cache = JpegCache.from_files(paths, labels, classes=classes, progress=False)
        info["build_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        store = cache.save(tmp / "bench.gpucache")
        info["save_s"] = time.perf_counter() - t0
        info["store_kept"] = len(cache)
        del cache
    src.store = None if store is None else str(store)
    return src
