"""The fuzz loop that benchmarks/fuzz/run.py runs in a child process (ASan runtime preloaded).

    loop.py LIB OUT SEED SECONDS PHOTOS
    loop.py LIB --replay FILE...          # each file once through every target (a crash input)

Prints a JSON line of running totals every 200 iterations and at the end; before each iteration
the input is written to OUT/current.jpg, so the parent can keep the one a sanitizer report ended.
Inputs are held to the limits the library applies before any decoder sees bytes (gpucache's
store/_limits.py, imported without the package's __init__, which would bring in torch).
"""

from __future__ import annotations

import ctypes
import io
import json
import os
import random
import sys
import time
import types
from pathlib import Path

import numpy as np
from PIL import Image

if "gpucache" not in sys.modules:  # the package's pure-Python modules, not gpucache/__init__.py
    _pkg = types.ModuleType("gpucache")
    _pkg.__path__ = [str(Path(__file__).resolve().parents[2] / "gpucache")]
    sys.modules["gpucache"] = _pkg
from gpucache.store._limits import DEFAULT_MAX_PIXELS, bytes_refused  # noqa: E402

C_INT, C_P = ctypes.c_int, ctypes.c_void_p
SCALES = (1, 2, 4, 8)


def load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    lib.gc_decode_region.argtypes = (
        [C_P, ctypes.c_ulong] + [C_INT] * 5 + [C_P, ctypes.POINTER(C_INT), ctypes.c_char_p, C_INT]
    )
    lib.gc_decode_segments.argtypes = (
        [C_P, ctypes.c_ulong] + [C_INT] * 6 + [C_P, ctypes.POINTER(C_INT), ctypes.c_char_p, C_INT]
    )
    lib.gc_transcode_restart.argtypes = [
        C_P,
        ctypes.c_ulong,
        ctypes.POINTER(C_P),
        ctypes.POINTER(ctypes.c_ulong),
        ctypes.POINTER(C_INT),
        ctypes.c_char_p,
        C_INT,
    ]
    lib.gc_free.argtypes = [C_P]
    return lib


class Target:
    """The three entry points, on bytes; each returns an array, or None when it refused."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib, self.calls, self.errors, self.warned, self.last_warned = lib, 0, 0, 0, False
        self.err = ctypes.create_string_buffer(256)

    def _done(self, ret: int, warned: ctypes.c_int) -> bool:
        self.calls += 1
        self.last_warned = ret == 0 and warned.value > 0
        self.errors += ret != 0
        self.warned += ret == 0 and warned.value > 0
        return ret == 0

    def region(self, data: bytes, denom: int, t: int, l: int, h: int, w: int):
        out, warned = np.empty((h, w, 3), np.uint8), C_INT()
        ret = self.lib.gc_decode_region(
            data, len(data), denom, t, l, h, w, out.ctypes.data, ctypes.byref(warned), self.err, 256
        )
        return out if self._done(ret, warned) else None

    def segments(self, data: bytes, k: int, denom: int, t: int, l: int, h: int, w: int):
        out, warned = np.empty((h, w, 3), np.uint8), C_INT()
        ret = self.lib.gc_decode_segments(
            data,
            len(data),
            k,
            denom,
            t,
            l,
            h,
            w,
            out.ctypes.data,
            ctypes.byref(warned),
            self.err,
            256,
        )
        return out if self._done(ret, warned) else None

    def transcode(self, data: bytes):
        out, n, k = C_P(), ctypes.c_ulong(), C_INT()
        ret = self.lib.gc_transcode_restart(
            data, len(data), ctypes.byref(out), ctypes.byref(n), ctypes.byref(k), self.err, 256
        )
        self.calls += 1
        if ret:
            self.errors += 1
            return None
        try:
            return ctypes.string_at(out, n.value), k.value
        finally:
            self.lib.gc_free(out)


def header(data: bytes) -> tuple[int, int, int]:
    """(height, width, restart interval) from the first SOF and DRI, zeros where absent."""
    pos, hw, dri = 2, (0, 0), 0
    while pos + 4 <= len(data) and data[pos] == 0xFF:
        m, n = data[pos + 1], (data[pos + 2] << 8) | data[pos + 3]
        if 0xC0 <= m <= 0xCF and m not in (0xC4, 0xC8, 0xCC) and pos + 9 <= len(data):
            hw = ((data[pos + 5] << 8) | data[pos + 6], (data[pos + 7] << 8) | data[pos + 8])
        elif m == 0xDD and pos + 6 <= len(data):
            dri = (data[pos + 4] << 8) | data[pos + 5]
        elif m == 0xDA:
            break
        pos += 2 + n
    return hw[0], hw[1], dri


def segments_of(data: bytes) -> list[tuple[int, int]]:
    """(offset, length) of each marker segment before the scan data."""
    pos, out = 2, []
    while pos + 4 <= len(data) and data[pos] == 0xFF:
        n = (data[pos + 2] << 8) | data[pos + 3]
        out.append((pos, n))
        if data[pos + 1] == 0xDA:
            break
        pos += 2 + n
    return out


def mutate(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    segs = segments_of(data)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        op = rng.randrange(10)
        sof = [p for p, _ in segs if 0xC0 <= b[p + 1] <= 0xC2 and p + 10 <= len(b)]
        if op == 0 or not segs:  # bit flips, anywhere or in the headers
            end = len(b) if rng.random() < 0.5 else segs[-1][0] + 4 if segs else len(b)
            for _ in range(rng.randint(1, 8)):
                i = rng.randrange(max(end, 1))
                b[i] ^= 1 << rng.randrange(8)
        elif op == 1:  # truncation
            b = b[: rng.randrange(2, len(b))]
        elif op == 2:  # a marker inserted (random kind and length) in the headers or the scan
            i = rng.choice([p for p, _ in segs] + [rng.randrange(2, len(b))])
            m = rng.choice(
                [
                    0xD0 + rng.randrange(8),
                    0xD9,
                    0xDD,
                    0xC4,
                    0xDB,
                    0xE1,
                    0xFE,
                    0xC0,
                    0xC2,
                    0xDA,
                    rng.randrange(256),
                ]
            )
            body = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 12)))
            n = rng.choice((len(body) + 2, rng.randrange(65536)))
            b[i:i] = bytes((0xFF, m, n >> 8, n & 255)) + body
        elif op == 3:  # a marker segment removed
            p, n = rng.choice(segs)
            del b[p : p + 2 + n]
        elif op == 4:  # DRI: odd values, added before the scan or changed
            v = rng.choice((0, 1, 2, 3, 5, 7, 255, 65535, rng.randrange(65536)))
            p = segs[-1][0]
            b[p:p] = bytes((0xFF, 0xDD, 0, 4, v >> 8, v & 255))
        elif op == 5 and sof:  # SOF dimensions
            p = rng.choice(sof)
            for off in rng.sample((5, 7), rng.randint(1, 2)):
                v = rng.choice((0, 1, 2, 7, 8, 9, 15, 16, 17, 4095, 65535, rng.randrange(65536)))
                b[p + off : p + off + 2] = bytes((v >> 8, v & 255))
        elif op == 6 and sof:  # sampling factors
            p = rng.choice(sof)
            for c in range(min(b[p + 9], 4)):
                if rng.random() < 0.5 and p + 11 + 3 * c < len(b):
                    b[p + 11 + 3 * c] = rng.choice(
                        (
                            0x11,
                            0x12,
                            0x21,
                            0x22,
                            0x41,
                            0x14,
                            0x42,
                            0x44,
                            0x31,
                            0x00,
                            rng.randrange(256),
                        )
                    )
        elif op == 7 and sof:  # component count
            p = rng.choice(sof)
            b[p + 9] = rng.choice((0, 1, 2, 3, 4, 5, 255))
        elif op == 8:  # a length field
            p, n = rng.choice(segs)
            v = rng.choice((0, 1, 2, n - 1, n + 1, 65535, rng.randrange(65536)))
            b[p + 2 : p + 4] = bytes(((v >> 8) & 255, v & 255))
        else:  # bytes of the scan overwritten
            start = segs[-1][0] + 2 + segs[-1][1]
            if start < len(b) - 1:
                i = rng.randrange(start, len(b) - 1)
                b[i] = rng.choice((0xFF, 0x00, 0xD0, 0xD9, rng.randrange(256)))
        segs = segments_of(bytes(b))
    return bytes(b)


def box(rng: random.Random, h: int, w: int) -> tuple[int, int, int, int]:
    bh = rng.choice((1, 2, 3, rng.randint(1, h)))
    bw = rng.choice((1, 2, 3, 4, 5, rng.randint(1, w)))
    bh, bw = min(bh, h), min(bw, w)
    return rng.randint(0, h - bh), rng.randint(0, w - bw), bh, bw


def natural(w: int, h: int, seed: int) -> np.ndarray:
    g = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack(
        [(x * 255 // max(w - 1, 1)), (y * 255 // max(h - 1, 1)), ((x + y) * 3) % 256], -1
    ).astype(np.int16)
    return np.clip(base + g.integers(-40, 40, (h, w, 3)), 0, 255).astype(np.uint8)


def seeds(photos: Path, target: Target) -> list[bytes]:
    out = []
    for i, (mode, kw) in enumerate(
        [
            ("RGB", dict(subsampling=0)),
            ("RGB", dict(subsampling=1)),
            ("RGB", dict(subsampling=2)),
            ("L", {}),
            ("RGB", dict(progressive=True)),
            ("RGB", dict(exif=b"Exif\0\0" + bytes(6000))),
        ]
    ):
        buf = io.BytesIO()
        Image.fromarray(natural(37 + 16 * i, 29 + 8 * i, i)).convert(mode).save(
            buf, "JPEG", quality=85, **kw
        )
        out.append(buf.getvalue())
    files = sorted(photos.rglob("*.jpg"))[::25][:8] if photos.is_dir() else []
    for k, f in enumerate(files):  # real photos: two as they are, the rest made smaller
        if k < 2:
            out.append(f.read_bytes())
            continue
        with Image.open(f) as im:
            im.thumbnail((160, 160))
            buf = io.BytesIO()
            im.convert("RGB").save(buf, "JPEG", quality=90, subsampling=k % 3)
            out.append(buf.getvalue())
    out += [t[0] for t in map(target.transcode, list(out)) if t is not None]
    return out


def compare(stats: dict, name: str, data: bytes, got, want, where, warned: bool) -> None:
    """Record a crop that differs from the full decode's. Corrupt data (libjpeg warned) decodes
    to garbage that may depend on what was skipped: counted apart, not a finding."""
    if got is None or want is None or np.array_equal(got, want):
        return
    if warned:
        stats["warned_mismatches"] += 1
    else:
        stats["mismatches"].append(
            {
                "target": name,
                "box": where,
                "size": len(data),
                "max_diff": int(np.abs(got.astype(int) - want).max()),
            }
        )


def run_targets(
    target: Target, data: bytes, rng: random.Random, stats: dict, *, transcode: float = 0.3
) -> None:
    """One input through the targets: the region decoder at two scales, the segment decoder when
    it has restart markers and, with probability ``transcode``, the transcoder and the segment
    decoder on its output. An input the library refuses before any decoder sees it (over the
    default max_pixels; too many scans, a repeated one, or more scan work than the budget:
    ``store._limits.bytes_refused``) is counted, not run."""
    if bytes_refused(memoryview(data), DEFAULT_MAX_PIXELS) is not None:
        stats["refused"] += 1
        return
    h, w, dri = header(data)
    for denom in rng.sample(SCALES, 2):
        sh, sw = -(-h // denom), -(-w // denom)
        if not (sh and sw):
            target.region(data, denom, 0, 0, 1, 1)  # refused: must say so, not crash
            continue
        full = target.region(data, denom, 0, 0, sh, sw) if sh * sw <= 4_000_000 else None
        full_warned = target.last_warned
        for _ in range(3):
            t, l, bh, bw = box(rng, min(sh, 64) if full is None else sh, sw)
            got = target.region(data, denom, t, l, bh, bw)
            if full is not None:
                compare(
                    stats,
                    f"region/{denom}",
                    data,
                    got,
                    full[t : t + bh, l : l + bw],
                    (t, l, bh, bw),
                    full_warned or target.last_warned,
                )
        if dri:  # the input as a restart-marker JPEG
            t, l, bh, bw = box(rng, sh, sw)
            got = target.segments(data, rng.choice((dri, dri, 1, 4)), denom, t, l, bh, bw)
            if full is not None:
                compare(
                    stats,
                    f"segments/{denom}",
                    data,
                    got,
                    full[t : t + bh, l : l + bw],
                    (t, l, bh, bw),
                    full_warned or target.last_warned,
                )
    if rng.random() < transcode:
        done = target.transcode(data)
        if done is not None and h * w <= 4_000_000:
            rst, k = done
            rh, rw, _ = header(rst)
            denom = rng.choice(SCALES)
            sh, sw = -(-rh // denom), -(-rw // denom)
            full = target.region(rst, denom, 0, 0, sh, sw)
            full_warned = target.last_warned
            for _ in range(3):
                t, l, bh, bw = box(rng, sh, sw)
                got = target.segments(rst, k, denom, t, l, bh, bw)
                compare(
                    stats,
                    f"transcode+segments/{denom}",
                    rst,
                    got,
                    None if full is None else full[t : t + bh, l : l + bw],
                    (t, l, bh, bw),
                    full_warned or target.last_warned,
                )


def new_stats() -> dict:
    return {"iterations": 0, "refused": 0, "mismatches": [], "warned_mismatches": 0}


def replay(lib_path: str, files: list[str]) -> None:
    """Each file once through every target (the transcoder included); the totals as JSON."""
    target, stats = Target(load(lib_path)), new_stats()
    for f in files:
        run_targets(target, Path(f).read_bytes(), random.Random(0), stats, transcode=1.0)
        stats["iterations"] += 1
    print(json.dumps({**stats, "calls": target.calls, "errors": target.errors}), flush=True)


def main() -> None:
    if sys.argv[2:3] == ["--replay"]:
        return replay(sys.argv[1], sys.argv[3:])
    lib_path, out, seed, seconds, photos = sys.argv[1:6]
    target = Target(load(lib_path))
    rng = random.Random(int(seed))
    pool = seeds(Path(photos), target)
    current = os.open(Path(out) / "current.jpg", os.O_WRONLY | os.O_CREAT, 0o600)
    stats = new_stats()
    deadline = time.monotonic() + float(seconds)
    mismatch_dir = Path(out)

    def report() -> None:
        print(
            json.dumps(
                {**stats, "calls": target.calls, "errors": target.errors, "warned": target.warned}
            ),
            flush=True,
        )

    while time.monotonic() < deadline:
        data = mutate(rng.choice(pool), rng)
        os.ftruncate(current, 0)
        os.pwrite(current, data, 0)
        seen = len(stats["mismatches"])
        run_targets(target, data, rng, stats)
        if len(stats["mismatches"]) > seen:  # keep the input of a pixel mismatch too
            name = mismatch_dir / f"mismatch-{seed}-{stats['iterations']}.jpg"
            name.write_bytes(data)
            stats["mismatches"][-1]["input"] = str(name)
        stats["iterations"] += 1
        if stats["iterations"] % 200 == 0:
            report()
    report()


if __name__ == "__main__":
    main()
