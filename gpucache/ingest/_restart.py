"""Building restart-marker stores (``restart_markers=True``): the transcode, at build time.

Each 8-bit Huffman JPEG (baseline or progressive) is transcoded losslessly to baseline with a
restart marker every few MCUs (``gpucache._native.transcode``, C through ctypes, which releases the
GIL), as the build reads it: the build's threads transcode their chunk and the transcoded bytes
go straight into the store's buffer, so the build peaks near one copy of the (transcoded) data,
not four. Other samples (PNG, arithmetic-coded, one libjpeg would not transcode) keep their bytes
and get interval 0. The interval per sample goes to the store's ``rst`` section, which the
decoders read (``decode._roi_rst.intervals``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _native
from ..store._oom import BUILD_FIX, raise_if_out_of_memory
from ._pipeline import Encoded, Rewriter
from ._resize import Reencode
from ._sniff import Info, Kind

SECTION = "rst"  # the store's optional section: int32 restart interval per sample


class RestartMarkers:
    """A build rewriter (see ``_pipeline.read_chunk``): the lossless restart-marker transcode."""

    def __init__(self) -> None:
        if not _native.transcoder_available():
            raise RuntimeError(_native.MISSING)
        self._transcode, self.section = _native.transcode, SECTION
        self.columns = {self.section: ("<i4", 0)}

    def __call__(self, data: Encoded, info: Info) -> tuple[Encoded, Info, dict[str, Any]]:
        if info.kind not in (Kind.JPEG, Kind.JPEG_PROGRESSIVE) or info.precision != 8:
            return data, info, {self.section: 0}
        try:
            out, k = self._transcode(bytes(data))  # a no-op for bytes; transcode copies
        except ValueError as err:  # libjpeg refused it: the sample stays as it was (full/ROI)
            # not the image's fault: never left as it was, unasked
            raise_if_out_of_memory(err, "adding restart markers at build", fix=BUILD_FIX)
            return data, info, {self.section: 0}
        return out, info._replace(kind=Kind.JPEG), {self.section: k}

    def sections(self, columns: dict[str, np.ndarray], k: int) -> dict[str, np.ndarray]:
        return {}


def rewriters(
    *, restart_markers: bool, max_side: int | None, jpeg_quality: int | None = None
) -> list[Rewriter]:
    """The build's per-sample rewriters, in the order they apply: the re-encode (size cap,
    quality), then the transcode (so a re-encoded image gets restart markers too)."""
    steps: list[Rewriter] = []
    if max_side is not None or jpeg_quality is not None:
        steps.append(Reencode(max_side, jpeg_quality))
    if restart_markers:
        steps.append(RestartMarkers())
    return steps
