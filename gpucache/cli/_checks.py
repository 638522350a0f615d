"""``gpucache verify``: every sample's checksum and (optionally) decode, on every usable core.

Stores saved by this version hold one CRC-32 per sample (section ``sample.crc32``), so a corrupt
sample is found by index and path, even when its bytes still decode (a flipped bit in the
entropy-coded data decodes to wrong pixels without an error). Older stores have only the whole
data CRC: a mismatch there says the data is corrupt, not where.

Both passes run on a thread pool over chunks of samples (``zlib.crc32`` and torchvision's
``decode_jpeg`` release the GIL), with at most two chunks per thread in flight, so memory stays
O(threads x chunk) at any N.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..base._progress import tqdm
from ..base._threads import ordered_map
from ..store import _checksum
from ..store._format import SAMPLE_CRC
from ..store._oom import BUILD_FIX, raise_if_out_of_memory
from ..store._store import Store

if TYPE_CHECKING:
    import torch

DECODE_CHUNK = 64  # samples per decode task


@dataclass(frozen=True)
class Problem:
    """A sample that failed a check (``index`` None: the whole data section)."""

    index: int | None
    path: str | None
    reason: str

    def __str__(self) -> str:
        where = "data section" if self.index is None else f"sample {self.index} ({self.path})"
        return f"{where}: {self.reason}"


def _bar(total: int, desc: str, unit: str, progress: bool, **kw: Any) -> tqdm:
    return tqdm(
        total=total, desc=desc, unit=unit, disable=None if progress else True, leave=False, **kw
    )


def check_checksums(
    cache: Store, *, threads: int | None = None, progress: bool = True
) -> list[Problem]:
    """Problems found by the stored checksums: per sample where the store has them."""
    parsed = cache._file
    if parsed is None:  # built in memory: no stored checksum to compare with
        raise ValueError(
            "the checksums are those of a saved store: save it, then check JpegCache.open(path)"
        )
    stored = parsed.extra.get(SAMPLE_CRC)
    if stored is None:
        with _bar(cache.nbytes, "checksum", "B", progress, unit_scale=True) as bar:
            crc = _checksum.crc32(cache._data, threads=threads, on_bytes=bar.update)
        if crc == parsed.data_crc:
            return []
        return [
            Problem(
                None,
                None,
                f"data checksum mismatch (stored {parsed.data_crc:08x}, "
                f"computed {crc:08x}): the image data is corrupt; this store has no "
                "per-sample checksums to say where (save it again with this version "
                "to add them, or rebuild it)",
            )
        ]
    with _bar(len(cache), "checksum", "img", progress) as bar:
        computed = _checksum.sample_crcs(
            cache._data, cache._offsets, threads=threads, on_samples=bar.update
        )
    bad = np.flatnonzero(computed != stored)
    paths = cache.paths
    return [
        Problem(
            int(i),
            paths[int(i)],
            f"checksum mismatch (stored {int(stored[i]):08x}, "
            f"computed {int(computed[i]):08x}): its bytes are corrupt",
        )
        for i in bad
    ]


def _decode_noting(cache: Store, i: int, k: int) -> tuple[torch.Tensor, str | None]:
    """Sample ``i`` decoded in full by the route the loader takes, and libjpeg's warning about it
    (corrupt data decoded anyway) or None. Through the compiled decoder where it takes the
    sample, which hands the warning back instead of printing it unattributed on stderr: from its
    restart segments where the store records an interval ``k`` for it (the loader's crop route:
    a sample whose bytes do not match ``k`` fails with the reason), else by the region decoder;
    otherwise as the loader decodes in full (``k`` checked against the bytes all the same)."""
    from ..decode import _roi, _roi_rst
    from ..decode._sample import ROI_KINDS, decode_sample
    from ..store._limits import check_pixels

    rec = cache.samples[i]
    height, width = int(rec["height"]), int(rec["width"])
    try:
        if (
            _roi.region_decoder(int(rec["components"])) is _roi._c_region
            and rec["kind"] in ROI_KINDS
            and rec["precision"] == 8
        ):
            check_pixels(cache, i)
            _roi.take_warning()
            image = _roi.Oriented(height, width, int(rec["orientation"]))
            whole = (0, 0, height, width)
            if k:
                img = _roi_rst.decode_crop(cache[i], k, whole, image, region=_roi._c_region)
            else:
                img = _roi.decode_crop(cache[i], whole, image, region=_roi._c_region)
            return img, _roi.take_warning()
        if k:
            _roi_rst.check_interval(cache[i], k)
    except _roi_rst.IntervalMismatch as err:
        raise _roi_rst.IntervalMismatch(_roi_rst.mismatch_reason(k, err)) from err
    return decode_sample(cache, i), None


def check_decodes(
    cache: Store,
    *,
    threads: int | None = None,
    progress: bool = True,
    warned: list[Problem] | None = None,
) -> list[Problem]:
    """Problems found by decoding every sample in full (and checking its size). Samples that
    decode with a libjpeg warning (corrupt data decoded anyway) are appended to ``warned``."""
    from ..decode._outcome import check_size
    from ..decode._roi_rst import intervals

    n = len(cache)
    restart = intervals(cache)
    paths = cache.paths

    def one(first: int) -> list[Problem]:
        found = []
        for i in range(first, min(first + DECODE_CHUNK, n)):
            try:
                img, note = _decode_noting(cache, i, 0 if restart is None else int(restart[i]))
                check_size(cache, i, img)
                if note is not None and warned is not None:
                    warned.append(Problem(i, paths[i], f"libjpeg: {note} (decoded anyway)"))
            except Exception as err:  # report every sample, keep going
                # the machine's problem: no sample reported for it
                raise_if_out_of_memory(err, f"verifying sample {i} ({paths[i]})", fix=BUILD_FIX)
                found.append(Problem(i, paths[i], f"{type(err).__name__}: {err}"))
        return found

    found: list[Problem] = []
    starts: Iterator[int] = iter(range(0, n, DECODE_CHUNK))
    with _bar(n, "decode", "img", progress) as bar:
        for first, part in zip(
            range(0, n, DECODE_CHUNK),
            ordered_map(one, starts, threads or _checksum.default_threads()),
        ):
            found += part
            bar.update(min(DECODE_CHUNK, n - first))
    return found


def check_masks(
    cache: Store, *, threads: int | None = None, progress: bool = True
) -> list[Problem]:
    """Problems found by decoding every mask in full: each must decode to the kind, height and
    width its record (``masks.info``) states. The mask bytes' section CRC is checked at open."""
    from ..ingest._masks import decode_mask
    from ..store._masks import MaskKind
    from ..store._png import check_stored

    masks = cache.masks
    if masks is None:  # no masks, no mask problems
        return []
    n = len(masks)
    paths = cache.paths

    def one(first: int) -> list[Problem]:
        found = []
        for i in range(first, min(first + DECODE_CHUNK, n)):
            kind, h, w = MaskKind(int(masks.kinds[i])), int(masks.heights[i]), int(masks.widths[i])
            try:
                check_stored(masks[i], int(masks.kinds[i]), h, w)  # before any pixel
                got = decode_mask(masks[i])
                if got.shape != (h, w) or got.dtype != kind.dtype:
                    raise ValueError(
                        f"decodes to {got.dtype} {got.shape}, its record says {kind.name} "
                        f"({kind.dtype}) ({h}, {w})"
                    )
            except Exception as err:  # report every mask, keep going
                raise_if_out_of_memory(err, f"verifying mask {i} ({paths[i]})", fix=BUILD_FIX)
                found.append(Problem(i, paths[i], f"mask: {type(err).__name__}: {err}"))
        return found

    found: list[Problem] = []
    with _bar(n, "masks", "mask", progress) as bar:
        for first, part in zip(
            range(0, n, DECODE_CHUNK),
            ordered_map(
                one, iter(range(0, n, DECODE_CHUNK)), threads or _checksum.default_threads()
            ),
        ):
            found += part
            bar.update(min(DECODE_CHUNK, n - first))
    return found
