"""Bounded fuzzing of the store format.

A few hundred mutants of one small v2 store (bit flips, truncations, header and section-directory
field overwrites, data flips; half of the index/header edits with their checksums recomputed so the
checks behind the CRCs are reached) are each opened in a child process, which then decodes every
sample. Children take many mutants each and print one line per mutant before and after, so a crash
or hang is attributed to its mutant. Allowed outcomes: ``CacheFormatError`` at open, or a store
whose every sample decodes or raises an ordinary exception. Never a signal, a hang, or another
exception type at open.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import numpy as np
import pytest

from gpucache import JpegCache
from gpucache.store._format import CRC, ENTRY, HEAD_V2
from gpucache.testing import make_jpeg_bytes

REPO = Path(__file__).resolve().parent.parent
PER_CHILD = 400  # one interpreter for all of them (torch imports once); more after a crash
# (offset, struct code) of every header field after the magic: version, header size, N, C, file
# size, 7 x (offset, length), data CRC, index CRC, directory offset, entries, directory CRC
HEADER_FIELDS = (
    [(8, "<I"), (12, "<I"), (16, "<Q"), (24, "<Q"), (32, "<Q")]
    + [(40 + 8 * j, "<Q") for j in range(14)]
    + [(152, "<I"), (156, "<I"), (160, "<Q"), (168, "<Q"), (176, "<I")]
)
CHILD = textwrap.dedent("""
    import sys, warnings
    warnings.simplefilter("ignore")
    from gpucache import CacheFormatError, JpegCache
    from gpucache.decode._sample import decode_sample

    for path in sys.argv[1:]:
        print("START", path, flush=True)
        try:
            cache = JpegCache.open(path)
        except CacheFormatError:
            print("END", path, "format-error", flush=True)
            continue
        except BaseException as err:
            print("END", path, "BAD", type(err).__name__, str(err)[:200].replace("\\n", " "),
                  flush=True)
            continue
        ok = failed = 0
        for i in range(len(cache)):
            try:
                decode_sample(cache, i)
                ok += 1
            except Exception:
                failed += 1
        print("END", path, f"opened {ok} decoded {failed} failed", flush=True)
""")


def _rechecksum(b: bytearray, index: bool) -> None:
    f = list(HEAD_V2.unpack_from(b))
    if index:
        crc = 0
        for k in range(6):
            crc = zlib.crc32(bytes(b[f[6 + 2 * k] : f[6 + 2 * k] + f[7 + 2 * k]]), crc)
        f[21] = crc
        f[24] = zlib.crc32(bytes(b[f[22] : f[22] + ENTRY.size * f[23]]))
        HEAD_V2.pack_into(b, 0, *f)
    CRC.pack_into(b, HEAD_V2.size, zlib.crc32(bytes(b[: HEAD_V2.size])))


def _mutants(raw: bytes, rng: np.random.Generator) -> list[bytes]:
    f = HEAD_V2.unpack_from(raw)
    index_end, directory = f[6 + 2 * 6], f[22]  # the data section starts after the index
    interesting = [
        0,
        1,
        7,
        255,
        256,
        len(raw) - 1,
        len(raw),
        len(raw) + 1,
        2**31,
        2**32 + 5,
        2**63 - 1,
        2**64 - 1,
    ]
    out = []

    def flip(lo: int, hi: int, fix: bool | None) -> None:
        b = bytearray(raw)
        at = int(rng.integers(lo, hi))
        b[at] ^= 1 << int(rng.integers(8))
        if fix is not None:
            _rechecksum(b, index=fix)
        out.append(bytes(b))

    for _ in range(50):
        flip(0, HEAD_V2.size + 4, None)  # header bytes, checksum left stale
    for _ in range(50):
        flip(0, HEAD_V2.size, False)  # header bytes, header checksum recomputed
    for _ in range(60):
        flip(256, index_end, True)  # index, directory and optional sections, checksums fixed
    for _ in range(30):
        out.append(raw[: int(rng.integers(0, len(raw)))])  # truncations
    for at, code in HEADER_FIELDS:  # every header field set to boundary values
        for v in rng.choice(interesting, 2, replace=False):
            b = bytearray(raw)
            struct.pack_into(code, b, at, int(v) % (1 << (8 * struct.calcsize(code))))
            _rechecksum(b, index=False)
            out.append(bytes(b))
    for e in range(2):  # directory entries: offset, length, rows, cols, then name and dtype
        base = directory + e * ENTRY.size
        for at in (40, 48, 56, 64):
            for v in rng.choice(interesting, 3, replace=False):
                b = bytearray(raw)
                struct.pack_into("<Q", b, base + at, int(v))
                _rechecksum(b, index=True)
                out.append(bytes(b))
        for at, value in [
            (0, b"\xff" * 32),
            (0, b"Targets".ljust(32, b"\0")),
            (32, bytes(8)),
            (32, b"<f8".ljust(8, b"\0")),
            (32, b"|O".ljust(8, b"\0")),
            (32, b">i4".ljust(8, b"\0")),
        ]:
            b = bytearray(raw)
            b[base + at : base + at + len(value)] = value
            _rechecksum(b, index=True)
            out.append(bytes(b))
    for _ in range(40):
        flip(index_end, len(raw), None)  # image data: found by `verify`, decodes or fails
    return out


@pytest.fixture(scope="module")
def mutant_files(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("fuzz")
    files = []
    for i, (w, h, mode) in enumerate([(24, 16, "RGB"), (16, 24, "L"), (20, 20, "CMYK")]):
        p = root / f"{i}.jpg"
        p.write_bytes(make_jpeg_bytes(w, h, seed=i, mode=mode))
        files.append(str(p))
    cache = JpegCache.from_files(
        files, [0, 1, 1], ["a", "b", "c"], classes=["x", "y"], progress=False
    )
    cache = cache._replace(
        extra={"rst": np.array([0, 2, 0], "<i4"), "targets": np.eye(3, dtype="<f4")}
    )
    raw = cache.save(root / "seed.gpucache").read_bytes()
    paths = []
    for k, data in enumerate(_mutants(raw, np.random.default_rng(8))):
        p = root / f"m{k:03d}.gpucache"
        p.write_bytes(data)
        paths.append(p)
    return paths


def test_mutated_stores_never_crash_or_hang(mutant_files):
    assert len(mutant_files) >= 300
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    outcomes: dict[str, str] = {}
    todo = [str(p) for p in mutant_files]
    while todo:
        batch, todo = todo[:PER_CHILD], todo[PER_CHILD:]
        try:
            proc = subprocess.run(
                [sys.executable, "-c", CHILD, *batch],
                env=env,
                timeout=240,
                capture_output=True,
                text=True,
            )
            out, code = proc.stdout, proc.returncode
        except subprocess.TimeoutExpired as err:
            out, code = (err.stdout or b"").decode(), "timeout"
        started = None
        for line in out.splitlines():
            tag, path, *rest = line.split(" ", 2)
            if tag == "START":
                started = path
            else:
                outcomes[path], started = " ".join(rest), None
        if started is not None:  # the child died or hung on this mutant
            outcomes[started] = f"CRASH ({code})"
            todo = batch[batch.index(started) + 1 :] + todo
        elif code != 0:
            raise AssertionError(f"fuzz child exited {code}: {proc.stderr[-2000:]}")
    bad = {Path(p).name: o for p, o in outcomes.items() if o.startswith(("CRASH", "BAD"))}
    assert not bad, f"{len(bad)} mutants crashed, hung or raised the wrong error: {bad}"
    assert len(outcomes) == len(mutant_files)
    kinds = {o.split()[0] for o in outcomes.values()}
    assert kinds == {"format-error", "opened"}, kinds  # both outcomes were exercised
