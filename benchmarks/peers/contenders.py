"""The contenders of the peer run: which interpreter, which driver, which options.

Each peer lives in its own virtual environment under ``--venvs`` (made by ``install.sh``); the
DataLoader and gpucache contenders run under the interpreter that runs ``run.py``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Contender:
    name: str
    what: str
    venv: str | None  # None: this interpreter
    driver: str  # "module:name" for serve.py
    dists: tuple[str, ...] = ()  # distributions whose versions are recorded
    options: dict = field(default_factory=dict)
    flag: str | None = None  # only with this run.py flag
    src: str | None = None  # gpucache contenders: the source tree they import (None: run.py's)

    def python(self, venvs: Path) -> str:
        return sys.executable if self.venv is None else str(venvs / self.venv / "bin" / "python")


def contenders(cap: int, exact_kw: dict, quality: int = 90) -> list[Contender]:
    """Every contender, in table order; ``cap`` is the size cap of gpucache and FFCV ``smart``;
    ``exact_kw``: the loader keywords that turn reduced-size (DCT-scaled) decode off;
    ``quality``: the JPEG quality of the re-encoded gpucache store (FFCV's jpg mode's is 90)."""
    gc = ("gpucache", "torch")
    rst, exact = {"restart_markers": True}, {"loader_kw": exact_kw}
    return [
        Contender(
            "pil",
            "DataLoader + ImageFolder + PIL + torchvision v2; original bytes (files), full decode",
            None,
            "p_torch:pil",
            ("torch", "torchvision", "pillow"),
        ),
        Contender(
            "gpucache",
            "gpucache, default store (saved file), cpu backend; original "
            "bytes, crop-only decode, reduced DCT scale where 2 px per output px remain",
            None,
            "p_torch:gpucache",
            gc,
        ),
        Contender(
            "gpucache-rst",
            "gpucache, restart-marker store; original pixels (lossless "
            "transcode), crop-only decode incl. entropy, reduced scale",
            None,
            "p_torch:gpucache",
            gc,
            {"build_kw": rst},
        ),
        Contender(
            "gpucache-exact",
            "gpucache, default store; original bytes, crop-only decode at full scale (exact=True)",
            None,
            "p_torch:gpucache",
            gc,
            exact,
            flag="exact",
        ),
        Contender(
            "gpucache-rst-exact",
            "gpucache, restart-marker store; crop-only decode at full scale (exact=True)",
            None,
            "p_torch:gpucache",
            gc,
            {"build_kw": rst, **exact},
            flag="exact",
        ),
        Contender(
            f"gpucache-cap{cap}",
            f"gpucache, store built with max_side={cap}; images over {cap} px re-encoded smaller",
            None,
            "p_torch:gpucache",
            gc,
            {"build_kw": {"max_side": cap}},
            flag="max-side",
        ),
        Contender(
            f"gpucache-q{quality}",
            f"gpucache, store re-encoded at quality {quality} "
            f"(jpeg_quality={quality}, 4:2:0, where smaller); crop-only decode",
            None,
            "p_torch:gpucache",
            gc,
            {"build_kw": {"jpeg_quality": quality}},
            flag="jpeg-quality",
        ),
        Contender(
            "dali",
            "DALI CPU pipeline; original bytes, crop-only decode (train and eval)",
            "dali",
            "p_dali:dali",
            ("nvidia-dali-cuda120",),
        ),
        Contender(
            "ffcv-jpg",
            "FFCV jpg mode; bytes re-encoded at quality 90, 4:2:0",
            "ffcv",
            "p_ffcv:ffcv",
            ("ffcv", "numba"),
            {"mode": "jpg"},
        ),
        Contender(
            "ffcv-original",
            "FFCV raw mode; original bytes",
            "ffcv",
            "p_ffcv:ffcv",
            ("ffcv", "numba"),
            {"mode": "original"},
        ),
        Contender(
            f"ffcv-smart{cap}",
            f"FFCV smart mode, max_resolution={cap}; raw pixels (no decode)",
            "ffcv",
            "p_ffcv:ffcv",
            ("ffcv", "numba"),
            {"mode": "smart", "max_resolution": cap},
        ),
        Contender(
            "spdl",
            "SPDL thread pipeline; original bytes, FFmpeg full decode + filter graph",
            "spdl",
            "p_spdl:spdl",
            ("spdl",),
        ),
        Contender(
            "litdata",
            "litdata optimize + StreamingDataLoader; original bytes, decode_jpeg (full) + v2",
            "litdata",
            "p_litdata:litdata",
            ("litdata", "torch"),
        ),
        Contender(
            "streaming",
            "MosaicML Streaming MDS + DataLoader; original bytes, decode_jpeg (full) + v2",
            "streaming",
            "p_streaming:streaming",
            ("mosaicml-streaming", "numpy"),
        ),
    ]
