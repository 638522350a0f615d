"""Stores whose mask records lie (altered after their build, checksums valid): each mask's PNG
header is checked against its record before a pixel is decoded, so values are never cut to 8
bits and a huge claimed size costs nothing; and a loop's process out of file descriptors still
gets every batch."""

from __future__ import annotations

import struct
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from gpucache import GpuCachedLoader, JpegCache, SampleError
from gpucache import transforms as T
from gpucache.cli import main
from gpucache.store import _format
from gpucache.store._masks import DATA, INFO, OFFSETS, MaskKind
from gpucache.testing import make_jpeg_bytes, make_mask_png

H, W = 24, 32


def _store(tmp_path: Path, mode: str) -> JpegCache:
    """Four images with masks of ``mode``; sample 1's mask holds 1 and 307 (16-bit) or 1 and 51."""
    images, masks = [], []
    for k in range(4):
        (tmp_path / f"{k}.jpg").write_bytes(make_jpeg_bytes(W, H, seed=k))
        values = np.ones((H, W), np.int64)
        values[:, W // 2 :] = 307 if mode == "I;16" else 51
        images.append(tmp_path / f"{k}.jpg")
        masks.append(make_mask_png(values, mode))
    return JpegCache.from_files(images, masks=masks, progress=False)


def _altered(tmp_path: Path, cache: JpegCache, **sections: np.ndarray) -> JpegCache:
    """``cache`` saved with some sections replaced (valid checksums: written by the format's
    own writer), and opened again."""
    arrays = cache._stored()
    arrays = arrays.with_sections({**sections})
    path = tmp_path / "altered.gpucache"
    with open(path, "wb") as f:
        _format.write(f, arrays)
    return JpegCache.open(path)


def _with_mask(cache: JpegCache, i: int, png: bytes) -> dict[str, np.ndarray]:
    """The mask sections with sample ``i``'s PNG replaced by ``png``."""
    pieces = [np.asarray(cache.masks[k]).tobytes() for k in range(len(cache))]
    pieces[i] = png
    offsets = np.concatenate([[0], np.cumsum([len(p) for p in pieces])]).astype(np.int64)
    return {DATA: np.frombuffer(b"".join(pieces), np.uint8), OFFSETS: offsets}


def _claiming(png: bytes, height: int, width: int) -> bytes:
    """``png`` with its IHDR claiming ``height`` x ``width`` (the chunk's CRC made valid)."""
    body = png[12:16] + struct.pack(">II", width, height) + png[24:29]
    return png[:8] + png[8:12] + body + struct.pack(">I", zlib.crc32(body)) + png[33:]


LOADER = dict(batch_size=4, seed=0, transform=[T.RandomResizedCrop(16), T.RandomHorizontalFlip()])


@pytest.mark.parametrize("workers", [0, 2])
def test_a_16_bit_mask_recorded_as_8_bit_is_a_sample_error_never_cut(tmp_path, workers):
    cache = _store(tmp_path, "I;16")
    info = np.array(cache.extra[INFO])
    info[:, 0] = int(MaskKind.L)  # every mask now claims 8-bit values
    lying = _altered(tmp_path, cache, **{INFO: info})
    with GpuCachedLoader(lying, num_workers=workers, on_error="raise", **LOADER) as loader:
        with pytest.raises(SampleError, match="16-bit greyscale, but the store records it as L"):
            next(iter(loader))
    with GpuCachedLoader(lying, num_workers=workers, on_error="skip", **LOADER) as loader:
        with pytest.warns(RuntimeWarning, match="16-bit greyscale"):
            got = list(loader)
        assert sum(len(m) for _, m in got) == 0  # nothing cut modulo 256 slipped through
        assert sorted(i for i, _ in loader.stats.skipped_samples) == [0, 1, 2, 3]


def test_a_mask_header_claiming_a_huge_size_is_refused_before_decoding(tmp_path):
    cache = _store(tmp_path, "L")
    real = np.asarray(cache.masks[2]).tobytes()
    lying = _altered(tmp_path, cache, **_with_mask(cache, 2, _claiming(real, 40000, 40000)))
    with GpuCachedLoader(lying, num_workers=0, on_error="skip", **LOADER) as loader:
        with pytest.warns(RuntimeWarning, match="40000x40000.*24x32"):
            got = list(loader)
    assert sum(len(m) for _, m in got) == 3
    assert [i for i, _ in loader.stats.skipped_samples] == [2]


def test_verify_reports_each_lying_mask_by_sample(tmp_path, capsys):
    cache = _store(tmp_path, "I;16")
    info = np.array(cache.extra[INFO])
    info[1, 0] = int(MaskKind.L)
    sections = _with_mask(cache, 3, _claiming(np.asarray(cache.masks[3]).tobytes(), 40000, 40000))
    lying = _altered(tmp_path, cache, **{INFO: info}, **sections)
    assert main(["verify", str(lying.path)]) == 1
    said = capsys.readouterr()
    out = said.out + said.err
    assert "2 of 4 masks decode" in out
    assert "16-bit greyscale, but the store records it as L" in out
    assert "PNG header says 40000x40000" in out


def test_a_loop_out_of_file_descriptors_still_gets_every_batch(tmp_path):
    """Out of descriptors, the loop's process cannot receive a worker's memory file: the batch
    is decoded there instead, with a warning naming the open-file limit, and once descriptors
    are free again the next epoch's batches come as memory files. In a child process: the
    limit is the process's own."""
    root = tmp_path / "photos"
    (root / "a").mkdir(parents=True)
    for k in range(32):
        (root / "a" / f"{k}.jpg").write_bytes(make_jpeg_bytes(40, 30, seed=k))
    script = textwrap.dedent(
        f"""
        import os, warnings
        import numpy as np
        from gpucache import GpuCachedLoader, JpegCache
        from gpucache import transforms as T

        cache = JpegCache.from_folder({str(root)!r}, progress=False)
        kw = dict(batch_size=4, seed=1, transform=[T.RandomResizedCrop(16)])
        with GpuCachedLoader(cache, num_workers=0, **kw) as inline:
            want = [x for x, _ in inline]
            want_next = [x for x, _ in inline]  # the next epoch's plans
        with GpuCachedLoader(cache, num_workers=2, multiprocessing_context="fork", **kw) as loader:
            batches = iter(loader)
            first = [next(batches)[0]]  # the workers run
            held = []
            try:
                while True:
                    held.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                pass  # every descriptor taken
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                rest = [x.clone() for x, _ in batches]
            for fd in held:
                os.close(fd)
            again = [x for x, _ in loader]
        said = [str(w.message) for w in caught if "file descriptors" in str(w.message)]
        assert len(said) == 1 and "RLIMIT_NOFILE" in said[0], [str(w.message) for w in caught]
        got = first + rest
        assert len(got) == len(want) == len(again) == 8
        assert all((g == w).all() for g, w in zip(got, want))
        assert all((g == w).all() for g, w in zip(again, want_next))
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        preexec_fn=lambda: __import__("resource").setrlimit(
            __import__("resource").RLIMIT_NOFILE, (256, 256)
        ),
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_an_honest_16_bit_store_keeps_its_values(tmp_path):
    """The header check passes every mask the build wrote (the control for the cases above)."""
    cache = _store(tmp_path, "I;16")
    with GpuCachedLoader(cache, num_workers=0, on_error="raise", **LOADER) as loader:
        values = torch.cat([m.flatten() for _, m in loader]).unique().tolist()
    assert values == [1, 307]
