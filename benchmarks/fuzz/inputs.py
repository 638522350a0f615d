"""The fuzz loop over the library's own input paths that benchmarks/fuzz/run.py runs with
``--inputs`` in a child process (ASan runtime preloaded, gpucache's compiled decoder replaced by
the sanitized build), through the public API:

* ``mask``: mask PNGs (8-bit, palette, 16-bit) mutated the way bombs and liars are made (an IHDR
  claiming huge or other dimensions, a zlib bomb behind valid dimensions or behind huge ones,
  short or missing palettes, palette bit depths, tRNS, a bit depth or colour type that lies
  about the data, interlacing, chunk lengths and CRCs, truncation, bit flips, chunks repeated or
  after IEND), paired with the middle one of three images whose masks are sound:
  ``JpegCache.from_files(masks=...)`` (``on_error="skip"``), then a loader epoch with
  ``masks=True``. Each input ends as a refusal at build or at decode (named by its reason) or
  as a mask delivered, which must be PIL's reading of the stored PNG value for value; the two
  sound samples must come with their own masks and labels, always.
* ``share``: a node share saved, its share sections rewritten with lies (layout fields, ranks
  out of range, repeated or moved, a listing that is not a digest, negative counts) in a store
  whose checksums are valid: ``JpegCache.open`` and a loader epoch over it. Each ends as a
  named error (``CacheFormatError``, ``ShareError``, ``ValueError``) or an epoch whose every
  sample is a sample of the store with its own label (each image has a size of its own).
* ``names``: listings whose names collide once the common folder is stripped (a file listed
  twice, ``./`` and ``//`` spellings of one path, names equal after the first folder), built as
  the shares of 2 to 5 nodes: every listed position in exactly one share, every kept sample's
  bytes those of its own file.

    inputs.py LIB OUT SEED SECONDS
    inputs.py LIB --replay FILE...        # saved inputs (current.json of a crash) once each

Before each iteration the input is written to OUT/current.json (its kind, bytes base64), so
the parent can keep the one a sanitizer report ended. Prints a JSON line of running totals
every 50 iterations and at the end: iterations, outcomes by name, findings.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import io
import json
import os
import random
import struct
import sys
import tempfile
import time
import warnings
import zlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

sys.modules.setdefault("triton", None)  # type: ignore[arg-type]  # torch need not import it:
# seconds a child, and nothing of the library's input paths runs in it

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from gpucache import (  # noqa: E402
    CacheFormatError,
    GpuCachedLoader,
    JpegCache,
    ShareError,
    _native,  # noqa: E402
)
from gpucache.shares._record import FETCHED, LAYOUT, LISTING, RANKS  # noqa: E402
from gpucache.store import _format  # noqa: E402
from gpucache.testing import make_jpeg_bytes, make_mask_png  # noqa: E402

H, W = 24, 32  # the images' size, and so their masks'
SIG = b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------ PNG chunks
def chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    out, at = [], len(SIG)
    while at + 8 <= len(data):
        n, kind = struct.unpack(">I4s", data[at : at + 8])
        out.append((kind, data[at + 8 : at + 8 + n]))
        at += 12 + n
    return out


def chunk(kind: bytes, body: bytes, length: int | None = None, crc: int | None = None) -> bytes:
    c = zlib.crc32(kind + body) if crc is None else crc
    return (
        struct.pack(">I", len(body) if length is None else length)
        + kind
        + body
        + struct.pack(">I", c & 0xFFFFFFFF)
    )


def png(parts: list[tuple[bytes, bytes]]) -> bytes:
    return SIG + b"".join(chunk(k, b) for k, b in parts)


def ihdr(width: int, height: int, depth: int, colour: int, interlace: int = 0) -> bytes:
    return struct.pack(">IIBBBBB", width, height, depth, colour, 0, 0, interlace)


def seed_mask(rng: random.Random) -> bytes:
    mode = rng.choice(["L", "P", "I;16"])
    top = 65535 if mode == "I;16" else 255
    values = np.random.default_rng(rng.getrandbits(32)).integers(
        0, rng.choice([2, 8, top + 1]), (H, W)
    )
    return make_mask_png(values.astype(np.uint16 if mode == "I;16" else np.uint8), mode)


def bomb(width: int, height: int, extra_rows: int) -> bytes:
    z = zlib.compressobj(9)
    row = bytes(width + 1)
    body = b"".join(z.compress(row) for _ in range(height + extra_rows)) + z.flush()
    return png([(b"IHDR", ihdr(width, height, 8, 0)), (b"IDAT", body), (b"IEND", b"")])


def mutate_mask(data: bytes, rng: random.Random) -> tuple[str, bytes]:
    """One named mutation of a mask PNG."""
    parts = chunks(data)
    head = parts[0][1]
    w, h, depth, colour, _, _, lace = struct.unpack(">IIBBBBB", head)
    how = rng.choice(
        [
            "huge-ihdr",
            "other-size",
            "bomb-tail",
            "bomb-huge",
            "palette-short",
            "palette-depth",
            "trns",
            "no-plte",
            "depth-lie",
            "colour-lie",
            "interlace-lie",
            "length-lie",
            "crc",
            "truncate",
            "bitflip",
            "chunk-order",
        ]
    )
    if how == "huge-ihdr":
        big = rng.choice([2**16, 2**24, 2**31 - 1, 46341, 40000])
        w2, h2 = (big, h) if rng.random() < 0.3 else (w, big) if rng.random() < 0.5 else (big, big)
        parts[0] = (b"IHDR", ihdr(w2, h2, depth, colour, lace))
    elif how == "other-size":
        parts[0] = (b"IHDR", ihdr(rng.randint(1, 64), rng.randint(1, 64), depth, colour, lace))
    elif how == "bomb-tail":  # valid dimensions, 64 MB of rows more in the stream
        return how, bomb(W, H, 2_000_000)
    elif how == "bomb-huge":
        side = rng.choice([20000, 40000])
        return how, bomb(side, side, 0)
    elif how == "palette-short":
        parts = [(k, b[: 3 * rng.randint(0, 3)] if k == b"PLTE" else b) for k, b in parts]
        if colour != 3:
            parts[0] = (b"IHDR", ihdr(w, h, 8, 3, lace))
            parts.insert(1, (b"PLTE", bytes(3 * rng.randint(1, 4))))
    elif how == "palette-depth":
        d = rng.choice([1, 2, 4])
        rows = np.random.default_rng(rng.getrandbits(32)).integers(0, 256, (h, (w * d + 7) // 8))
        raw = b"".join(b"\0" + bytes(r.astype(np.uint8)) for r in rows)
        parts = [
            (b"IHDR", ihdr(w, h, d, 3)),
            (b"PLTE", bytes(range(3 * rng.randint(1, 2**d)))),
            (b"IDAT", zlib.compress(raw)),
            (b"IEND", b""),
        ]
    elif how == "trns":
        parts.insert(-1 if rng.random() < 0.5 else 1, (b"tRNS", os.urandom(rng.randint(0, 300))))
    elif how == "no-plte":
        parts = [(k, b) for k, b in parts if k != b"PLTE"]
        parts[0] = (b"IHDR", ihdr(w, h, depth, 3, lace))
    elif how == "depth-lie":
        parts[0] = (b"IHDR", ihdr(w, h, rng.choice([1, 2, 4, 8, 16, 3, 0, 32]), colour, lace))
    elif how == "colour-lie":
        parts[0] = (b"IHDR", ihdr(w, h, depth, rng.choice([0, 2, 3, 4, 6, 5, 7]), lace))
    elif how == "interlace-lie":
        parts[0] = (b"IHDR", ihdr(w, h, depth, colour, rng.choice([1, 2])))
    elif how in ("length-lie", "crc"):
        k = rng.randrange(len(parts))
        kind, body = parts[k]
        out = SIG
        for j, (kk, bb) in enumerate(parts):
            if j != k:
                out += chunk(kk, bb)
            elif how == "length-lie":
                out += chunk(
                    kind, body, length=rng.choice([0, len(body) + 1, 2**31 - 1, 2**32 - 1])
                )
            else:
                out += chunk(kind, body, crc=rng.getrandbits(32))
        return how, out
    elif how == "truncate":
        return how, data[: rng.randrange(len(data))]
    elif how == "bitflip":
        b = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(SIG), len(b))
            b[i] ^= 1 << rng.randrange(8)
        return how, bytes(b)
    elif how == "chunk-order":
        what = rng.choice(["ihdr-twice", "no-iend", "after-iend", "idat-split"])
        if what == "ihdr-twice":
            parts.insert(1, (b"IHDR", ihdr(w * 2 + 1, h, depth, colour, lace)))
        elif what == "no-iend":
            parts = parts[:-1]
        elif what == "after-iend":
            parts.append((b"IDAT", zlib.compress(bytes(10_000))))
        else:
            at = [i for i, (k, _) in enumerate(parts) if k == b"IDAT"][0]
            body = parts[at][1]
            cut = rng.randrange(len(body) + 1)
            parts[at : at + 1] = [(b"IDAT", body[:cut]), (b"tEXt", b"x\0y"), (b"IDAT", body[cut:])]
        how = f"{how}:{what}"
    return how, png(parts)


def reference(data: bytes) -> np.ndarray | None:
    """PIL's reading of a mask (palette indices, 16-bit values), or None where it fails."""
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
            return np.asarray(im).astype(np.int64)
    except Exception:  # noqa: BLE001 - PIL's reasons are many
        return None


def named(reason: str) -> str:
    """A refusal's reason without its numbers: the outcome's name."""
    words = "".join("#" if c.isdigit() else c for c in reason)
    while "##" in words:
        words = words.replace("##", "#")
    return words[:90]


# ------------------------------------------------------------------ targets
class Targets:
    def __init__(self, out: Path, stats: dict) -> None:
        self.out, self.stats = out, stats
        self.images = [make_jpeg_bytes(W, H, seed=k) for k in range(3)]
        self.sound = [make_mask_png(np.full((H, W), k + 1, np.uint8), "L") for k in range(3)]
        self._tmp = tempfile.TemporaryDirectory(prefix="gpucache-fuzz-inputs-")
        self.tmp = Path(self._tmp.name)
        self.shares = self._shares()

    def outcome(self, kind: str, what: str) -> None:
        self.stats["outcomes"][f"{kind}: {what}"] += 1

    def finding(self, kind: str, how: str, what: str, data: dict) -> None:
        self.stats["findings"].append({"kind": kind, "how": how, "what": what, **data})

    # -- masks
    def mask(self, how: str, data: bytes) -> None:
        masks = [self.sound[0], data, self.sound[2]]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                cache = JpegCache.from_files(
                    self.images, [0, 1, 2], masks=masks, on_error="skip", progress=False
                )
            except MemoryError:
                self.finding("mask", how, "MemoryError at build", {})
                return
            skipped = {i: r for i, _, r in _skipped(cache)}
            if 0 in skipped or 2 in skipped or len(cache) != 3 - len(skipped):
                self.finding("mask", how, f"a sound sample was refused: {skipped}", {})
                return
            if 1 in skipped:
                self.outcome("mask", "refused at build: " + named(skipped[1]))
                return
            stored = bytes(cache.masks[1])
            loader = GpuCachedLoader(
                cache,
                batch_size=3,
                num_workers=0,
                masks=True,
                on_error="skip",
                return_metadata=True,
            )
            got: dict[int, np.ndarray] = {}
            for images, ms, info in loader:
                assert info.labels is not None  # the labels, which the masks replace
                for img, m, label in zip(images, ms, info.labels.tolist()):
                    got[label] = m.numpy().astype(np.int64)
                    if tuple(img.shape[1:]) != (H, W):
                        self.finding("mask", how, "an image of another size", {})
            decode_skipped = {int(cache.labels[i]): r for i, r in loader.stats.skipped_samples}
        for k in (0, 2):
            if k not in got or not (got[k] == k + 1).all():
                self.finding("mask", how, f"sample {k} came without its own mask", {})
        if 1 in decode_skipped or 1 not in got:
            self.outcome("mask", "refused at decode: " + named(str(decode_skipped.get(1, "?"))))
            return
        want = reference(stored)
        if want is None:
            self.finding("mask", how, "delivered a mask PIL cannot read", {})
        elif want.shape != got[1].shape or not (want == got[1]).all():
            self.finding("mask", how, "delivered values that differ from PIL's", {})
        else:
            self.outcome("mask", f"delivered as PIL reads it ({how.split(':')[0]})")

    # -- shares
    def _shares(self) -> list[Path]:
        files = []
        for k in range(12):
            f = self.tmp / "src" / f"c{k:02d}" / "x.jpg"
            f.parent.mkdir(parents=True)
            f.write_bytes(make_jpeg_bytes(16 + k, 16, seed=k))  # a width of its own
            files.append(f)
        out = []
        for node in range(2):
            with as_node(2, node):
                cache = JpegCache.from_files(
                    files, list(range(12)), shard="node", progress=False, cache_dir=self.tmp / "n"
                )
            assert cache.path is not None
            out.append(cache.path)
        return out

    def share(self, how: str, node: int, extra: dict[str, np.ndarray]) -> None:
        base = JpegCache.open(self.shares[node])
        arrays = base._stored()
        arrays = arrays.with_sections({**extra})
        path = self.tmp / "lying.gpucache"
        with open(path, "wb") as f:
            _format.write(f, arrays)
        try:
            cache = JpegCache.open(path)
            loader = GpuCachedLoader(
                cache, batch_size=2, num_workers=0, num_replicas=4, rank=2 * node
            )
            seen = []
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for images, labels in loader:
                    for img, y in zip(images, labels.tolist()):
                        seen.append(y)
                        if tuple(img.shape[1:]) != (16, 16 + y):
                            self.finding("share", how, f"label {y} came with another image", {})
            if not set(seen) <= set(cache.labels.tolist()):
                self.finding("share", how, "played a label the store does not hold", {})
            self.outcome("share", f"played its own samples ({how})")
        except (CacheFormatError, ShareError, ValueError) as err:
            self.outcome("share", f"{type(err).__name__}: {named(str(err))[:60]}")

    def share_lie(self, rng: random.Random) -> tuple[str, int, dict[str, np.ndarray]]:
        node = rng.randrange(2)
        share = JpegCache.open(self.shares[node]).node_share
        assert share is not None
        layout = np.array([1, share.partitions, share.total, share.nodes, share.node], "<i8")
        ranks = np.asarray(share.ranks, "<i8").copy()
        how = rng.choice(["layout", "ranks", "listing", "fetched"])
        extra: dict[str, np.ndarray] = {}
        if how == "layout":
            field = rng.randrange(5)
            layout[field] = rng.choice([0, 1, 2, 3, -1, 2**31, 2**62, share.total - 1, 7])
            how = f"layout[{field}]"
            extra[LAYOUT] = layout
        elif how == "ranks":
            what = rng.choice(["out", "repeat", "other-node", "negative", "shuffled"])
            if what == "out":
                ranks[rng.randrange(len(ranks))] = share.total + rng.randint(0, 5)
            elif what == "repeat" and len(ranks) > 1:
                ranks[1] = ranks[0]
            elif what == "other-node":
                ranks[rng.randrange(len(ranks))] = (ranks.max() + 1) % share.total
            elif what == "negative":
                ranks[0] = -1
            else:
                rng.shuffle(ranks)  # type: ignore[arg-type]
            how = f"ranks:{what}"
            extra[RANKS] = ranks
        elif how == "listing":
            extra[LISTING] = np.frombuffer(os.urandom(32), np.uint8).copy()
        else:
            extra[FETCHED] = np.array([-1, 0, 0, 0], "<i8")
        return how, node, extra

    # -- names
    def names(self, rng: random.Random) -> None:
        root = self.tmp / f"names{rng.getrandbits(24)}"
        (root / "a" / "b").mkdir(parents=True)
        (root / "c").mkdir()
        files = []
        for k in range(rng.randint(3, 9)):
            f = root / rng.choice(["a", "a/b", "c"]) / f"{k}.jpg"
            f.write_bytes(make_jpeg_bytes(16 + k, 16, seed=100 + k))
            files.append(f)
        listing: list[str] = []
        for f in files:
            spell = rng.choice(["plain", "dot", "slashes", "twice"])
            p = str(f)
            if spell == "dot":
                p = str(f.parent) + "/./" + f.name
            elif spell == "slashes":
                p = str(f.parent) + "//" + f.name
            listing.append(p)
            if spell == "twice":
                listing.append(p)
        rng.shuffle(listing)
        nodes = rng.randint(2, 5)
        held: Counter = Counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for node in range(nodes):
                with as_node(nodes, node):
                    try:
                        cache = JpegCache.from_files(
                            listing, list(range(len(listing))), shard="node", progress=False
                        )
                    except ShareError:  # an empty share (fewer samples than nodes)
                        self.outcome("names", "ShareError: an empty share")
                        continue
                for i in range(len(cache)):
                    y = int(cache.labels[i])
                    held[y] += 1
                    if bytes(cache[i]) != Path(listing[y]).read_bytes():
                        self.finding("names", "collide", f"label {y} holds another file", {})
        if len(held) != len(listing) or any(v != 1 for v in held.values()):
            self.finding("names", "collide", f"positions held {dict(held)}", {"listing": listing})
            return
        self.outcome("names", f"every position in one share ({nodes} nodes)")


def _skipped(cache) -> list[tuple[int, str, str]]:
    """(input index, path, reason) of each input the build left out."""
    report = cache.report
    return [(s.index, s.path, s.reason) for s in (report.skipped if report else [])]


@contextlib.contextmanager
def as_node(nodes: int, node: int) -> Iterator[None]:
    """This process as local rank 0 of ``node``, in torchrun's words (one rank a node)."""
    keys = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "RANK", "LOCAL_RANK")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(
        WORLD_SIZE=str(nodes), LOCAL_WORLD_SIZE="1", GROUP_RANK=str(node), RANK=str(node)
    )
    os.environ["LOCAL_RANK"] = "0"
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ------------------------------------------------------------------ the loop
def sanitized(lib: str) -> None:
    """gpucache's compiled decoder replaced by the sanitized build, every signature set."""
    found = ctypes.CDLL(lib)
    _native._bind(found)
    _native._state["lib"] = found


def new_stats() -> dict:
    return {"iterations": 0, "outcomes": Counter(), "findings": [], "seconds": 0.0}


def report(stats: dict) -> None:
    print(json.dumps({**stats, "outcomes": dict(stats["outcomes"])}), flush=True)


def run_one(t: Targets, item: dict) -> None:
    if item["kind"] == "mask":
        t.mask(item["how"], base64.b64decode(item["data"]))
    elif item["kind"] == "share":
        extra = {k: np.asarray(v[1], dtype=v[0]) for k, v in item["extra"].items()}
        t.share(item["how"], item["node"], extra)
    else:
        t.names(random.Random(item["seed"]))


def draw(t: Targets, rng: random.Random) -> dict:
    kind = rng.choices(["mask", "share", "names"], weights=[6, 2, 1])[0]
    if kind == "mask":
        how, data = mutate_mask(seed_mask(rng), rng)
        return {"kind": kind, "how": how, "data": base64.b64encode(data).decode()}
    if kind == "share":
        how, node, extra = t.share_lie(rng)
        return {
            "kind": kind,
            "how": how,
            "node": node,
            "extra": {k: [str(v.dtype), v.tolist()] for k, v in extra.items()},
        }
    return {"kind": kind, "seed": rng.getrandbits(32)}


def main() -> None:
    lib, out = sys.argv[1], Path(sys.argv[2])
    sanitized(lib)
    stats = new_stats()
    t = Targets(out, stats)
    if sys.argv[3] == "--replay":
        for f in sys.argv[4:]:
            run_one(t, json.loads(Path(f).read_text()))
            stats["iterations"] += 1
        report(stats)
        return
    rng, started = random.Random(int(sys.argv[3])), time.monotonic()
    deadline = started + float(sys.argv[4])
    current = out / "current.json"
    while time.monotonic() < deadline:
        item = draw(t, rng)
        current.write_text(json.dumps(item))
        run_one(t, item)
        stats["iterations"] += 1
        stats["seconds"] = time.monotonic() - started
        if stats["iterations"] % 50 == 0:
            report(stats)
    current.unlink(missing_ok=True)
    report(stats)


if __name__ == "__main__":
    main()
