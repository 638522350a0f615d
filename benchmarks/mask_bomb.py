"""A stored mask whose PNG header claims 40000 x 40000: the time and memory of its refusal.

    PYTHONPATH=. python benchmarks/mask_bomb.py [--side 40000]

A store of 4 small photos with masks, one mask replaced by a real zlib bomb (a greyscale PNG of
``--side`` x ``--side`` zeros, about 1.6 MB at side 40000) in an altered store whose checksums
are valid; the loader (cpu backend, 0 workers, ``on_error="skip"``) takes one epoch. Reported:
the second epoch's seconds (the first imports the PNG decoder), the samples skipped and why, and
the loop's process's memory growth over that epoch: PSS before and after (``/proc/self/smaps_rollup``) and the peak resident size (``ru_maxrss``, the
only peak the kernel keeps) against its value before the epoch.
"""

from __future__ import annotations

import argparse
import resource
import struct
import tempfile
import time
import warnings
import zlib
from pathlib import Path

import numpy as np

from gpucache import GpuCachedLoader, JpegCache
from gpucache import transforms as T
from gpucache.store import _format
from gpucache.store._masks import DATA, OFFSETS
from gpucache.testing import make_jpeg_bytes, make_mask_png


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def bomb(side: int) -> bytes:
    """A valid greyscale PNG of ``side`` x ``side`` zeros, compressed as tightly as zlib can."""
    z = zlib.compressobj(9)
    row = bytes(side + 1)  # filter byte 0, then the row's zeros
    parts = [z.compress(row) for _ in range(side)]
    data = b"".join(parts) + z.flush()
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", data) + _chunk(b"IEND", b"")
    )


def pss() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--side", type=int, default=40000)
    args = ap.parse_args()
    png = bomb(args.side)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        files, masks = [], []
        for k in range(4):
            (root / f"{k}.jpg").write_bytes(make_jpeg_bytes(32, 24, seed=k))
            files.append(root / f"{k}.jpg")
            masks.append(make_mask_png(np.full((24, 32), k), "L"))
        cache = JpegCache.from_files(files, masks=masks, progress=False)
        pieces = [np.asarray(cache.masks[k]).tobytes() for k in range(4)]
        pieces[2] = png
        arrays = cache._stored()
        offsets = np.concatenate([[0], np.cumsum([len(p) for p in pieces])]).astype(np.int64)
        arrays = arrays.with_sections(
            {DATA: np.frombuffer(b"".join(pieces), np.uint8), OFFSETS: offsets}
        )
        with open(root / "bomb.gpucache", "wb") as f:
            _format.write(f, arrays)
        store = JpegCache.open(root / "bomb.gpucache")
        kw = dict(batch_size=4, num_workers=0, on_error="skip", transform=[T.RandomResizedCrop(16)])
        with GpuCachedLoader(store, **kw) as loader:
            with warnings.catch_warnings():  # the first epoch: imports and the backend's start
                warnings.simplefilter("ignore")
                list(loader)
            before, peak0 = pss(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                n = sum(len(m) for _, m in loader)
            took = time.perf_counter() - t0
            after, peak1 = pss(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            skipped = loader.stats.skipped_samples
    print(f"mask PNG: {len(png) / 1e6:.2f} MB claiming {args.side}x{args.side}")
    print(f"epoch: {took:.3f} s, {n} samples delivered, skipped: {skipped}")
    print(
        f"PSS growth {(after - before) / 2**20:.1f} MiB, peak RSS growth {(peak1 - peak0) / 1024:.1f} MiB"
    )


if __name__ == "__main__":
    main()
